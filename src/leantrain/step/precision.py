"""Number formats of a run, behind one small protocol.

* ``Fp32`` (``32``): does nothing in each method; the others override only what differs.
* ``Autocast`` (``bf16-mixed``, ``16-mixed``): weights, gradients and optimizer state in
  fp32; matmuls and convolutions in 16-bit under ``torch.autocast``.
* ``MasterWeights`` (``bf16-true``, ``16-true``): the model itself (weights, activations,
  gradients) in 16-bit; the optimizer updates an fp32 *master* copy of every parameter,
  which is rounded back into the model after each step. Updates smaller than 16-bit's
  resolution (``lr * grad`` below ~0.4% of a weight in bf16) accumulate in the master
  copy instead of being rounded away.

Every fp16 mode scales the loss (``DynamicLossScaler``), so its small gradients do not
underflow to zero. The gradients are unscaled exactly once per optimizer step, before
clipping, whatever the accumulation.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from leantrain.adapters import trained_parameters
from leantrain.step.local_values import local_values
from leantrain.step.loss_scaler import DynamicLossScaler

GradNorm = Callable[[list[torch.Tensor]], torch.Tensor]


def local_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm of the gradients this process holds (whole, or DTensor shards whose norm is
    reduced by DTensor itself)."""
    return torch.nn.utils.get_total_norm(grads, foreach=True)


class GradReport(NamedTuple):
    """What unscale_and_clip learned about the step's gradients, as device tensors (no sync)."""

    norm: torch.Tensor | None  # total L2 norm before clipping; None without clipping
    overflow: torch.Tensor | None  # 1.0 when a scaled gradient overflowed; None without loss scaling


