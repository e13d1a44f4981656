"""What memory is spent on: parameters, gradients, optimizer state, saved activations.

Everything here counts tensors, so it works on any device, including ``meta`` and fake
tensors (which is how ``leantrain plan`` measures a model that was never allocated). A
tensor is counted once however many views of it exist: a view is counted as its base.

* parameters: the model's, plus the fp32 master copies of the true 16-bit modes;
* gradients: one per trainable parameter the optimizer updates, in that parameter's dtype
  (the masters' fp32 in the true modes, when the 16-bit gradients have been freed);
* optimizer state: every tensor the optimizer keeps (after its first step);
* activations: the tensors autograd saves for backward during one forward, parameters
  excluded (autocast's 16-bit copies of weights are included: they are held too);
* ema: the moving average of the weights (``--ema-decay``), when kept: a copy of what the
  optimizer updates, at least in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

import torch

from leantrain.units import format_bytes

LossFn = Callable[[torch.nn.Module, Any], Any]  # the task's loss(model, batch)


def base_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``tensor`` views (itself when it is no view).

    A sharded ``DTensor`` (FSDP) counts as this process's shard: what its memory holds.
    """
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None:
        tensor = to_local()
    while tensor._base is not None:
        tensor = tensor._base
    return tensor


def held_memory(tensor: torch.Tensor) -> tuple[Hashable, int]:
    """What ``tensor`` holds, as a key that every tensor sharing that memory shares, and its bytes.

    Real tensors: their storage object (this process's shard of a DTensor). Views and aliases
    without a ``_base`` link share it too: a DTensor's transposed weight, or an output that
    ``DTensor.from_local`` wraps, which autograd saves beside the plain tensor it came from. The
    object, not its address: FSDP frees a saved gathered weight's memory after the block's
    forward, and the next block's may get the same address. Tensors without memory (the meta
    device of ``leantrain plan``): their base tensor.
    """
    root = base_tensor(tensor)
    if root.device.type != "meta":
        storage = root.untyped_storage()
        return ("storage", storage._cdata), storage.nbytes()
    return ("tensor", id(root)), root.numel() * root.element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensors among ``tensors`` (views count as their base, once)."""
    roots = {id(root): root for root in map(base_tensor, tensors)}
    return sum(t.numel() * t.element_size() for t in roots.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    )


def averaged_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the moving average of a parameter of ``dtype``: at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def average_bytes(optimizer_params: Iterable[torch.Tensor]) -> int:
    """The bytes of a moving average of the parameters the optimizer updates (this process's shards)."""
    return sum(
        base_tensor(p).numel() * averaged_dtype(p.dtype).itemsize
        for p in {id(p): p for p in optimizer_params}.values()
    )


def gradient_bytes(optimizer_params: Iterable[torch.Tensor]) -> int:
    """The gradients of the trainable parameters the optimizer updates."""
    return tensor_bytes(p for p in optimizer_params if p.requires_grad)


# The counts running, innermost last: what selective checkpointing keeps is held by checkpoint's
# own cache, which autograd's saved-tensor hooks never see, so it is reported here instead.
_RUNNING: list[SavedActivations] = []


def count_held_for_backward(tensor: torch.Tensor) -> None:
    """Count ``tensor`` in the innermost running :class:`SavedActivations`, if any: a tensor held for
    backward outside autograd's saved tensors (``memory/recompute.py``'s selective checkpointing)."""
    if _RUNNING:
        _RUNNING[-1]._pack(tensor)


class SavedActivations:
    """Counts the bytes autograd saves for backward inside the block (parameters excluded), and those
    that selective checkpointing keeps (reported through :func:`count_held_for_backward`).

    ``with SavedActivations(model.parameters()) as saved: loss = f(model, batch)``; then
    ``saved.bytes``. The tensors are only referenced while the block runs. With ``limit``,
    saving more than ``limit`` bytes raises ``torch.OutOfMemoryError`` (a simulated one:
    how a CPU run enforces a memory budget, see ``adaptive.py``).

    The block runs eagerly (``--compile``'s modules too): torch.compile cannot trace the counting
    hooks, and what it would save differs little (its partitioner may recompute a few cheap
    values instead of saving them, so the eager count is the upper one).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), limit: int | None = None) -> None:
        self._exclude = {held_memory(t)[0] for t in exclude}
        self._seen: dict[Hashable, torch.Tensor] = {}  # referenced while the block runs: no key reused
        self.limit = limit
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key, size = held_memory(tensor)
        if key not in self._exclude and key not in self._seen:
            self._seen[key] = tensor
            self.bytes += size
            if self.limit is not None and self.bytes > self.limit:
                raise torch.OutOfMemoryError(
                    f"simulated out of memory: a micro-batch saves over {format_bytes(self.bytes)} for "
                    f"backward, the memory budget leaves {format_bytes(self.limit)} for activations"
                )
        return tensor

    def __enter__(self) -> SavedActivations:
        self._seen, self.bytes = {}, 0
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        self._hooks.__enter__()
        _RUNNING.append(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        _RUNNING.remove(self)
        self._hooks.__exit__(kind, error, tb)
        self._eager.__exit__(kind, error, tb)
        self._seen = {}


@dataclass(frozen=True)
class MemoryBreakdown:
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # saved for backward by one micro-batch
    ema_bytes: int = 0  # the moving average of the weights, when kept

    @property
    def total_bytes(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def parts(self) -> dict[str, int]:
        """Bytes by kind ("params", "grads", ...), the average's only when one is kept."""
        return {
            name.removesuffix("_bytes"): value
            for name, value in asdict(self).items()
            if value or name != "ema_bytes"
        }

    def describe(self) -> str:
        parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in self.parts().items())
        return f"memory: {parts}; total {format_bytes(self.total_bytes)}"


