"""Where a non-finite value came from: the failed step's micro-batches replayed once, with hooks.

Nothing here runs on a normal step. When a step's loss (or gradient norm) is not finite, the
loop replays that step's micro-batches (kept by reference in :class:`TaskLoss`) through the
user's model with a forward hook on every module (and, for a gradient, a full backward hook),
and names the first module, in execution order, whose output (or gradient) is non-finite, with
what it was given: the input's largest magnitude and dtype, or that the input was non-finite
already (then the value was made before that module: in the batch, or in code between modules).

The replay leaves the run as it was: parameters are not updated, gradients, buffers (BatchNorm's
running statistics) and the random streams are put back bit for bit, and the hooks are removed,
also when the replay raises. Modules are named as in the user's model: the data-parallel and
compile wrappers are looked through, and compiled code runs eagerly during the replay (hooks
added after compilation would not run otherwise). Dropout draws differ from the failed step's:
the random streams are where the step left them, not where it began.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from leantrain.checkpoint import capture_rng, restore_rng
from leantrain.step.accumulator import TaskLoss, differentiable_loss
from leantrain.step.precision import Precision
from leantrain.task import LossSum

Forward = Callable[[nn.Module], Any]  # one micro-batch's forward and loss on the given model


@dataclasses.dataclass(frozen=True)
class Stats:
    """The largest magnitude among a module's floating-point (or index) inputs, and its dtype."""

    max: float | None  # None: no tensor among them
    dtype: str | None
    finite: bool


@dataclasses.dataclass(frozen=True)
class NanOrigin:
    """The first place a replayed micro-batch made a non-finite value.

    ``kind``: ``"output"`` (a module's output), ``"gradient"`` (a module's gradient with respect
    to its inputs or its own parameters, in backward order) or ``"loss"`` (the model's outputs
    were finite: the task's loss made it). ``given``: what the module was given, its inputs for
    an output and the gradient of its output for a gradient (the model's output for the loss).
    """

    kind: str
    module: str | None  # dotted name in the user's model; the model itself: its class name
    given: Stats
    step: int | None = None
    micro: tuple[int, int] | None = None  # (micro-batch, of how many)
    rank: int | None = None  # the process whose micro-batch it was, in a multi-process run

    def describe(self) -> str:
        where = "" if self.step is None else f" at step {self.step}"
        if self.micro is not None and self.micro[1] > 1:
            where += f", micro-batch {self.micro[0]} of {self.micro[1]}"
        if self.rank is not None:
            where += f" on rank {self.rank}"
        given = {"output": "input", "gradient": "output gradient", "loss": "model output"}[self.kind]
        if self.given.max is None:
            stats = f"no tensor {given}"
        elif not self.given.finite:
            stats = f"its {given} was already non-finite, in {self.given.dtype}: made before it"
        else:
            stats = f"{given} max {short_float(self.given.max)} in {self.given.dtype}"
        if self.kind == "loss":
            return f"non-finite loss{where}, from finite model outputs ({stats}): the task's loss made it"
        return f"non-finite {self.kind} in {self.module}{where} ({stats})"


def short_float(value: float) -> str:
    """6.5e4, 1.2e-3, 3: the magnitude in a few characters."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def user_model(module: nn.Module) -> nn.Module:
    """The user's model inside data-parallel and ``torch.compile`` wrappers (FSDP2 shards in place)."""
    while True:
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
        elif isinstance(inner := getattr(module, "_orig_mod", None), nn.Module):
            module = inner
        else:
            return module


def find_nan_origin(
    model: nn.Module,
    forward: Forward,
    gradients: bool = False,
    backward: Callable[[torch.Tensor], None] | None = None,
    step: int | None = None,
) -> NanOrigin | None:
    """Replay one micro-batch: ``forward(m)`` runs its forward and loss on ``m`` (the user's model
    inside ``model``'s wrappers), the way the training step does (under its autocast).

    With ``gradients``, ``backward(loss)`` (default ``loss.backward()``; a run passes its
    precision's, which scales an fp16 loss as training did) runs too, always, so that every
    process of a sharded model makes the same collectives. None: everything was finite.
    """
    inner = user_model(model)
    watch = _Watch(inner)
    with _state_kept(inner), _hooks(inner, watch, gradients), torch.compiler.set_stance("force_eager"):
        with contextlib.nullcontext() if gradients else torch.no_grad():
            loss = differentiable_loss(forward(inner)) if gradients else _scalar(forward(inner))
        if watch.found is None and not _finite(loss):
            watch.found = NanOrigin("loss", None, watch.model_output)
        if gradients:
            (backward or torch.Tensor.backward)(loss)
            watch.check_parameters()
    return None if watch.found is None else dataclasses.replace(watch.found, step=step)


