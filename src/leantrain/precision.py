"""Number formats of the forward/backward passes, behind one small protocol.

``Fp32`` does nothing in each method; ``Autocast`` overrides only what differs:
autocast regions in bf16 or fp16, and for fp16 a dynamic ``GradScaler``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch


class Precision(Protocol):
    name: str

    def autocast(self) -> AbstractContextManager[Any]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def unscale_and_clip(
        self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float | None
    ) -> torch.Tensor | None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Fp32:
    """Full precision: plain autograd and optimizer calls."""

    name = "32"

    def autocast(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_and_clip(
        self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float | None
    ) -> torch.Tensor | None:
        if max_norm is None:
            return None
        # Returns the norm as a device tensor: no host sync.
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Autocast(Fp32):
    """Mixed precision: matmuls in 16-bit under autocast, weights and optimizer in fp32.

    With fp16, a dynamic loss scaler keeps small gradients from underflowing and skips
    the steps whose gradients overflowed.
    """

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device) -> None:
        self.name = name
        self.dtype = dtype
        self.device_type = device.type
        use_scaler = dtype == torch.float16
        self.scaler = torch.amp.GradScaler(device.type, enabled=use_scaler) if use_scaler else None

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is None:
            loss.backward()
        else:
            self.scaler.scale(loss).backward()

    def unscale_and_clip(
        self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float | None
    ) -> torch.Tensor | None:
        if self.scaler is not None and max_norm is not None:
            self.scaler.unscale_(optimizer)  # once per optimizer step, before clipping
        return super().unscale_and_clip(optimizer, params, max_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            return super().step(optimizer)
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler lowers its scale exactly when it skipped the step for inf/NaN.
        return self.scaler.get_scale() >= scale_before

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def make_precision(name: str, device: torch.device) -> Precision:
    """The Precision for a validated ``TrainConfig.precision`` value."""
    if name == "32":
        return Fp32()
    dtypes = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    return Autocast(name, dtypes[name], device)
