"""One optimizer step, for every strategy: the micro-steps, the loss normalisation, the gated update.

The optimizer sees the gradient of the loss over the whole global batch, exactly, whatever
the split (micro-batch x accumulation steps x data-parallel ranks):

* a mean loss over a micro-batch of ``b`` samples is weighted ``b * dp / global`` before
  its backward (``1 / accumulation_steps``), so the summed gradients are the mean over the
  global batch (data-parallel averaging divides by ``dp`` again);
* a :class:`~leantrain.task.LossSum` runs backward on the un-normalised sum of each
  micro-batch; once the step's micro-batches are done, the counts are summed over all
  processes and the gradients are scaled once by ``dp / global_count``.

The strategy runs the micro-batches' forward and backward (``forward_backward``: a loop with
``no_sync``, or a pipeline schedule) and finishes the gradients; everything else is here, once.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from leantrain.errors import LeantrainError, TaskError
from leantrain.step.batching import BatchSplit
from leantrain.step.local_values import local_values
from leantrain.step.losses import LossTracker
from leantrain.step.precision import GradReport, Precision
from leantrain.task import LossSum, describe_batch, note_task_error


class StepStatus(enum.Enum):
    STEPPED = "stepped"
    OVERFLOW = "overflow"  # fp16 gradients overflowed the loss scale: skipped, scale lowered
    NONFINITE_LOSS = "non-finite loss"  # the loss was NaN/inf on some micro-batch of some rank
    NONFINITE_GRADIENT = "non-finite gradient"  # finite loss, NaN/inf gradient norm (clipping on)
    OUT_OF_MEMORY = "out of memory"  # on some rank; nothing was updated, the step is to be retried


class StepOutcome(NamedTuple):
    status: StepStatus
    grad_norm: torch.Tensor | None  # total norm before clipping, on the device (no sync)
    grad_underflow_share: torch.Tensor | None = None  # fp16, when inspected: see _underflow_share

    @property
    def stepped(self) -> bool:
        return self.status is StepStatus.STEPPED


class MicroLoss(NamedTuple):
    """One micro-batch's loss, as the accumulator weighs it."""

    term: torch.Tensor  # what backward runs on (a mean loss already weighted)
    value: torch.Tensor  # the loss to log, detached: the micro-batch's mean, or its LossSum's sum
    count: torch.Tensor | int | None  # a LossSum's element count; None for a mean loss
    samples: int  # the micro-batch size

    def after_backward(self) -> MicroLoss:
        """What to keep once backward ran: the term detached. Kept attached, it would hold the
        micro-batch's graph, and every tensor the loss made, until the end of the step."""
        return MicroLoss(self.term.detach(), self.value, self.count, self.samples)  # _replace: 2x slower


LossFn = Callable[[nn.Module, Any], "torch.Tensor | LossSum"]
TermFn = Callable[[Any, int], MicroLoss]


class TaskLoss:
    """A micro-batch's loss as the strategies call it: ``task.loss(model, batch)``, of
    ``task.augment(batch)`` when the task has ``augment``.

    An error raised in either keeps its type and traceback and gets one note: the method, the
    optimizer step, the micro-batch and the batch's shapes. Only a failure formats anything; a
    call that succeeds pays a list append. Every strategy calls the loss on the micro-batches in
    order; a pipeline's last stage calls it once more on its first micro-batch when it starts
    (torch's shape inference), so calls are counted by batch: a call on the batch of the call
    before is the same micro-batch.

    The step's micro-batches are kept by reference (no copy) until the next step starts, so
    that a non-finite step can be replayed to find where the value came from
    (``diagnose/nan_origin.py``): a step with accumulation holds its earlier micro-batches'
    inputs until it ends.
    """

    def __init__(self, task: Any) -> None:
        self.loss = task.loss
        augment = getattr(task, "augment", None)
        self.augment = augment if callable(augment) else None
        self.step = self.count = 0
        self.batches: list[Any] = []  # this step's micro-batches so far, in order

    def start_step(self, step: int, count: int) -> None:
        """Before optimizer step ``step`` (1-based) of ``count`` micro-batches, and each retry of it."""
        self.step, self.count, self.batches = step, count, []

    @property
    def micro(self) -> int:
        """The current micro-batch, 1-based (0 before the step's first)."""
        return len(self.batches)

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor | LossSum:
        if not self.batches or batch is not self.batches[-1]:
            self.batches.append(batch)
        return self.loss_of(model, batch)

    def loss_of(self, model: nn.Module, batch: Any) -> torch.Tensor | LossSum:
        """The loss of ``batch`` (augmented first), not counted as a micro-batch of the step."""
        if self.augment is not None:
            try:
                batch = self.augment(batch)
            except Exception as error:
                self._note(error, "task.augment", batch)
                raise
        try:
            return self.loss(model, batch)
        except Exception as error:
            self._note(error, "task.loss", batch)
            raise

    def _note(self, error: Exception, method: str, batch: Any) -> None:
        where = f"at optimizer step {self.step}, micro-batch {self.micro} of {self.count}"
        note_task_error(error, method, f"{where}; batch: {describe_batch(batch)}")


