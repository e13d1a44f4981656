"""Validation: the task's loss and metrics over a whole dataset, read once at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from leantrain.data.loader import device_batches
from leantrain.errors import TaskError
from leantrain.precision import Precision
from leantrain.task import LossSum


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

    def totals(self, device: torch.device) -> tuple[list[str], torch.Tensor]:
        """The names, and a [names, 2] tensor of (sum, weight) rows."""
        names = sorted(self.sums)
        rows = [
            torch.stack([self.sums[n], torch.as_tensor(self.weights[n], device=device).double()])
            for n in names
        ]
        return names, torch.stack(rows) if rows else torch.zeros((0, 2), dtype=torch.float64, device=device)


def means(names: list[str], totals: torch.Tensor) -> dict[str, float]:
    """``val_<name>``: each sum over its weight (one host read)."""
    return {
        f"val_{name}": float(total / weight)
        for name, (total, weight) in zip(names, totals.cpu(), strict=True)
    }


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Any,
    batches: Iterable[Any],
    device: torch.device,
    precision: Precision,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Mean loss (``val_loss``) and mean of each task metric (``val_<name>``), weighted by samples.

    Sums stay on the device until the end: one host sync per validation. With
    ``all_reduce_sum``, each rank evaluates its share of the data and the sums are added.
    """
    metrics_fn = getattr(task, "metrics", None)
    sums = ValidationSums()
    was_training = model.training
    model.eval()
    try:
        for batch in device_batches(batches, device, precision.input_dtype):
            with precision.autocast():
                loss = task.loss(model, batch)
                extra = metrics_fn(model, batch) if callable(metrics_fn) else {}
            sums.add_batch(loss, extra, batch_size_of(batch))
    finally:
        model.train(was_training)
    names, totals = sums.totals(device)
    if all_reduce_sum is not None:
        totals = all_reduce_sum(totals)
    return means(names, totals)
