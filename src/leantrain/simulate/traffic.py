"""What a simulated step sends: every collective the strategies issue, with its bytes and its group.

A dispatch mode sees each collective op as the process group runs it (FSDP2's all-gathers and
reduce-scatters, DTensor's functional collectives under ``--tp``, the pipeline's sends), whichever
API issued it. What it records is what the time model (``step_time.py``) prices: the whole tensor's
bytes (the gathered one for an all-gather, the unreduced one for a reduce-scatter), the group's
size, and whether the group spans nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# An op's name -> the kind priced, and where its whole tensor is: the gathered one of an all-gather
# (c10d's in-place form writes it into its first argument, the functional form returns it), the
# unreduced one of a reduce-scatter (c10d's second argument, the functional form's first).
_KINDS = {
    "allreduce_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_reduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", "result"),
    "all_gather_into_tensor_coalesced": ("all_gather", "result"),
    "all_gather_into_tensor_out": ("all_gather", "result"),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "alltoall_base_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0),
    "broadcast": ("broadcast", 0),
    "send": ("send", 0),
    "isend": ("send", 0),
}


@dataclass(frozen=True)
class Sent:
    """One collective of the simulated rank."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send
    bytes: int  # the whole tensor's (gathered / unreduced); a send's payload
    ranks: tuple[int, ...]  # the group's global ranks
    count: int = 1  # how many times a step issues it


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _group_of(args: tuple[Any, ...]) -> tuple[int, ...]:
    """The global ranks of the op's process group: c10d's ops take the group (boxed), the
    functional ones its name."""
    for value in args:
        if isinstance(value, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(value)
            return tuple(dist.get_process_group_ranks(group))
    for value in args:
        if isinstance(value, str):
            try:
                group = torch._C._distributed_c10d._resolve_process_group(value)
            except (RuntimeError, ValueError):
                continue  # an op's other string argument ("sum")
            return tuple(dist.get_process_group_ranks(group))
    return tuple(range(dist.get_world_size()))


class TrafficLog(TorchDispatchMode):
    """Records every collective op run while entered (enter it inside the fake tensor mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.micro: int | None = None  # the micro-batch running (None: outside forward and backward)
        self.sent: list[tuple[int | None, Sent]] = []

    def whole_step(self, accumulation: int) -> list[Sent]:
        """The step's collectives when it runs ``accumulation`` micro-batches, from a run of one (no
        accumulation) or two: the first, without gradient sync, stands for all but the last."""
        repeats = {None: 1, 0: 1} if accumulation == 1 else {None: 1, 0: accumulation - 1, 1: 1}
        return [replace(sent, count=repeats[micro]) for micro, sent in self.sent]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            known = _KINDS.get(func._opname)
            if known is not None:
                kind, where = known
                whole = result if where == "result" else args[where]
                self.sent.append((self.micro, Sent(kind, _bytes(_tensors(whole)), _group_of(args))))
        return result
