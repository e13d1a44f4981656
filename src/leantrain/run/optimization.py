"""The optimization part: what updates the weights, one optimizer step at a time.

It holds the optimizer (over what the strategy says it updates), the scheduler, the
memory policy that sizes the micro-batch (``MicroBatchSizer``), the ``Accumulator`` of the
current split and the losses not yet logged. Built by ``builders.build_optimization``; what of it
a checkpoint holds (scheduler, loss scale, each rank's unlogged losses) is saved and restored
below. The optimizer's own state goes with the weights (``persistence.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leantrain.checkpoint import load_into
from leantrain.cluster import ClusterEnv
from leantrain.errors import CheckpointError
from leantrain.memory.accountant import FirstStepMemory
from leantrain.memory.adaptive import MicroBatchSizer
from leantrain.run.model import ModelPart
from leantrain.run.world_change import losses_of_rank
from leantrain.step.accumulator import Accumulator, LossFn, StepOutcome
from leantrain.step.batching import BatchSplit
from leantrain.step.losses import LossTracker


class Optimization:
    def __init__(
        self,
        model: ModelPart,
        params: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        sizer: MicroBatchSizer,
        max_grad_norm: float | None,
        averaged: bool,
        notes: list[str],
    ) -> None:
        """``averaged``: a moving average of the weights is kept (its memory is counted)."""
        self.model = model
        self.params = params  # what the optimizer updates
        self.optimizer = optimizer
        self.scheduler = scheduler  # the task's or a built-in learning-rate scheduler, or None
        self.sizer = sizer
        self.max_grad_norm = max_grad_norm
        self.notes = notes  # set-up decisions, for the run log
        self.warnings: list[str] = []  # about the scheduler, found at set-up or resume, for the run log
        self.tracker = LossTracker()  # the losses since the last log point, on the device
        # What the memory is spent on, measured in the first step (the activations held to a CPU budget).
        self.memory = FirstStepMemory(model.model, params, sizer.activation_limit, averaged)
        self.accumulator: Accumulator | None = None  # for the current split: see ``use_split``

    def use_split(self, split: BatchSplit) -> None:
        """Steps from now on cut the global batch as ``split`` says (set once, again after a halving)."""
        agree_on_oom = self.sizer.agree_on_oom if self.sizer.adaptive else None
        params = list(self.model.model.parameters())  # those whose gradients backward fills
        self.accumulator = Accumulator(
            split, self.model.precision, self.model.strategy, params, self.max_grad_norm, agree_on_oom
        )

    def step(self, loss_fn: LossFn, batches: Iterator[Any], step: int, log_due: bool) -> StepOutcome:
        """One optimizer step over the next micro-batches (the scheduler moves on if it updated)."""
        assert self.accumulator is not None, "use_split comes first"
        outcome = self.accumulator.step(self.optimizer, loss_fn, batches, step, self.tracker, log_due)
        if outcome.stepped and self.scheduler is not None:
            self.scheduler.step()
        return outcome

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """The same on every rank: rank 0's copy is saved."""
        return {
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "precision": self.model.precision.state_dict(),
            "memory": self.memory.state_dict(),
        }

    def rank_state(self) -> dict[str, Any]:
        """What differs by rank: the losses not yet logged."""
        return {"losses": self.tracker.state_dict()}

    def restore(self, state: dict[str, Any], path: Path, env: ClusterEnv) -> None:
        if (state["scheduler"] is None) != (self.scheduler is None):
            has = "has" if state["scheduler"] is not None else "has no"
            raise CheckpointError(
                f"checkpoint {path} {has} scheduler state, unlike this run (the task's scheduler or "
                "lr_schedule)"
            )
        if self.scheduler is not None:
            load_into(self.scheduler, state["scheduler"], "scheduler", path)
            if (changed := getattr(self.scheduler, "resume_warning", None)) is not None:
                self.warnings.append(changed)  # a built-in schedule under a changed max_steps
        load_into(self.model.precision, state["precision"], "precision", path)
        self.memory.load_state_dict(state.get("memory"))  # a checkpoint from before it was saved: None
        self.tracker.load_state_dict(losses_of_rank(state, env), self.model.strategy.device)