class StepStrategy(Protocol):
    """What the accumulator asks of a strategy (``strategies/base.py`` has the whole contract)."""

    multi_process: bool
    comm_device: torch.device

    def prepare_step(self, split: BatchSplit, precision: Precision) -> None: ...

    def forward_backward(
        self,
        loss_fn: LossFn,
        batches: Iterator[Any],
        count: int,
        term: TermFn,
        precision: Precision,
        before_last_backward: Callable[[], None],
    ) -> list[MicroLoss]: ...

    def finish_gradients(self, params: list[torch.Tensor]) -> None: ...

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


class _PeerOutOfMemory(Exception):
    """Another rank ran out of memory in this step."""


class Accumulator:
    """Runs the micro-steps of one optimizer step through the strategy and gates the update."""

    def __init__(
        self,
        split: BatchSplit,
        precision: Precision,
        strategy: StepStrategy,
        params: list[torch.Tensor],
        max_grad_norm: float | None = None,
        agree_on_oom: Callable[[bool], bool] | None = None,
    ) -> None:
        """``params``: the parameters backward fills (the model's, or this process's stage or shards):
        their gradients are normalised and clipped (the true 16-bit precisions copy them to the
        fp32 masters the optimizer updates).

        ``agree_on_oom(ran_out) -> any rank ran out`` turns out-of-memory errors into an
        OUT_OF_MEMORY outcome (None: they propagate). Every rank calls it once per step,
        before the last backward, so no rank starts the gradient all-reduce alone."""
        self.split = split
        self.precision = precision
        self.strategy = strategy
        self.params = list(params)  # listed once: walking the module tree every step costs time
        self.max_grad_norm = max_grad_norm
        self.agree_on_oom = agree_on_oom
        self._agreed = False
        self.mean_loss_weight = split.micro_batch_size * split.world_size / split.global_batch_size
        strategy.prepare_step(split, precision)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        batches: Iterator[Any],
        step_index: int,
        tracker: LossTracker,
        inspect_grads: bool = False,
    ) -> StepOutcome:
        """One optimizer step over the next micro-batches; updates only when everything is finite.

        ``inspect_grads`` (at log points) also measures how much of the scaled fp16
        gradient sits at the bottom of fp16's range (``_underflow_share``).
        """
        results = self._micro_steps(loss_fn, batches)
        if results is None:
            tracker.discard_step(step_index)
            self.precision.zero_grad(optimizer)
            return StepOutcome(StepStatus.OUT_OF_MEMORY, None)
        self._log(results, step_index, tracker)
        self.strategy.finish_gradients(self.params)
        # The step's loss summed over micro-batches and processes: finite if and only if every
        # term is (NaN and inf propagate through sums). Still on the device.
        total = self._normalise(results)
        underflow = None
        if inspect_grads and self.precision.loss_scale() is not None:
            underflow = _underflow_share(self.params)
        report = self.precision.unscale_and_clip(self.params, self.max_grad_norm, self.strategy.grad_norm)
        status = self._check_finite(total, report)
        if status is StepStatus.STEPPED:
            self.precision.step(optimizer)
        else:
            self.precision.skip_step(overflowed=status is StepStatus.OVERFLOW)
        self.precision.zero_grad(optimizer)
        return StepOutcome(status, report.norm, underflow)

    def _micro_steps(self, loss_fn: LossFn, batches: Iterator[Any]) -> list[MicroLoss] | None:
        """Forward and backward of the step's micro-batches; None, with every rank agreeing,
        when one of them ran out of memory (only when ``agree_on_oom`` is set)."""
        self._agreed = False
        run = self.strategy.forward_backward
        k = self.split.accumulation_steps
        if self.agree_on_oom is None:
            return run(loss_fn, batches, k, self._term, self.precision, _nothing)
        try:
            return run(loss_fn, batches, k, self._term, self.precision, self._agree_before_last_backward)
        except _PeerOutOfMemory:
            return None
        except torch.OutOfMemoryError as error:
            if self._agreed and self.strategy.multi_process:
                raise LeantrainError(
                    "out of memory in the last backward of a step, after the gradient all-reduce began: "
                    "the other processes cannot be told; set a smaller micro_batch_size"
                ) from error
        # Out of the except clause: the traceback, and with it the partial graph, is freed.
        if not self._agreed:
            self.agree_on_oom(True)
        return None

    def _agree_before_last_backward(self) -> None:
        self._agreed = True
        if self.agree_on_oom(False):  # type: ignore[misc]
            raise _PeerOutOfMemory

    def _term(self, loss: Any, micro: int) -> MicroLoss:
        """The tensor to run backward on for one micro-batch's loss, and what to log of it."""
        differentiable = differentiable_loss(loss)
        if isinstance(loss, LossSum):
            return MicroLoss(differentiable, differentiable.detach(), loss.count, self.split.micro_batch_size)
        # Skipping the multiply when the weight is 1 keeps the single-batch path as lean
        # as a hand-written loop.
        term = loss if self.mean_loss_weight == 1 else loss * self.mean_loss_weight
        return MicroLoss(term, loss.detach(), None, self.split.micro_batch_size)

    def _log(self, results: list[MicroLoss], step_index: int, tracker: LossTracker) -> None:
        """The step's losses into the tracker; a process that computed none (a pipeline's first
        stages) logs empty entries, so that every rank's log lines up for the all-reduce."""
        if not results:
            for _ in range(self.split.accumulation_steps):
                tracker.add(step_index, torch.zeros((), dtype=torch.float64), 0, True)
            return
        for result in results:
            if result.count is None:
                tracker.add(step_index, result.value, result.samples, True)
            else:
                tracker.add(step_index, result.value, result.count, False)

    def _normalise(self, results: list[MicroLoss]) -> torch.Tensor:
        """Scale a LossSum's gradients by ``dp / global count``; returns the step's loss total.

        In several processes, whether the loss is a sum, the counts and the loss totals travel
        in one all-reduce: a pipeline's first stages do not know them and add zeros.
        """
        kinds = {result.count is not None for result in results}
        if len(kinds) > 1:
            raise TaskError("task.loss returned a LossSum for some micro-batches and a mean for others")
        is_sum = kinds.pop() if kinds else None  # None: this process computed no loss
        terms = [result.term for result in results]  # detached (``after_backward``)
        if not self.strategy.multi_process:
            total = terms[0] if len(terms) == 1 else torch.stack(terms).sum()
            grads = [p.grad for p in self.params if p.grad is not None] if is_sum else None
            if grads:
                count = sum(result.count for result in results)  # type: ignore[misc]
                factor = 1.0 / max(count, 1) if isinstance(count, int) else 1.0 / count.double().clamp(min=1)
                torch._foreach_mul_(grads, factor)
            return total
        grads = [p.grad for p in self.params if p.grad is not None]
        device = self.strategy.comm_device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        counts = [result.count for result in results]
        local = torch.stack([
            torch.full((), 1.0 if is_sum else 0.0, dtype=torch.float64, device=device),
            torch.as_tensor(sum(counts), dtype=torch.float64).to(device) if is_sum else zero,  # type: ignore[arg-type]
            torch.stack([term.double().to(device) for term in terms]).sum() if terms else zero,
        ])  # fmt: skip
        summed_is_sum, count, total = self.strategy.all_reduce_sum(local)
        if grads and is_sum is not False:
            # Data-parallel averaging divided by dp; multiplying by it restores the sum.
            factor = self.split.world_size / count.clamp(min=1)
            if is_sum is None:  # only the reduced flag says whether the loss was a sum
                factor = torch.where(summed_is_sum > 0, factor, 1.0)
            torch._foreach_mul_(local_values(grads), factor.to(grads[0].device, grads[0].dtype))
        return total

    def _check_finite(self, total: torch.Tensor, report: GradReport) -> StepStatus:
        """Whether this step may update the weights: the one host read of a step.

        The decision must come before the update (a NaN update cannot be undone without
        a copy of the weights and the optimizer state), so it needs values on the host:
        the step's summed loss and, when there is one, the gradient norm or the fp16
        overflow flag, read together. Every rank decides the same: ``total`` is already
        summed over the ranks, and the gradient values come from reduced gradients.
        Reading the values and testing them in Python is cheaper than a device-side
        ``isfinite`` (a composite of several kernels).
        """
        grad_value = report.overflow if report.overflow is not None else report.norm
        if grad_value is None:
            return StepStatus.STEPPED if math.isfinite(total.item()) else StepStatus.NONFINITE_LOSS
        loss, grads = torch.stack([
            total.float().reshape(()), grad_value.float().reshape(()).to(total.device)
        ]).tolist()  # fmt: skip
        if not math.isfinite(loss):
            return StepStatus.NONFINITE_LOSS
        if report.overflow is not None:
            return StepStatus.OVERFLOW if grads else StepStatus.STEPPED
        return StepStatus.STEPPED if math.isfinite(grads) else StepStatus.NONFINITE_GRADIENT


