"""``--compile``: torch.compile applied to the model, and what compiling costs while the run trains.

Where it sits (``run/builders.prepare_model``): precision first (it converts or casts the model),
then activation checkpointing (it replaces the blocks' ``forward``), then compiling, then the
strategy's wrapping (DDP around the compiled model; FSDP2 shards each compiled block). Each
module's ``forward`` is compiled in place: its class, names and state-dict keys stay, so the
strategies find their blocks and checkpoints load into an eager model alike, and its hooks
(FSDP2's) run outside the compiled code.

* ``model``: the whole model is one compiled unit.
* ``blocks``: each repeated block is compiled on its own (the blocks activation checkpointing
  names, or the model's repeated blocks, see ``blocks.block_classes``). The blocks share their
  code, so one compilation serves all of them and compile time does not grow with depth.

While the loop runs, :class:`CompileWatch` follows torch's compiler: the seconds it spends
(``compile_seconds`` in ``summary.json``; ``samples_per_second`` leaves them out), each
recompilation and each graph break with its reason and file:line (logged once each; the
doctor reports them), and the hang watchdog is told that a compilation is progress.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from leantrain.blocks import BlockPolicy, matching_blocks
from leantrain.errors import ConfigError

# torch's loggers for what the compiler reports (artifact loggers: off unless enabled).
_RECOMPILES = "torch._dynamo.guards.__recompiles"
_GRAPH_BREAKS = tuple(
    f"torch._dynamo.{module}.__graph_breaks" for module in ("symbolic_convert", "convert_frame", "exc")
)
_AT_LINE = re.compile(r"(?:in|at) (\S+?):(\d+)")


def compile_model(model: nn.Module, scope: str, options: dict[str, str], recompute: str | None) -> list[str]:
    """Compile ``model`` in place as ``scope`` says (after activation checkpointing, before any
    wrapper), ``options`` for ``torch.compile``; the names of the compiled modules."""
    if scope == "none":
        return []
    _no_key_value_cache(model)
    if scope == "model":
        compile_forward(model, options)
        return [type(model).__name__]
    # The classes activation checkpointing names, all of them (every:N picks which to recompute,
    # not which to compile), or the model's repeated blocks.
    classes = BlockPolicy.parse(recompute).classes if recompute and recompute != "auto" else ()
    try:
        blocks = matching_blocks(model, BlockPolicy(classes, field="compile"))
    except ConfigError:
        raise ConfigError(
            "compile",
            "blocks",
            "this model has no ModuleList or Sequential of repeated blocks: use --compile model",
        ) from None
    for _, block in blocks:
        compile_forward(block, options)
    return [name for name, _ in blocks]


def _no_key_value_cache(model: nn.Module) -> None:
    """transformers' models fill a key/value cache in training too while ``config.use_cache`` is on
    (the default). Filled block by block, it makes every block compile again (its guards see each
    layer's cache state) until torch's recompile limit runs the rest eagerly. Training reads no
    cache: it is switched off, as transformers does for gradient checkpointing; ``generate``
    passes its own ``use_cache`` and still caches."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


def compile_forward(module: nn.Module, options: dict[str, str]) -> None:
    """The module's ``forward`` compiled, in place; its hooks (FSDP's among them) stay outside.

    Not ``Module.compile``: that compiles ``Module._call_impl``, a frame of torch's own, which
    torch.compile skips as a first frame; the forward is then compiled only when it is user
    code, so an ``nn.Sequential`` or a block of ``torch.nn`` layers would run uncompiled without
    a word. A forward given to torch.compile itself is compiled wherever its code lives.
    """
    module.forward = torch.compile(module.forward, **options)  # type: ignore[method-assign]


@dataclass
class CompilerEvent:
    kind: str  # "recompilation" or "graph break"
    where: str  # file:line of the code involved
    reason: str  # the first one seen there
    count: int = 1

    def line(self) -> str:
        return f"torch.compile {self.kind} at {self.where}: {self.reason}"


class _Collector(logging.Handler):
    def __init__(self, add: Callable[[CompilerEvent], None]) -> None:
        super().__init__(logging.DEBUG)
        self.add = add

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        kind = "recompilation" if record.name == _RECOMPILES else "graph break"
        self.add(CompilerEvent(kind, _where(text), _reason(kind, text)))


def _where(text: str) -> str:
    found = _AT_LINE.search(text.splitlines()[0] if text else "")
    return f"{found.group(1)}:{found.group(2)}" if found else "unknown"


def _reason(kind: str, text: str) -> str:
    lines = [line.strip() for line in text.splitlines()]
    if kind == "recompilation":  # "- 0/1: tensor 'x' size mismatch at index 0. expected 8, actual 5"
        # The newest compilation's failed guard comes first; torch's comment after it is its source.
        failures = [line[2:].split("  #")[0].strip() for line in lines if line.startswith("- ")]
        return failures[0].split(": ", 1)[-1] if failures else "guards failed"
    # "Graph Break Reason: Encountered graph break when attempting to trace CALL: ...", then a
    # blank line and the specific cause ("Unsupported Tensor.item() call with ...").
    after = [line for line in lines[1:] if line]
    if after and after[0].startswith("Graph Break Reason:"):
        reason = after[0].removeprefix("Graph Break Reason:").strip()
        generic = reason.startswith("Encountered graph break") and len(after) > 1
        return after[1] if generic else reason
    return after[0] if after else "unsupported code"


@dataclass
class CompileWatch:
    """Seconds spent compiling, and the compiler's recompilations and graph breaks, while active.

    ``on_event`` is called for the first event of each kind at each place (the run logs it);
    ``compiling`` is true while torch compiles (the hang watchdog does not count that time)."""

    enabled: bool
    on_event: Callable[[CompilerEvent], None] = lambda event: None
    seconds: float = 0.0
    compiling: bool = False
    events: list[CompilerEvent] = field(default_factory=list)
    _started: float = 0.0

    def _start(self, _: object) -> None:
        self.compiling = True
        self._started = time.perf_counter()

    def _end(self, _: object) -> None:
        self.seconds += time.perf_counter() - self._started
        self.compiling = False

    def _add(self, event: CompilerEvent) -> None:
        """Counted by kind and place; the first at a place is reported, the rest only counted."""
        for seen in self.events:
            if (seen.kind, seen.where) == (event.kind, event.where):
                seen.count += 1
                return
        self.events.append(event)
        self.on_event(event)

    @contextmanager
    def watching(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        callbacks = torch._dynamo.callback_handler
        callbacks.register_start_callback(self._start)
        callbacks.register_end_callback(self._end)
        with _compiler_reports(_Collector(self._add)):
            try:
                yield
            finally:
                callbacks.remove_start_callback(self._start)
                callbacks.remove_end_callback(self._end)


@contextmanager
def _compiler_reports(handler: logging.Handler) -> Iterator[None]:
    """torch's recompilation and graph-break reports go to ``handler`` (and, where the user turned
    them on with ``TORCH_LOGS``, where they went before)."""
    already = bool(os.environ.get("TORCH_LOGS"))  # the user's settings: kept as they are
    if not already:
        torch._logging.set_logs(recompiles=True, graph_breaks=True)
    loggers = [logging.getLogger(name) for name in (_RECOMPILES, *_GRAPH_BREAKS)]
    saved = [(log.level, log.propagate) for log in loggers]
    for log in loggers:
        log.setLevel(logging.DEBUG)
        log.propagate = already  # not printed by torch unless the user asked for it
        log.addHandler(handler)
    try:
        yield
    finally:
        for log, (level, propagate) in zip(loggers, saved, strict=True):
            log.removeHandler(handler)
            log.setLevel(level)
            log.propagate = propagate
        if not already:
            torch._logging.set_logs()  # torch's defaults: nothing was configured before
