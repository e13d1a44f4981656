"""The FLOPs one rank computes: matrix products and attention on the tensors it holds.

torch's ``FlopCounterMode`` counts a tensor-parallel layer at its whole (DTensor) shape, which is
every rank's work together. This mode steps aside for DTensor (``NotImplemented``), so DTensor runs
the op on this rank's shards first, and counts those: a planned layer counts 1/tp of its FLOPs, a
layer the plan left replicated counts them all, as its rank computes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from leantrain.simulate.propagation import ShapePropagation

_aten = torch.ops.aten
# A plan runs on CPU fake tensors, where scaled-dot-product attention is the CPU flash kernel, which
# torch's counter has no formula for (it would count 0: a fifth of a Llama 8B's FLOPs at 8192
# tokens). Its arguments lead with the same tensors as the CUDA flash kernel's: that formula counts it.
_KERNELS = (  # (the CPU kernel, the CUDA kernel whose formula counts it)
    ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward"),
)
_ALIASES = {getattr(_aten, cpu): getattr(_aten, cuda) for cpu, cuda in _KERNELS}


class LocalFlops(TorchDispatchMode):
    """``with ShapePropagation() as propagation, LocalFlops(propagation) as counted: ...``; then
    ``counted.flops``."""

    def __init__(self, propagation: ShapePropagation) -> None:
        super().__init__()
        self.flops = 0
        self.propagation = propagation  # DTensor's ops at whole shapes are no rank's

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = flop_registry.get(_ALIASES.get(packet, packet))
        if formula is not None and not self.propagation.running:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out
