"""A copy of the training state in host memory, taken between two steps, to go back to without a disk read.

What a rollback (``--on-spike rollback``, see ``recovery.py``) restores: the weights and buffers, the
optimizer's parameters when they are not the model's (fp32 masters), the optimizer's state and its
groups' hyperparameters, the scheduler, the loss scale, the callbacks' states (the weight average) and
the random generators. Each process copies the tensors it holds: its local shards under a sharded
strategy (a DTensor's local tensor), its replica otherwise. Everything is restored *in place*, into the
same tensors, so nothing a strategy holds on to (hooks, views into flat buffers, DTensor metadata) is
replaced; objects that load a state dict get their current state dict with the saved values copied in.

What is not restored, on purpose: time and skip counters, the log, the trackers' marks and the loss
history of the spike rule (they describe what happened, and the run goes on from a later step).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from leantrain.checkpoint import capture_rng, restore_rng


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def to_host(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a host copy of this process's part of it."""
    if isinstance(tree, torch.Tensor):
        return _local(tree).detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: to_host(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(value) for value in tree)
    return copy.deepcopy(tree)


@torch.no_grad()
def copy_into(live: Any, saved: Any) -> Any:
    """``live`` made equal to ``saved``: tensors copied in place, other values replaced, dict keys that
    ``saved`` lacks removed (an optimizer without state yet at the snapshot). Returns the result."""
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        _local(live).copy_(saved)
        return live
    if isinstance(live, dict) and isinstance(saved, dict):
        for key in [key for key in live if key not in saved]:
            del live[key]
        for key, value in saved.items():
            live[key] = copy_into(live[key], value) if key in live else _placed(value, live)
        return live
    if isinstance(live, list) and isinstance(saved, list) and len(live) == len(saved):
        live[:] = [copy_into(a, b) for a, b in zip(live, saved, strict=True)]
        return live
    return copy.deepcopy(saved)


def _placed(value: Any, beside: dict[str, Any]) -> Any:
    """A saved value the live state has no place for yet: on the device of the tensors beside it."""
    device = next((_local(v).device for v in beside.values() if isinstance(v, torch.Tensor)), None)
    moved = to_host(value)
    return moved if device is None or not isinstance(moved, torch.Tensor) else moved.to(device)


def _tensors(model: nn.Module, params: Iterable[torch.Tensor], frozen: frozenset[str]) -> list[torch.Tensor]:
    """The tensors that training changes, each once: the model's parameters and buffers (a frozen adapter
    base left out) and the optimizer's parameters (fp32 masters are not the model's)."""
    seen: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name not in frozen:
            seen.setdefault(id(tensor), tensor)
    for tensor in params:
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


@dataclass(frozen=True)
class TrainingState:
    """Where the state a snapshot copies lives in this process."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]  # the optimizer's (fp32 masters are not the model's)
    frozen: frozenset[str]  # an adapter model's frozen base: not copied
    stateful: dict[str, Any]  # with state_dict/load_state_dict, by a name that stays the same

    def tensors(self) -> list[torch.Tensor]:
        return _tensors(self.model, self.params, self.frozen)


@dataclass
class HostSnapshot:
    """The state after step ``step`` (0: before the first), in host memory."""

    step: int
    tensors: list[torch.Tensor]  # in the order of ``_tensors``
    optimizer: dict[str, Any]
    stateful: dict[str, Any]  # by name: the scheduler, the precision (loss scale), each callback
    rng: dict[str, Any]

    @classmethod
    def capture(cls, step: int, state: TrainingState) -> HostSnapshot:
        return cls(
            step,
            [to_host(tensor) for tensor in state.tensors()],
            to_host(state.optimizer.state_dict()),
            {name: to_host(obj.state_dict()) for name, obj in state.stateful.items()},
            capture_rng(),
        )

    def restore(self, state: TrainingState) -> None:
        """Put the state back, into the same objects it was taken from."""
        live = state.tensors()
        if len(live) != len(self.tensors):
            raise RuntimeError(f"the snapshot holds {len(self.tensors)} tensors, the run {len(live)}")
        for tensor, saved in zip(live, self.tensors, strict=True):
            copy_into(tensor, saved)
        state.optimizer.load_state_dict(copy_into(state.optimizer.state_dict(), self.optimizer))
        for name, obj in state.stateful.items():
            obj.load_state_dict(copy_into(obj.state_dict(), self.stateful[name]))
        restore_rng(self.rng)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tensors": self.tensors, "optimizer": self.optimizer,
                "stateful": self.stateful, "rng": self.rng}  # fmt: skip

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> HostSnapshot:
        return cls(state["step"], state["tensors"], state["optimizer"], state["stateful"], state["rng"])