class Precision(Protocol):
    name: str
    input_dtype: torch.dtype | None  # floating inputs are cast to it; None: left as they come

    def prepare(self, model: nn.Module) -> list[nn.Parameter]:
        """Convert ``model`` (before any wrapper sees it); returns what the optimizer updates."""
        ...

    def autocast(self) -> AbstractContextManager[Any]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def unscale_and_clip(
        self, params: list[torch.Tensor], max_norm: float | None, grad_norm: GradNorm = local_grad_norm
    ) -> GradReport: ...

    def step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def skip_step(self, overflowed: bool) -> None:
        """No update this step; ``overflowed``: the loss scale was too high."""
        ...

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def loss_scale(self) -> torch.Tensor | None: ...

    def trained_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The weights to export: the most exact copy of what was trained."""
        ...

    def refresh_model(self) -> None:
        """The optimizer's parameters were replaced in place (averaged weights swapped in for a
        validation): make the model compute with them."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Fp32:
    """Full precision: plain autograd and optimizer calls."""

    name = "32"
    input_dtype: torch.dtype | None = None

    def prepare(self, model: nn.Module) -> list[nn.Parameter]:
        return trained_parameters(model)

    def autocast(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_and_clip(
        self, params: list[torch.Tensor], max_norm: float | None, grad_norm: GradNorm = local_grad_norm
    ) -> GradReport:
        return GradReport(_clip(params, max_norm, grad_norm), None)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def skip_step(self, overflowed: bool) -> None:
        pass

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def loss_scale(self) -> torch.Tensor | None:
        return None

    def trained_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def refresh_model(self) -> None:
        pass  # the optimizer's parameters are the model's

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _ScaledLoss(Fp32):
    """The loss-scaling half of the 16-bit modes (a no-op for bf16, whose range is fp32's)."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device) -> None:
        self.name = name
        self.dtype = dtype
        self.device_type = device.type
        self.scaler = DynamicLossScaler(device) if dtype == torch.float16 else None

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale_loss(loss)).backward()

    def unscale_and_clip(
        self, params: list[torch.Tensor], max_norm: float | None, grad_norm: GradNorm = local_grad_norm
    ) -> GradReport:
        overflow = None
        if self.scaler is not None:
            overflow = self.scaler.unscale_([p.grad for p in params if p.grad is not None])
        return GradReport(_clip(params, max_norm, grad_norm), overflow)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        if self.scaler is not None:
            self.scaler.update(overflowed=False)

    def skip_step(self, overflowed: bool) -> None:
        # A NaN loss is not the scale's fault: only an overflow lowers it.
        if self.scaler is not None and overflowed:
            self.scaler.update(overflowed=True)

    def loss_scale(self) -> torch.Tensor | None:
        return None if self.scaler is None else self.scaler.scale

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


class Autocast(_ScaledLoss):
    """Mixed precision: matmuls in 16-bit under autocast, weights and optimizer in fp32."""

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)


class MasterWeights(_ScaledLoss):
    """True 16-bit: the model in 16-bit, the optimizer on fp32 master copies of its parameters.

    Gradients accumulate over micro-batches in the model's 16-bit ``.grad`` (data-parallel
    wrappers reduce them there); once per step they are copied to the masters in fp32,
    unscaled and clipped there, the optimizer updates the masters, and the masters are
    rounded back into the model.
    """

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(name, dtype, device)
        self.input_dtype = dtype
        self.model_params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []

    def prepare(self, model: nn.Module) -> list[nn.Parameter]:
        # Masters copy the weights before the cast, so they start exactly at the initial values.
        # An adapter model's frozen base gets none: it stays in 16-bit, half of fp32's memory.
        trained = trained_parameters(model)
        self.masters = [
            nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
            for p in trained
        ]
        positions = {id(p): i for i, p in enumerate(model.parameters())}
        model.to(self.dtype)  # in place: the parameters stay the same objects
        params = list(model.parameters())
        self.model_params = [params[positions[id(p)]] for p in trained]
        return self.masters

    def unscale_and_clip(
        self, params: list[torch.Tensor], max_norm: float | None, grad_norm: GradNorm = local_grad_norm
    ) -> GradReport:
        for master, param in zip(self.masters, self.model_params, strict=True):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None  # the 16-bit copy is no longer needed: free it before the update
        return super().unscale_and_clip(self.masters, max_norm, grad_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        super().step(optimizer)
        self.refresh_model()

    def refresh_model(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.model_params, self.masters)  # rounds to 16-bit

    def trained_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        master_of = {id(p): m for p, m in zip(self.model_params, self.masters, strict=True)}
        for name, param in model.named_parameters(remove_duplicate=False):  # tied weights: every name
            if id(param) in master_of:  # an adapter's frozen base has no master: its 16-bit values
                state[name] = master_of[id(param)].detach()
        return state

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "masters": [m.detach() for m in self.masters]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state["masters"]
        if len(saved) != len(self.masters):
            raise ValueError(f"{len(saved)} master weights saved, the model has {len(self.masters)}")
        with torch.no_grad():
            for master, value in zip(self.masters, saved, strict=True):
                master.copy_(value)
        self.refresh_model()


def _clip(params: list[torch.Tensor], max_norm: float | None, grad_norm: GradNorm) -> torch.Tensor | None:
    if max_norm is None:
        return None
    # The norm stays a device tensor: no host sync.
    grads = [p.grad for p in params if p.grad is not None]
    norm = grad_norm(grads)
    # Sharded parameters (FSDP) give a replicated DTensor: every rank holds the total.
    full_tensor = getattr(norm, "full_tensor", None)
    norm = full_tensor() if full_tensor is not None else norm
    # torch's clip_grads_with_norm_, on each rank's own values: its foreach kernels refuse a mix of
    # DTensors (of different meshes) and whole tensors, which tensor parallelism holds.
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for local in local_values(grads):
        groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), tensors in groups.items():
        torch._foreach_mul_(tensors, scale.to(device))
    return norm


def make_precision(name: str, device: torch.device) -> Precision:
    """The Precision for a validated ``TrainConfig.precision`` value."""
    if name == "32":
        return Fp32()
    dtype = torch.bfloat16 if name.startswith("bf16") else torch.float16
    kind = MasterWeights if name.endswith("-true") else Autocast
    return kind(name, dtype, device)
