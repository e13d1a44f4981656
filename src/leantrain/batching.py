"""How the global batch is split, and the micro-step loop of one optimizer step.

global batch = micro-batch x accumulation steps x data-parallel ranks. The optimizer
sees the gradient of the loss over the whole global batch, exactly, whatever the split:

* a mean loss over a micro-batch of ``b`` samples is weighted ``b * world / global``
  before its backward (``1 / accumulation_steps``), so the summed gradients are the
  mean over the global batch (data-parallel averaging divides by ``world`` again);
* a :class:`~leantrain.task.LossSum` runs backward on the un-normalised sum of each
  micro-batch; once the step's micro-batches are done, the counts are summed over all
  ranks and the gradients are scaled once by ``world / global_count``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from leantrain.config import TrainConfig
from leantrain.errors import LeantrainError, TaskError
from leantrain.log.metrics import LossTracker
from leantrain.precision import GradReport, Precision
from leantrain.task import LossSum


@dataclass(frozen=True)
class BatchPlan:
    """The split of the global batch: ``micro x accumulation x world = global``."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int = 1

    def __post_init__(self) -> None:
        per_rank = self.global_batch_size // self.world_size
        if per_rank * self.world_size != self.global_batch_size or per_rank % self.micro_batch_size:
            raise ValueError(f"inconsistent batch plan {self}")

    @classmethod
    def from_config(cls, cfg: TrainConfig, world_size: int = 1) -> BatchPlan:
        """The configured split; ``micro_batch_size`` auto starts from the whole per-process batch."""
        cfg.validate(world_size)
        per_rank = cfg.global_batch_size // world_size
        micro = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else per_rank
        return cls(cfg.global_batch_size, micro, world_size)

    def with_micro_batch(self, micro_batch_size: int) -> BatchPlan:
        return BatchPlan(self.global_batch_size, micro_batch_size, self.world_size)

    def micro_batch_choices(self) -> list[int]:
        """Every micro-batch size that splits the per-process batch evenly, smallest first."""
        per_rank = self.per_rank_batch_size
        return [size for size in range(1, per_rank + 1) if per_rank % size == 0]

    @property
    def per_rank_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def accumulation_steps(self) -> int:
        return self.per_rank_batch_size // self.micro_batch_size


class StepStatus(enum.Enum):
    STEPPED = "stepped"
    OVERFLOW = "overflow"  # fp16 gradients overflowed the loss scale: skipped, scale lowered
    NONFINITE_LOSS = "non-finite loss"  # the loss was NaN/inf on some micro-batch of some rank
    NONFINITE_GRADIENT = "non-finite gradient"  # finite loss, NaN/inf gradient norm (clipping on)
    OUT_OF_MEMORY = "out of memory"  # on some rank; nothing was updated, the step is to be retried


class _PeerOutOfMemory(Exception):
    """Another rank ran out of memory in this step."""


class StepOutcome(NamedTuple):
    status: StepStatus
    grad_norm: torch.Tensor | None  # total norm before clipping, on the device (no sync)
    grad_underflow_share: torch.Tensor | None = None  # fp16, when inspected: see _underflow_share

    @property
    def stepped(self) -> bool:
        return self.status is StepStatus.STEPPED


LossFn = Callable[[nn.Module, Any], "torch.Tensor | LossSum"]


