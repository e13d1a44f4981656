"""Checkpoints of strategies whose processes hold different parts of the state (fsdp, pipeline).

``torch.distributed.checkpoint`` (DCP) writes each process's part of the model and optimizer
state into one folder, in parallel; state that several processes hold alike (data-parallel
replicas) is written once. Keys are the module's own parameter names, so the parts of
different processes do not collide, and a run resumes with each process reading its own.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leantrain.checkpoint import check_shards
from leantrain.errors import CheckpointError, one_line
from leantrain.remote import dcp_storage
from leantrain.step.precision import Precision


def _options(frozen: frozenset[str]) -> Any:
    # torch.distributed.checkpoint takes most of a second to import: only when used.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Optimizer state keyed by parameter name ("state.<name>.<key>", "param_groups.<name>.<key>"):
    # processes that hold different parameters (pipeline stages) then write different keys. Left
    # nested, every process's "param_groups.0" would share one key, and only one would be kept.
    # An adapter model's frozen base is neither written nor read (task.model() makes it again):
    # loading is then not strict about the model's names, and DCP still fails on a missing one.
    return StateDictOptions(
        flatten_optimizer_state_dict=True, ignore_frozen_params=bool(frozen), strict=not frozen
    )


def _without(state: dict[str, Any], frozen: frozenset[str]) -> dict[str, Any]:
    return {name: value for name, value in state.items() if name not in frozen}


class ShardedState:
    """Mixin for a strategy whose processes hold parts of the state (fsdp, pipeline).

    ``state_module`` is what this process holds the state of. Such a strategy keeps fp32 parts
    and computes in bf16 (FSDP2's mixed-precision policy), which stands in for the true 16-bit
    modes' masters; and it cannot yet re-split the micro-batch of a running step.
    """

    sharded = True
    adapts_micro_batch = False
    precisions = ("32", "bf16-mixed")
    precision_reason = "fp32 parameters computed in bf16 are what bf16-true would give"
    _checkpoint_group: Any = None  # background saves' own process group, made at the first

    @property
    def state_module(self) -> nn.Module:
        return self.model  # type: ignore[attr-defined]

    def trained_weights(
        self, precision: Precision, frozen: frozenset[str] = frozenset()
    ) -> dict[str, torch.Tensor]:
        """The full weights, gathered on rank 0 (a collective: every rank calls it; others get {});
        ``frozen``: names left out, and never gathered (an adapter model's base)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=bool(frozen))
        weights = get_model_state_dict(self.state_module, options=options)
        return {name: value for name, value in weights.items() if name not in frozen}

    def save_sharded(
        self,
        folder: Path | str,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        background: bool = False,
        frozen: frozenset[str] = frozenset(),
    ) -> Future[Any] | None:
        """Every rank writes its part of the model and optimizer state into ``folder``, and of
        ``extra``: state split like the model's (the weight average), keyed by parameter name;
        ``frozen``: the parameters left out (an adapter model's base).

        ``background``: DCP copies the parts to host memory here and writes them on a thread;
        the returned future completes when every rank's parts are written. Its coordination runs
        on a process group of its own, so that it never interleaves with training's collectives.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.state_module, optimizer, options=_options(frozen))
        state = {**extra, "model": _without(model_state, frozen), "optimizer": optimizer_state}
        if not background:
            dcp.save(state, **dcp_storage(folder, writing=True))
            return None
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")  # every rank saves: a collective
        return dcp.async_save(
            state, **dcp_storage(folder, writing=True), process_group=self._checkpoint_group
        )

    def load_sharded(
        self,
        folder: Path | str,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        frozen: frozenset[str] = frozenset(),
    ) -> None:
        """Read the parts saved by ``save_sharded`` into the model and the optimizer."""
        load_dcp_state(self.state_module, optimizer, folder, checkpoint, frozen)


def load_dcp_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Path | str,
    checkpoint: Path,
    frozen: frozenset[str] = frozenset(),
) -> None:
    """The model and optimizer state that ``save_sharded`` wrote into ``folder``, read into
    ``module``: each process's shards (resharded by DCP when there are more or fewer of them),
    or, for a module that is whole (one process, ddp), gathered. ``frozen``: the names that
    ``module`` already holds (an adapter model's base from ``task.model()``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    check_shards(checkpoint, folder)
    model_state, optimizer_state = get_state_dict(module, optimizer, options=_options(frozen))
    state = {"model": _without(model_state, frozen), "optimizer": optimizer_state}
    load_dcp_extra(state, folder)
    set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_options(frozen),
    )


def load_dcp_extra(state: dict[str, Any], folder: Path | str) -> None:
    """Fill ``state`` from the shards in ``folder`` (tensors in place, by key)."""
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():
            # One process reading shards (fsdp -> one process): expected, and the run's log says so.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, **dcp_storage(folder, writing=False))
    except Exception as error:  # DCP raises its own CheckpointException and plain errors
        reason = one_line(error)
        raise CheckpointError(f"cannot load the sharded checkpoint state {folder}: {reason}") from None
