"""Strategies by name, and the config rules they declare, checked before any process starts.

Every module of this package is imported once, on first use, and each ``Strategy`` subclass
with a ``name`` is registered: adding a strategy is adding a module. Heavy torch packages
(FSDP, pipelining, DCP) are imported by the strategies only when they run.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from functools import cache

from leantrain.config import TrainConfig
from leantrain.errors import ConfigError
from leantrain.strategies.base import Strategy
from leantrain.strategies.sync_batch_norm import check_sync_batch_norm

AUTO = "auto"  # ddp when launched as several processes, else single


@cache
def strategies() -> dict[str, type[Strategy]]:
    """Every strategy, by name."""
    import leantrain.strategies as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    found: dict[str, type[Strategy]] = {}
    pending = [Strategy]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        # Only the package's own modules, as they are loaded now (not an unloaded module's class),
        # and a class that names itself (not a variant inheriting its strategy's: with_tensor_parallel).
        own = cls.__module__.startswith(package.__name__ + ".") and cls.__module__ in sys.modules
        if "name" in vars(cls) and cls.name and own:
            found[cls.name] = cls
    return dict(sorted(found.items()))


def names() -> list[str]:
    """What ``--strategy`` accepts."""
    return [AUTO, *strategies()]


def strategy_class(name: str, world_size: int | None = None) -> type[Strategy]:
    """The strategy a config names (``auto`` needs ``world_size``: ddp for several processes)."""
    if name == AUTO:
        name = "ddp" if world_size and world_size > 1 else "single"
    known = strategies()
    if name not in known:
        raise ConfigError("strategy", name, f"allowed: {', '.join(names())}")
    return known[name]


def check_config(cfg: TrainConfig, world_size: int | None = None) -> type[Strategy]:
    """The strategy of ``cfg``, once every rule that involves it holds; else a ConfigError.

    ``world_size``: the processes launched, when known (None before a launch: what can be
    checked alone is checked). The batch must then split over the data-parallel ranks.
    """
    if cfg.strategy == AUTO and world_size is None:
        _check_fields(cfg, None)
        check_sync_batch_norm(cfg, None)
        return strategy_class(AUTO, 1)
    cls = _with_layout(cfg, strategy_class(cfg.strategy, world_size))
    _check_fields(cfg, cls)
    check_sync_batch_norm(cfg, cls)
    if cls.precisions is not None and cfg.precision not in cls.precisions:
        *others, last = cls.precisions
        allowed = f"{', '.join(others)} or {last}" if others else last
        reason = f" ({cls.precision_reason})" if cls.precision_reason else ""
        raise ConfigError("precision", cfg.precision, f"with strategy {cls.name}: {allowed}{reason}")
    if not cls.adapts_micro_batch and (cfg.micro_batch_size == "auto" or cfg.memory_budget is not None):
        raise ConfigError(
            "strategy", cls.name, "does not yet adapt the micro-batch: set micro_batch_size, no memory_budget"
        )
    cls.check(cfg, world_size)
    if world_size is not None:
        _check_processes(cls, world_size)
        cfg.validate(cls.dims(cfg, world_size).dp)
    return cls


def _with_layout(cfg: TrainConfig, cls: type[Strategy]) -> type[Strategy]:
    """The class that runs ``cls`` in ``cfg``'s layout: its tensor-parallel variant with ``--tp``."""
    if cfg.tp == 1:
        return cls
    variant = cls.with_tensor_parallel()
    if variant is None:
        having = [name for name, other in strategies().items() if other.with_tensor_parallel() is not None]
        rule = f"strategy {cls.name} has no tensor parallelism; use {' or '.join(having)}"
        if not cls.multi_process:
            rule = f"needs {cfg.tp} processes or more: `leantrain launch --nproc-per-node {cfg.tp} fit ...`"
        raise ConfigError("tp", cfg.tp, rule)
    return variant


def _check_fields(cfg: TrainConfig, chosen: type[Strategy] | None) -> None:
    """Fields that only one strategy uses: needed by it, and set with it only."""
    for cls in strategies().values():
        for field in (*cls.needs, *cls.uses):
            value = getattr(cfg, field)
            if cls is chosen and field in cls.needs and value is None:
                raise ConfigError(field, value, f"is needed with strategy {cls.name}, and only with it")
            if cls is not chosen and value is not None:
                rule = (
                    "is needed with strategy {}, and only with it"
                    if field in cls.needs
                    else ("is used with strategy {} only")
                )
                raise ConfigError(field, value, rule.format(cls.name))


def _check_processes(cls: type[Strategy], world_size: int) -> None:
    if cls.multi_process and world_size == 1:
        raise ConfigError(
            "strategy", cls.name, "needs several processes: run `leantrain launch --nproc-per-node N fit ...`"
        )
    if not cls.multi_process and world_size > 1:
        several = [name for name, other in strategies().items() if other.multi_process]
        raise ConfigError(
            "strategy",
            cls.name,
            f"runs in one process, but {world_size} were launched; use {', '.join(several)} or auto",
        )
