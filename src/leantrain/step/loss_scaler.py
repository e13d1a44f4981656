"""Dynamic loss scaling for fp16: keeps small gradients from underflowing to zero.

The loss is multiplied by a scale before backward, so fp16 gradients sit well inside
fp16's range; the fp32 gradients the optimizer reads are divided by it again (exact: the
scale is a power of two). A step whose gradients overflowed (inf/NaN) is skipped and the
scale halved; after ``growth_interval`` good steps in a row it doubles.

Why not ``torch.amp.GradScaler``: its ``step()`` decides the skip with a host read of its
own and lowers the scale for *any* non-finite gradient. leantrain reads one flag per step
for both the overflow and the NaN policy (see ``batching.Accumulator``), and a NaN *loss*
is a model problem that must not shrink the scale. The state lives in device tensors, so
scaling, unscaling and updating make no host sync.
"""

from __future__ import annotations

from typing import Any

import torch

# The largest power of two below fp16's maximum (65504): a loss kept in fp16 (true fp16)
# sends its backward the scale itself as a gradient, which must be finite.
INITIAL_SCALE = 2.0**15


class DynamicLossScaler:
    def __init__(
        self,
        device: torch.device,
        initial_scale: float = INITIAL_SCALE,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.scale = torch.full((1,), initial_scale, dtype=torch.float32, device=device)
        self.good_steps = torch.zeros((1,), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((1,), dtype=torch.float32, device=device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # fp32 product (the scale is a 1-element fp32 tensor), whatever the loss's dtype.
        return loss.float() * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; returns the device flag "some were inf/NaN"."""
        self.found_inf.zero_()
        if grads:
            inverse = self.scale.double().reciprocal().float()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inverse)
        return self.found_inf

    def update(self, overflowed: bool) -> None:
        """After a step: back off when it overflowed, else count it towards growth."""
        self.found_inf.fill_(1.0 if overflowed else 0.0)
        torch._amp_update_scale_(
            self.scale,
            self.good_steps,
            self.found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale.detach().clone(), "good_steps": self.good_steps.detach().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.copy_(state["scale"])
        self.good_steps.copy_(state["good_steps"])
