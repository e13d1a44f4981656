"""Validation: the task's loss and metrics over a whole dataset, read once at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from leantrain.errors import TaskError
from leantrain.step.precision import Precision
from leantrain.task import LossSum, call_task


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        try:
            return batch_size_of(value)
        except TaskError:
            continue
    raise TaskError(f"cannot tell the batch size of a {type(batch).__name__} batch: it holds no tensor")


class ValidationSums:
    """Sample-weighted sums of the loss and of each metric, kept on the device until read."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor | int] = {}

    def add(self, name: str, total: torch.Tensor, weight: torch.Tensor | int) -> None:
        self.sums[name] = self.sums.get(name, 0) + total.detach().double()
        self.weights[name] = self.weights.get(name, 0) + weight

    def add_batch(self, loss: Any, extra: dict[str, Any], samples: int) -> None:
        """A batch's loss (a mean over ``samples``, or a LossSum) and its metrics (means)."""
        if isinstance(loss, LossSum):
            self.add("loss", loss.sum, loss.count)
        else:
            self.add("loss", loss * samples, samples)
        for name, value in extra.items():
            self.add(name, torch.as_tensor(value).mean() * samples, samples)

    def totals(self) -> tuple[list[str], torch.Tensor]:
        """The names, and a [names, 2] tensor of (sum, weight) rows."""
        names = sorted(self.sums)
        rows = [
            torch.stack([self.sums[n], torch.as_tensor(self.weights[n], device=self.sums[n].device).double()])
            for n in names
        ]
        return names, torch.stack(rows) if rows else torch.zeros((0, 2), dtype=torch.float64)


class EvalStrategy(Protocol):
    """What validation asks of a strategy (``strategies/base.py`` has the whole contract)."""

    def forward_only(
        self, loss_and_metrics: LossAndMetrics, batches: Iterable[Any], precision: Precision
    ) -> Iterator[tuple[Any, dict[str, Any], int]]: ...

    def gather(self, value: Any) -> list[Any]: ...


LossAndMetrics = Callable[[nn.Module, Any], tuple[Any, dict[str, Any]]]


@torch.no_grad()
def evaluate(
    strategy: EvalStrategy, task: Any, batches: Iterable[Any], precision: Precision
) -> dict[str, float]:
    """Mean loss (``val_loss``) and mean of each task metric (``val_<name>``), weighted by samples.

    ``batches`` are device batches of this process's share of the data; the strategy runs the
    forward passes (a pipeline: through its stages) and yields the losses it computed. Sums stay
    on the device until the end: one host read per validation, then one gather of every
    process's sums (a process that computed no loss, a pipeline's first stage, adds nothing).
    """
    metrics_fn = getattr(task, "metrics", None)

    def loss_and_metrics(model: nn.Module, batch: Any) -> tuple[Any, dict[str, Any]]:
        loss = call_task("task.loss", task.loss, model, batch, where="in validation", batch=batch)
        if not callable(metrics_fn):
            return loss, {}
        return loss, call_task("task.metrics", metrics_fn, model, batch, where="in validation", batch=batch)

    sums = ValidationSums()
    for loss, extra, samples in strategy.forward_only(loss_and_metrics, batches, precision):
        sums.add_batch(loss, extra, samples)
    names, totals = sums.totals()
    merged: dict[str, list[float]] = {}
    for part in strategy.gather(dict(zip(names, totals.tolist(), strict=True))):
        for name, (total, weight) in part.items():
            merged.setdefault(name, [0.0, 0.0])
            merged[name][0] += total
            merged[name][1] += weight
    return {f"val_{name}": total / max(weight, 1e-12) for name, (total, weight) in sorted(merged.items())}
