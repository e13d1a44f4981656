"""The Task protocol (what the user provides), LossSum, and loading a task by name.

A task is any object with the methods below: no base class to inherit. Optional
methods may simply be absent.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from leantrain.errors import LeantrainError, TaskError


class LossSum(NamedTuple):
    """A loss given as a sum over elements (e.g. tokens) and the number of elements.

    The engine divides the sum over the whole global batch by the global count, so the
    result is exact however the batch is split into micro-batches and processes.
    ``count`` may be an int or a tensor (e.g. the number of unmasked tokens).
    """

    sum: torch.Tensor
    count: torch.Tensor | int


@runtime_checkable
class Task(Protocol):
    """What leantrain needs to train a model.

    Optional methods, used when present:
    ``val_data() -> Dataset | IterableDataset | None``,
    ``scheduler(optimizer) -> LRScheduler`` or ``scheduler(optimizer, total_steps) -> LRScheduler``
    (stepped once per optimizer step; given the run's optimizer steps when it takes a second
    parameter; not with a built-in ``lr_schedule``), ``metrics(model, batch) -> dict[str, Tensor]``
    (means over the batch, computed in evaluation on the validation data), ``augment(batch) ->
    batch`` (random augmentation of a training micro-batch on the device, after loading: it stays
    random when the data comes from a cache), ``tp_plan(model) -> dict[str, str]`` (with ``--tp``:
    module names, ``*`` for one part of a name, to ``colwise``, ``rowwise`` or ``colwise_rep``; see
    docs/parallelism.md).
    """

    def model(self) -> nn.Module: ...

    def train_data(self) -> Dataset | IterableDataset: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor | LossSum: ...

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer: ...


REQUIRED_METHODS = ("model", "train_data", "loss", "optimizer")


def check_task(task: Any, name: str) -> Any:
    """Raise TaskError unless ``task`` has every required method."""
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(task, m, None))]
    if missing:
        raise TaskError(f"task {name} lacks the method(s) {', '.join(missing)} that lt.Task requires")
    return task


def note_task_error(error: BaseException, method: str, where: str = "") -> None:
    """Add one line to an error raised in the task's own code: the method, and where in the run.

    The error keeps its type and traceback, so the user's ``except`` clauses and debugger see
    their own exception; the traceback shows the note at its end. The engine's own errors
    (LeantrainError) already say what is wrong, and get none.
    """
    if isinstance(error, LeantrainError):
        return
    line = f"leantrain: raised in {method}" + (f", {where}" if where else "")
    if sys.version_info >= (3, 11):
        error.add_note(line)
    else:  # Python 3.10 has no add_note: set what it sets (pytest and the exceptiongroup backport print it)
        error.__notes__ = [*getattr(error, "__notes__", []), line]


def call_task(
    method: str, function: Callable[..., Any], *args: Any, where: str = "", batch: Any = None
) -> Any:
    """``function(*args)``, one of the task's own methods: an error raised in it keeps its type and
    traceback and gets the note of :func:`note_task_error` (``batch`` described only then)."""
    try:
        return function(*args)
    except Exception as error:
        note_task_error(error, method, where if batch is None else f"{where}; batch: {describe_batch(batch)}")
        raise


# A batch described longer than this is cut: the note must stay one readable line.
DESCRIBED_BATCH_CHARS = 200


def describe_batch(batch: Any) -> str:
    """A batch's structure in short: ``(float32[8, 4], int64[8])``, ``{x: float32[8, 4]}``."""
    text = _described(batch)
    if len(text) <= DESCRIBED_BATCH_CHARS:
        return text
    return text[: DESCRIBED_BATCH_CHARS - 3] + "..."


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {_described(inner)}" for key, inner in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inside = ", ".join(_described(inner) for inner in value)
        return f"[{inside}]" if isinstance(value, list) else f"({inside})"
    return type(value).__name__


def load_task(spec: str) -> Any:
    """Build a task from ``"pkg.module:Name"`` (a class or a zero-argument factory)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TaskError(f"task {spec!r} is not of the form 'pkg.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise TaskError(f"task {spec!r}: cannot import module {module_name!r}: {error}") from error
    target = getattr(module, attr, None)
    if target is None:
        raise TaskError(f"task {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise TaskError(f"task {spec!r}: {attr!r} is neither a class nor a factory function")
    try:
        inspect.signature(target).bind()
    except TypeError as error:
        raise TaskError(f"task {spec!r}: {attr!r} must be callable with no arguments ({error})") from error
    except ValueError:  # builtins without a signature: let the call below decide
        pass
    return check_task(target(), repr(spec))
