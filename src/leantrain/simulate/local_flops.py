"""The FLOPs one rank computes: matrix products and attention on the tensors it holds.

torch's ``FlopCounterMode`` counts a tensor-parallel layer at its whole (DTensor) shape, which is
every rank's work together. This mode steps aside for DTensor (``NotImplemented``), so DTensor runs
the op on this rank's shards first, and counts those: a planned layer counts 1/tp of its FLOPs, a
layer the plan left replicated counts them all, as its rank computes them.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


class LocalFlops(TorchDispatchMode):
    """``with LocalFlops() as counted: ...``; then ``counted.flops``."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out
