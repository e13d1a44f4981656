"""Loss spikes: which training steps' losses stand out from the steps before them.

A step's loss (over its whole global batch, read at a log point) is a spike when it is not finite, or when
its logarithm lies above ``median + K x spread`` of the logarithms of the last W accepted steps' losses
before its log window (one threshold per log point).
The spread is the median absolute deviation scaled to a normal's standard deviation (x 1.4826), never
taken below 0.01 (a 1 % wobble), so a loss that has flattened out does not turn the next ordinary wobble
into a spike. Logarithms because spikes and batch-to-batch noise are relative: a batch loss near its
floor varies by a similar factor as early in training (measured on a regression: the clean run's
largest step reached 6.1 spreads on the losses, 3.0 on their logarithms; a planted bad sample, 20 and
more). Losses that are not all positive (a loss that can be negative) are judged as they are. Robust
statistics: one spike moves neither the median nor the MAD, so it cannot hide the next one, and a loss
that falls steadily (the usual course of training) stays below its own recent median.

Until ``MIN_HISTORY`` losses are known nothing is judged: the first steps of a run move too fast for a
baseline. Every finite loss that was kept (not rolled back) joins the history, so a lasting change of level
(a new learning-rate phase) becomes the new baseline after about W/2 steps instead of warning forever.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# Below this many losses in the history, no step is judged (see the module docstring).
MIN_HISTORY = 20
# The spread is never taken below this fraction of the median.
SPREAD_FLOOR = 0.01
# The median absolute deviation of a normal distribution is 0.6745 standard deviations.
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Spike:
    """A step whose loss stood out: its 1-based number, its loss and the threshold it crossed."""

    step: int
    loss: float
    threshold: float  # nan for a non-finite loss or gradient (no threshold is needed)
    what: str = "loss"  # or "gradient norm": the step's gradients were not finite
    origin: str | None = None  # a non-finite step's: the module that made the value (diagnose/nan_origin.py)

    def describe(self) -> str:
        if not math.isfinite(self.threshold):
            where = "" if self.origin is None else f" ({self.origin})"
            return f"the training {self.what} is not finite at step {self.step}{where}"
        return f"loss spike at step {self.step}: {self.loss:.4g} above the threshold {self.threshold:.4g}"


class SpikeDetector:
    """The last ``window`` accepted step losses, and the rule that judges the next ones against them."""

    def __init__(self, threshold: float, window: int) -> None:
        self.threshold = threshold
        self.history: deque[float] = deque(maxlen=window)

    def limit(self) -> float | None:
        """The loss above which a step is a spike now; None while the history is too short."""
        if len(self.history) < MIN_HISTORY:
            return None
        losses = np.fromiter(self.history, np.float64, len(self.history))
        positive = bool(losses.min() > 0)
        values = np.log(losses) if positive else losses
        median = float(np.median(values))
        spread = MAD_TO_SIGMA * float(np.median(np.abs(values - median)))
        floor = SPREAD_FLOOR if positive else SPREAD_FLOOR * abs(median)
        limit = median + self.threshold * max(spread, floor)
        return math.exp(limit) if positive else limit

    def first_spike(self, step_losses: Iterable[tuple[int, float]], accept: bool) -> Spike | None:
        """The first spike among a log window's (0-based step, loss) pairs, in order, each judged against
        the history before the window (one threshold per log point: the rule's cost stays a few tens of
        microseconds whatever the window's length). The losses before the spike join the history; the
        spike and what follows it join only with ``accept`` (warn: the run goes on with them; rollback:
        they are undone)."""
        found, limit = None, self.limit()
        for index, loss in step_losses:
            if found is None and (not math.isfinite(loss) or (limit is not None and loss > limit)):
                found = Spike(index + 1, loss, math.nan if not math.isfinite(loss) else limit)
                if not accept:
                    break
            if math.isfinite(loss):
                self.history.append(loss)
        return found

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state["history"])