def breakdown(
    model: torch.nn.Module,
    optimizer_params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    activation_bytes: int,
    averaged: bool = False,
) -> MemoryBreakdown:
    """The breakdown of a model whose optimizer has stepped (``averaged``: a moving average of
    the weights is kept).

    Parameters the optimizer updates that are not the model's (the fp32 masters of the true
    16-bit modes) count as parameters too.
    """
    return MemoryBreakdown(
        params_bytes=tensor_bytes([*model.parameters(), *optimizer_params]),
        grads_bytes=gradient_bytes(optimizer_params),
        optimizer_bytes=optimizer_state_bytes(optimizer),
        activation_bytes=activation_bytes,
        ema_bytes=average_bytes(optimizer_params) if averaged else 0,
    )


class FirstStepMemory:
    """What a run's memory is spent on, measured in its first step: the bytes its first micro-batch
    saves for backward (counted, and held to a CPU budget's ``limit``), then, once the optimizer
    has stepped and its state exists, the whole breakdown. Nothing is counted after that step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_params: Sequence[torch.Tensor],
        limit: int | None,
        averaged: bool,
    ) -> None:
        self._model, self._optimizer_params, self._averaged = model, optimizer_params, averaged
        self._saved = SavedActivations(model.parameters(), limit)
        self.breakdown: MemoryBreakdown | None = None
        # The earlier process's measurement, from the checkpoint: reported by a resumed run that ends
        # before it steps (resumed at its last step), never used in place of this process's own.
        self.earlier: MemoryBreakdown | None = None

    @property
    def known(self) -> MemoryBreakdown | None:
        """This process's breakdown, else the one the checkpoint carried."""
        return self.breakdown or self.earlier

    def state_dict(self) -> dict[str, int] | None:
        known = self.known
        return known.as_dict() if known is not None else None

    def load_state_dict(self, saved: dict[str, int] | None) -> None:
        self.earlier = MemoryBreakdown(**saved) if saved else None

    def loss_fn(self, counted: LossFn, later: LossFn) -> LossFn:
        """The loss function of the next step: until the first step is accounted, ``counted`` under
        the count for its first call (the first micro-batch), then ``later``; after it, ``later``."""
        if self.breakdown is not None:
            return later
        calls = 0

        def measured(model: torch.nn.Module, batch: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                return later(model, batch)
            with self._saved:
                return counted(model, batch)

        return measured

    def account(self, optimizer: torch.optim.Optimizer) -> MemoryBreakdown | None:
        """After a step: the breakdown, the first time (None once it is known)."""
        if self.breakdown is not None:
            return None
        self.breakdown = breakdown(
            self._model, self._optimizer_params, optimizer, self._saved.bytes, self._averaged
        )
        return self.breakdown