class Accumulator:
    """Runs the micro-steps of one optimizer step and gates the update.

    ``no_sync`` is entered around forward *and* backward of every non-final micro-batch
    (data-parallel wrappers then skip the gradient all-reduce); ``all_reduce_sum`` sums a
    tensor over the data-parallel ranks. Both are the identity on one process.
    """

    def __init__(
        self,
        plan: BatchPlan,
        precision: Precision,
        params: Sequence[torch.Tensor],
        max_grad_norm: float | None = None,
        no_sync: Callable[[], AbstractContextManager[Any]] = nullcontext,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        agree_on_oom: Callable[[bool], bool] | None = None,
    ) -> None:
        """``agree_on_oom(ran_out) -> any rank ran out`` turns out-of-memory errors into an
        OUT_OF_MEMORY outcome (None: they propagate). Every rank calls it once per step,
        before the last backward, so no rank starts the gradient all-reduce alone."""
        self.plan = plan
        self.precision = precision
        self.params = list(params)  # listed once: walking the module tree every step costs time
        self.max_grad_norm = max_grad_norm
        self.no_sync = no_sync
        self.all_reduce_sum = all_reduce_sum
        self.agree_on_oom = agree_on_oom
        self._agreed = False
        self.mean_loss_weight = plan.micro_batch_size * plan.world_size / plan.global_batch_size

    def step(
        self,
        model: nn.Module,
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
        counts: list[torch.Tensor | int] = []
        losses: list[torch.Tensor] = []
        if self.agree_on_oom is None:
            self._micro_steps(model, loss_fn, batches, step_index, tracker, counts, losses)
        elif not self._micro_steps_unless_out_of_memory(
            model, loss_fn, batches, step_index, tracker, counts, losses
        ):
            tracker.discard_step(step_index)
            self.precision.zero_grad(optimizer)
            return StepOutcome(StepStatus.OUT_OF_MEMORY, None)
        # The step's loss terms summed over micro-batches and ranks: finite if and only if
        # every one is (NaN and inf propagate through sums). Still on the device.
        total = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        if counts:
            total = self._divide_by_global_count(counts, total)
        elif self.plan.world_size > 1:
            total = self.all_reduce_sum(total.double())
        underflow = None
        if inspect_grads and self.precision.loss_scale() is not None:
            underflow = _underflow_share(self.params)
        report = self.precision.unscale_and_clip(self.params, self.max_grad_norm)
        status = self._check_finite(total, report)
        if status is StepStatus.STEPPED:
            self.precision.step(optimizer)
        else:
            self.precision.skip_step(overflowed=status is StepStatus.OVERFLOW)
        self.precision.zero_grad(optimizer)
        return StepOutcome(status, report.norm, underflow)

    def _micro_steps(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        batches: Iterator[Any],
        step_index: int,
        tracker: LossTracker,
        counts: list[torch.Tensor | int],
        losses: list[torch.Tensor],
    ) -> None:
        """Forward and backward of every micro-batch of the step; gradients accumulate."""
        last = self.plan.accumulation_steps - 1
        self._agreed = False
        for micro in range(last + 1):
            batch = next(batches)
            with nullcontext() if micro == last else self.no_sync():
                with self.precision.autocast():
                    loss = loss_fn(model, batch)
                term = self._backward_term(loss, micro, counts, step_index, tracker)
                losses.append(term.detach())
                if micro == last and self.agree_on_oom is not None:
                    self._agreed = True
                    if self.agree_on_oom(False):
                        raise _PeerOutOfMemory
                self.precision.backward(term)

    def _micro_steps_unless_out_of_memory(self, *args: Any) -> bool:
        """``_micro_steps``; False, with every rank agreeing, when one of them ran out of memory."""
        try:
            self._micro_steps(*args)
            return True
        except _PeerOutOfMemory:
            return False
        except torch.OutOfMemoryError as error:
            if self._agreed and self.plan.world_size > 1:
                raise LeantrainError(
                    "out of memory in the last backward of a step, after the gradient all-reduce began: "
                    "the other processes cannot be told; set a smaller micro_batch_size"
                ) from error
        # Out of the except clause: the traceback, and with it the partial graph, is freed.
        if not self._agreed:
            self.agree_on_oom(True)  # type: ignore[misc]
        return False

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
        loss, grads = torch.stack([total.float().reshape(()), grad_value.float().reshape(())]).tolist()
        if not math.isfinite(loss):
            return StepStatus.NONFINITE_LOSS
        if report.overflow is not None:
            return StepStatus.OVERFLOW if grads else StepStatus.STEPPED
        return StepStatus.STEPPED if math.isfinite(grads) else StepStatus.NONFINITE_GRADIENT

    def _backward_term(
        self,
        loss: Any,
        micro: int,
        counts: list[torch.Tensor | int],
        step_index: int,
        tracker: LossTracker,
    ) -> torch.Tensor:
        """The tensor to run backward on for one micro-batch; records the loss for logging."""
        is_sum = isinstance(loss, LossSum)
        if micro > 0 and is_sum != bool(counts):
            raise TaskError("task.loss returned a LossSum for some micro-batches and a mean for others")
        if is_sum:
            _check_scalar(loss.sum, "LossSum.sum")
            counts.append(loss.count)
            tracker.add(step_index, loss.sum.detach(), loss.count, False)
            return loss.sum
        _check_scalar(loss, "task.loss")
        tracker.add(step_index, loss.detach(), self.plan.micro_batch_size, True)
        # Skipping the multiply when the weight is 1 keeps the single-batch path as lean
        # as a hand-written loop.
        return loss if self.mean_loss_weight == 1 else loss * self.mean_loss_weight

    def _divide_by_global_count(self, counts: list[torch.Tensor | int], total: torch.Tensor) -> torch.Tensor:
        """Scale the gradients by ``world / global count``; returns the loss ``total`` of all ranks.

        In several processes the counts and the loss totals travel in one all-reduce.
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        local = sum(counts)
        if isinstance(local, int) and self.plan.world_size == 1:
            factor: torch.Tensor | float = 1.0 / max(local, 1)
        else:
            device = grads[0].device if grads else total.device
            local_count = torch.as_tensor(local, dtype=torch.float64, device=device)
            count, total = self.all_reduce_sum(torch.stack([local_count, total.double().to(device)]))
            # Data-parallel averaging divides by world; multiplying by it restores the sum.
            factor = self.plan.world_size / count.clamp(min=1)
        if grads:
            torch._foreach_mul_(grads, factor)
        return total


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
