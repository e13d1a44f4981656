"""How a run is watched: callbacks (``on_step``, ``on_log``) and the doctor's ``Instruments`` seam."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, Protocol

import torch

from leantrain.step.accumulator import StepStatus
from leantrain.step.precision import Precision
from leantrain.strategies.base import Strategy


class StepStats(NamedTuple):
    step: int  # optimizer steps completed (a skipped step counts: its batch was used)
    status: StepStatus  # STEPPED, or why the update was skipped
    grad_norm: torch.Tensor | None  # on the device: reading it is a host sync
    grad_underflow_share: torch.Tensor | None = None  # fp16 only, at log points

    @property
    def stepped(self) -> bool:
        return self.status is StepStatus.STEPPED


class Callback(Protocol):
    """Extension point: every member is optional; the loop looks each one up once.

    - ``on_step(stats)``: after every optimizer step (keep it cheap: it runs in the hot loop).
    - ``on_log(step, metrics)``: at each log point (training metrics) and each validation
      (``val_*`` metrics): the rows of ``metrics.csv``, on every process (the values are the
      same on every rank).
    - ``on_end(summary)``: once, with ``summary.json``'s values, or ``None`` when the run ended
      by an error or a stop signal.
    - ``stop_reason``: an attribute; a callback that sets it to a sentence during ``on_log``
      stops the run after that log point or validation, with a checkpoint (early stopping).
    - ``state_dict()`` / ``load_state_dict(state)``: what the callback must carry across a
      resume, saved in every checkpoint under ``state_key`` (default: the class name). With
      ``saved_with_model = True`` the state is split like the model's (tensors shaped like
      the parameters each process holds): a sharded strategy saves and reads it with the model's
      shards, by its keys, in place.
    - ``evaluated_weights()``: a context manager each validation runs in (with the callbacks'
      ``on_log`` of its metrics); the weight average swaps itself in there.
    - ``setup_lines()``: lines for the run log's set-up block, printed once before the first
      step (the trackers say where they log, and which flag or variable chose it).

    Trackers, early stopping, best checkpoints and the weight average are built on these
    (``leantrain.extensions``).
    """

    def on_step(self, stats: StepStats) -> None: ...

    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...


def state_key(callback: Any) -> str:
    """The name a callback's state is saved under in a checkpoint."""
    return getattr(callback, "state_key", type(callback).__name__)


class Instruments(Protocol):
    """Measurement seam (``leantrain doctor``): wraps the run's pieces once, when they are built.

    Each method returns its argument or a wrapper with the same interface; the loop never
    asks whether it is measured. A plain run uses ``NoInstruments``, which wraps nothing.
    """

    def precision(self, precision: Precision) -> Precision: ...

    def strategy(self, strategy: Strategy) -> None:
        """Hook into the strategy once it is built (the doctor times DDP's all-reduce)."""
        ...

    def loss(self, loss_fn: Any) -> Any: ...

    def loader(self, batches: Iterable[Any]) -> Iterable[Any]: ...

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]: ...


class NoInstruments:
    """Measures nothing: every piece is used as it is."""

    def precision(self, precision: Precision) -> Precision:
        return precision

    def strategy(self, strategy: Strategy) -> None:
        pass

    def loss(self, loss_fn: Any) -> Any:
        return loss_fn

    def loader(self, batches: Iterable[Any]) -> Iterable[Any]:
        return batches

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        return batches
