"""Micro-batches that fit: the search before training, and the budget that CPU runs enforce.

Changing the micro-batch never changes the optimisation: the global batch stays, only its
split into micro-batches x accumulation changes (see ``step/accumulator.py``). So leantrain may
pick the micro-batch for the user (``--micro-batch-size auto``) and shrink it when a step
runs out of memory.

On CUDA, out-of-memory errors are real (``--memory-budget`` caps the caching allocator
with ``set_per_process_memory_fraction``). A CPU has no such allocator to ask, so there
the budget is enforced by counting: :func:`budgeted` raises the same
``torch.OutOfMemoryError`` when a micro-batch saves more bytes for backward than the
budget leaves after the parameters, gradients and optimizer state. That drives the very
code path a GPU run takes, which is how it is tested here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leantrain.checkpoint import capture_rng, restore_rng
from leantrain.cluster import ClusterEnv
from leantrain.config import TrainConfig
from leantrain.data.loader import collate, move_to_device
from leantrain.errors import LeantrainError
from leantrain.memory.accountant import SavedActivations
from leantrain.memory.estimate import first_items, measure
from leantrain.step.accumulator import differentiable_loss
from leantrain.step.batching import BatchSplit, configured_micro_batch
from leantrain.step.precision import Precision
from leantrain.units import format_bytes, parse_bytes


def budgeted(
    loss_fn: Callable[[Any, Any], Any], exclude: Sequence[torch.Tensor], limit: int
) -> Callable[[Any, Any], Any]:
    """``loss_fn`` raising a (simulated) ``torch.OutOfMemoryError`` when a call saves over ``limit`` bytes."""

    def limited(model: Any, batch: Any) -> Any:
        with SavedActivations(exclude, limit):
            return loss_fn(model, batch)

    return limited


def search_micro_batch(fits: Callable[[int], bool], choices: Sequence[int]) -> int:
    """The largest of ``choices`` (ascending) for which ``fits``: doubling from the smallest, then bisecting.

    Assumes that what fits for a size fits for every smaller one. Raises when even the
    smallest does not fit.
    """
    if not fits(choices[0]):
        raise LeantrainError(
            f"even a micro-batch of {choices[0]} does not fit in memory: raise memory_budget, use 16-bit "
            "precision or activation_checkpointing"
        )
    good, bad = 0, len(choices)  # choices[good] fits; choices[bad:] are known not to (or out of range)
    while True:  # doubling: the next choice at least twice as large
        larger = [i for i in range(good + 1, bad) if choices[i] >= 2 * choices[good]]
        probe = larger[0] if larger else good + 1
        if probe >= bad:
            return choices[good]
        if not fits(choices[probe]):
            bad = probe
            break
        good = probe
    while bad - good > 1:  # bisecting between the last fit and the first failure
        middle = (good + bad) // 2
        if fits(choices[middle]):
            good = middle
        else:
            bad = middle
    return choices[good]


def next_smaller(choices: Sequence[int], micro: int) -> int | None:
    """The largest choice at most half of ``micro``; None when there is none."""
    smaller = [size for size in choices if size <= micro // 2]
    return smaller[-1] if smaller else None


class AllocatorRetries:
    """CUDA's caching allocator retrying (freeing its cache, then allocating again) step after step:
    memory is so tight that every step pays for it. ``stats`` returns ``torch.cuda.memory_stats()``."""

    def __init__(self, stats: Callable[[], dict[str, Any]], steps_in_a_row: int = 3) -> None:
        self.stats = stats
        self.steps_in_a_row = steps_in_a_row
        self.last = int(stats().get("num_alloc_retries", 0))
        self.streak = 0

    def too_many(self) -> bool:
        """Call once per step: True when the allocator retried in each of the last few steps."""
        now = int(self.stats().get("num_alloc_retries", 0))
        self.streak = self.streak + 1 if now > self.last else 0
        self.last = now
        if self.streak >= self.steps_in_a_row:
            self.streak = 0
            return True
        return False


class MicroBatchSizer:
    """The run's memory policy: the budget, the micro-batch search, and shrinking after trouble.

    ``adaptive`` (``micro_batch_size`` auto, or a memory budget) makes out-of-memory errors
    recoverable: every rank agrees once per step whether one ran out (``agree_on_oom``),
    and the Trainer then halves the micro-batch and runs the same step again.
    """

    def __init__(
        self,
        task: Any,
        cfg: TrainConfig,
        precision: Precision,
        model: nn.Module,
        device: torch.device,
        env: ClusterEnv,
        checkpointing: str | None = None,
    ) -> None:
        """``checkpointing``: the resolved activation-checkpointing policy the model runs with."""
        self.task, self.cfg, self.precision, self.model = task, cfg, precision, model
        self.device, self.env, self.checkpointing = device, env, checkpointing
        self.adaptive = cfg.micro_batch_size == "auto" or cfg.memory_budget is not None
        self.notes: list[str] = []
        self.activation_limit: int | None = None  # CPU: bytes a micro-batch may save for backward
        self._retries: AllocatorRetries | None = None
        if cfg.memory_budget is not None:
            self._apply_budget(parse_bytes(cfg.memory_budget) or 0)
        if self.adaptive and device.type == "cuda":
            self._retries = AllocatorRetries(lambda: torch.cuda.memory_stats(device))

    def _apply_budget(self, budget: int) -> None:
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), self.device)
            self.notes.append(f"memory budget {format_bytes(budget)}: the CUDA allocator is capped there")
            return
        # The state's bytes do not depend on the micro-batch; one the run trains on is measured
        # (a BatchNorm model cannot train on a micro-batch of one sample).
        first = configured_micro_batch(self.cfg, self.env.world_size)
        state = measure(self.task, self.cfg, self.checkpointing, [first])[0].memory
        static = state.params_bytes + state.grads_bytes + state.optimizer_bytes
        if static >= budget:
            raise LeantrainError(
                f"memory_budget {self.cfg.memory_budget} is smaller than the parameters, gradients and "
                f"optimizer state ({format_bytes(static)})"
            )
        self.activation_limit = budget - static
        self.notes.append(
            f"memory budget {format_bytes(budget)}: {format_bytes(static)} of parameters, gradients and "
            f"optimizer state leave {format_bytes(self.activation_limit)} for a micro-batch's activations "
            "(enforced by counting them: this device has no allocator to cap)"
        )

    def enforce_budget(self, loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``loss_fn`` under the CPU budget, if there is one."""
        if self.activation_limit is None:
            return loss_fn
        return budgeted(loss_fn, list(self.model.parameters()), self.activation_limit)

    def agree_on_oom(self, ran_out: bool) -> bool:
        """Whether any rank ran out of memory in this step (one all-reduce in several processes)."""
        if not self.env.distributed:
            return ran_out
        # The process group directly, not the parallel batch_split's: the batch_split's DDP wrapper may be
        # replaced after an error, and nothing may keep the old one alive.
        flag = torch.tensor([1.0 if ran_out else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def search(self, batch_split: BatchSplit, dataset: Any) -> int:
        """The largest micro-batch whose forward and backward fit, the same on every rank."""
        if self.device.type != "cuda" and self.activation_limit is None:
            raise LeantrainError(
                "micro_batch_size auto needs memory_budget on this device: nothing else says how much memory "
                f"there is on {self.device.type}"
            )
        choices = batch_split.micro_batch_choices()
        items = first_items(dataset, batch_split.per_rank_batch_size)
        loss_fn = self.enforce_budget(self.task.loss)
        tried: list[int] = []

        def fits(size: int) -> bool:
            tried.append(size)
            collated = collate(items[:size], range(size), "train_data")
            batch = move_to_device(collated, self.device, dtype=self.precision.input_dtype)
            try:
                with self.precision.autocast():
                    loss = loss_fn(self.model, batch)
                differentiable_loss(loss).float().backward()
                return True
            except torch.OutOfMemoryError:
                pass  # the partial graph is freed once out of this clause
            finally:
                for param in self.model.parameters():
                    param.grad = None
            return False

        saved = capture_rng()  # the trials must not change the run's random numbers
        try:
            self.model.train()
            size = search_micro_batch(fits, choices)
        finally:
            restore_rng(saved)
        if self.env.distributed:  # the smallest over the ranks: every rank must split the same way
            smallest = torch.tensor([size], device=self.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
            size = int(smallest.item())
        self.notes.append(f"micro_batch_size auto: {size} (tried {', '.join(map(str, tried))})")
        return size

    def smaller(self, batch_split: BatchSplit, step: int, reason: str) -> int:
        size = next_smaller(batch_split.micro_batch_choices(), batch_split.micro_batch_size)
        if size is None:
            raise LeantrainError(
                f"{reason} at step {step + 1} with a micro-batch of {batch_split.micro_batch_size}, "
                "the smallest: "
                "raise memory_budget, use 16-bit precision or activation_checkpointing"
            )
        return size

    def allocator_struggles(self) -> bool:
        return self._retries is not None and self._retries.too_many()


def scale_learning_rates(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> str:
    """Multiply every group's learning rate by the rule's factor; returns a note for the log."""
    assert cfg.reference_batch_size is not None
    ratio = cfg.global_batch_size / cfg.reference_batch_size
    factor = ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio)
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    return (
        f"learning rates x {factor:.4g} ({cfg.lr_scaling} scaling: global batch {cfg.global_batch_size} "
        f"for a reference of {cfg.reference_batch_size})"
    )