def _nothing() -> None:
    pass


# fp16's smallest normal value: below it, values lose precision, and below 2**-24 they are 0.
FP16_SMALLEST_NORMAL = 2.0**-14


def _underflow_share(params: list[torch.Tensor]) -> torch.Tensor | None:
    """The share of non-zero scaled gradient values below fp16's smallest normal (a device tensor).

    Exact zeros are left out: dead ReLUs and unused rows make many of them in any format.
    A gradient that is zero everywhere counts as fully underflowed (1.0).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    nonzero = torch.stack([(g != 0).sum() for g in grads]).sum()
    tiny = torch.stack([((g != 0) & (g.abs() < FP16_SMALLEST_NORMAL)).sum() for g in grads]).sum()
    return torch.where(nonzero > 0, tiny / nonzero.clamp(min=1), 1.0)


def _check_scalar(value: Any, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TaskError(f"{what} must be a tensor or lt.LossSum, got {type(value).__name__}")
    if value.dim() != 0:
        raise TaskError(f"{what} must be a scalar tensor, got shape {tuple(value.shape)}")


def differentiable_loss(loss: Any) -> torch.Tensor:
    """The scalar tensor of what ``task.loss`` returned (a LossSum's sum), checked: backward would
    fail on a loss without a graph anyway, in words that do not say why. Reading requires_grad
    costs no device sync."""
    if isinstance(loss, LossSum):
        _check_scalar(loss.sum, "LossSum.sum")
        if not loss.sum.requires_grad:
            raise _not_differentiable("an lt.LossSum whose sum")
        return loss.sum
    _check_scalar(loss, "task.loss")
    if not loss.requires_grad:
        raise _not_differentiable("a loss")
    return loss


def _not_differentiable(what: str) -> TaskError:
    return TaskError(
        f"task.loss returned {what} that does not require grad (no grad_fn): it was computed under "
        "torch.no_grad()/inference_mode, or detached (.detach(), .item(), a new tensor), or only from "
        "frozen parameters; compute it from the model's output with autograd on"
    )