def origin_line(
    model: nn.Module,
    task_loss: TaskLoss,
    precision: Precision,
    step: int,
    gradients: bool,
    gather: Callable[[Any], list[Any]] | None = None,
) -> str | None:
    """The line to add to a non-finite step's warning or error: where the value came from.

    ``task_loss`` holds the step's micro-batches; each is replayed (all of them, on every
    process: a sharded model's collectives stay matched) and the first origin is named.
    ``gather(value) -> every rank's value`` (the strategy's): every process returns the same
    line, naming the first rank that found an origin. None: the step kept no micro-batch. A
    replay that fails says so in the line instead of raising: the step's own message comes first.
    """
    batches = list(task_loss.batches)
    if not batches:
        return None
    local: NanOrigin | str | None = None
    try:
        for index, batch in enumerate(batches, start=1):
            forward = partial(_loss_of, task_loss, precision, batch)
            origin = find_nan_origin(model, forward, gradients, precision.backward, step)
            if local is None and origin is not None:
                local = dataclasses.replace(origin, micro=(index, len(batches)))
    except Exception as error:  # the diagnosis must not hide the error it diagnoses
        local = f"replaying step {step} to find where the non-finite value came from failed: {error!r}"
    found = [local] if gather is None else gather(local)
    for rank, origin in enumerate(found):
        if isinstance(origin, NanOrigin):
            return dataclasses.replace(origin, rank=None if len(found) == 1 else rank).describe()
    failures = [line for line in found if isinstance(line, str)]
    if failures:
        return failures[0]
    return (
        f"replaying step {step}'s {len(batches)} micro-batch(es) made only finite values (the replay "
        "differs from the step: dropout draws, compiled kernels)"
    )


def _loss_of(task_loss: TaskLoss, precision: Precision, batch: Any, model: nn.Module) -> Any:
    with precision.autocast():
        return task_loss.loss_of(model, batch)


class _Watch:
    """What the hooks saw: the first non-finite place, and the model's last output."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {module: name for name, module in model.named_modules()}
        self.names[model] = type(model).__name__  # named_modules calls it ""
        self.found: NanOrigin | None = None
        self.model_output = Stats(None, None, True)
        self.backward_order: list[nn.Module] = []  # modules as their backward hooks ran

    def after_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if module is self.model:
            self.model_output = _stats(output)
        if self.found is None and not _finite(output):
            self.found = NanOrigin("output", self.names[module], _stats((args, kwargs)))

    def after_backward(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        self.backward_order.append(module)
        if self.found is None and not (_finite(grad_input) and _finite(_own_grads(module))):
            self.found = NanOrigin("gradient", self.names[module], _stats(grad_output))

    def check_parameters(self) -> None:
        """Parameters whose gradient came after their module's hook (a module whose inputs need no
        gradient, such as an embedding, has its hook called before its weights' gradient)."""
        if self.found is not None:
            return
        order = {module: index for index, module in enumerate(self.backward_order)}
        for module in sorted(self.names, key=lambda m: order.get(m, len(order))):
            if not _finite(_own_grads(module)):
                self.found = NanOrigin("gradient", self.names[module], Stats(None, None, True))
                return


@contextlib.contextmanager
def _hooks(model: nn.Module, watch: _Watch, gradients: bool) -> Iterator[None]:
    handles = []
    with warnings.catch_warnings():
        # Torch warns about modules whose backward hook cannot run (outputs that are not tensors,
        # as a transformers model's) or runs early (no input needs a gradient): both are handled.
        warnings.filterwarnings("ignore", "(For backward hooks|Full backward hook)", UserWarning)
        try:
            for module in watch.names:
                handles.append(module.register_forward_hook(watch.after_forward, with_kwargs=True))
                if gradients:
                    handles.append(module.register_full_backward_hook(watch.after_backward))
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Gradients, buffers and random streams as they were before, whatever the replay does."""
    rng = capture_rng()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    for param in params:
        param.grad = None  # the replay's gradients go to fresh tensors, not into the kept ones
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, saved in buffers:
                module._buffers[name] = buffer  # a forward may also have replaced it
                buffer.copy_(saved)
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        restore_rng(rng)


def _own_grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in module.parameters(recurse=False)]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor) and leaf.numel()]


def _finite(value: Any) -> bool:
    """Whether every floating-point tensor in ``value`` (nested) is finite: one host read."""
    checks = [torch.isfinite(t).all() for t in _tensors(value) if t.is_floating_point()]
    return not checks or bool(torch.stack([c.to(checks[0].device) for c in checks]).all())


def _stats(value: Any) -> Stats:
    tensors = [t for t in _tensors(value) if t.dtype != torch.bool and not t.dtype.is_complex]
    if not tensors:
        return Stats(None, None, True)
    peaks = [float(t.detach().abs().max()) for t in tensors]
    finite = all(math.isfinite(peak) for peak in peaks)
    largest = max(range(len(peaks)), key=lambda i: peaks[i] if math.isfinite(peaks[i]) else math.inf)
    return Stats(peaks[largest], str(tensors[largest].dtype).removeprefix("torch."), finite)


def _scalar(loss: Any) -> torch.Tensor:
    return loss.sum if isinstance(loss, LossSum) else loss
