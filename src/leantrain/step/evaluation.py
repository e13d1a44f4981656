"""Validation: the task's loss and metrics over a whole dataset, read once at the end."""

from __future__ import annotations

import itertools
from collections import deque
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

    def any_rank(self, flag: bool) -> bool: ...

    def gather(self, value: Any) -> list[Any]: ...


LossAndMetrics = Callable[[nn.Module, Any], tuple[Any, dict[str, Any]]]
_NONE = object()  # no batch left


def even_forwards(
    batches: Iterable[Any],
    forwards: int | None,
    any_rank: Callable[[bool], bool],
    spare: Callable[[], Any] | None,
    counted: deque[bool],
) -> Iterator[Any]:
    """``batches``, then spare ones, until this process has run as many forwards as every other.

    Under a strategy whose forward communicates (fsdp gathers the parameters from every rank), a
    rank that stops early leaves the others waiting in a collective; uneven validation shares are
    the rule (101 samples on 2 ranks). ``forwards``: how many every rank runs (the largest share's
    batches); None when not known (a stream without a length): the ranks then agree before each
    batch whether any has one left. A spare batch is this process's last batch again (or
    ``spare()`` when it had none); ``counted`` gets, in order, whether each batch yielded counts.
    """
    source, last, ran = iter(batches), _NONE, 0
    while True:
        batch = next(source, _NONE)
        has_batch = batch is not _NONE
        done = not any_rank(has_batch) if forwards is None else not has_batch and ran >= forwards
        if done:
            return
        if has_batch:
            last = batch
        elif last is _NONE:
            if spare is None:
                raise ValueError("a rank without validation batches needs a spare batch to run")
            last = spare()
        counted.append(has_batch)
        ran += 1
        yield last


@torch.no_grad()
def evaluate(
    strategy: EvalStrategy,
    task: Any,
    batches: Iterable[Any],
    precision: Precision,
    forwards: int | None = None,
    spare: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Mean loss (``val_loss``) and mean of each task metric (``val_<name>``), weighted by samples.

    ``batches`` are device batches of this process's share of the data; the strategy runs the
    forward passes (a pipeline: through its stages) and yields the losses it computed. Every rank
    runs the same number of forwards (``even_forwards``: ``forwards`` per rank, or agreed batch by
    batch; ``spare``: a batch for a rank with none), the spare ones counting for nothing. Sums stay
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
    counted: deque[bool] = deque()  # for each batch fed, in order: whether its result counts
    fed = even_forwards(batches, forwards, strategy.any_rank, spare, counted)
    for loss, extra, samples in strategy.forward_only(loss_and_metrics, fed, precision):
        if counted.popleft():  # a strategy yields one result per batch, in order (or none at all)
            sums.add_batch(loss, extra, samples)
    names, totals = sums.totals()
    merged: dict[str, list[float]] = {}
    for part in strategy.gather(dict(zip(names, totals.tolist(), strict=True))):
        for name, (total, weight) in part.items():
            merged.setdefault(name, [0.0, 0.0])
            merged[name][0] += total
            merged[name][1] += weight
    return {f"val_{name}": total / max(weight, 1e-12) for name, (total, weight) in sorted(merged.items())}


@torch.no_grad()
def metric_names(
    strategy: EvalStrategy, task: Any, batches: Iterable[Any], precision: Precision, spare: Callable[[], Any]
) -> list[str]:
    """The names validation will log (``val_loss``, ``val_<metric>``), from the task's ``metrics``
    on this process's first validation batch (``spare`` where it has none): what a setting that
    watches a metric can be checked against before training. The loss is not computed: its name
    is always ``val_loss``. Through the strategy, as validation runs (a sharded forward gathers
    from every rank; a pipeline's last stage holds the names, and the gather brings them)."""
    metrics_fn = getattr(task, "metrics", None)
    names = {"loss"}
    if callable(metrics_fn):

        def metrics_only(model: nn.Module, batch: Any) -> tuple[Any, dict[str, Any]]:
            extra = call_task("task.metrics", metrics_fn, model, batch, where="in validation", batch=batch)
            return torch.zeros(()), extra

        first = itertools.islice(batches, 1)
        fed = even_forwards(first, 1, strategy.any_rank, spare, deque())
        for _, extra, _ in strategy.forward_only(metrics_only, fed, precision):
            names.update(extra)
    every = set().union(*strategy.gather(sorted(names)))
    return [f"val_{name}" for name in sorted(every)]
