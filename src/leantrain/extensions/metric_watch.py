"""Which value of a validation metric is better: shared by early stopping and best checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass

from leantrain.errors import ConfigError


@dataclass(frozen=True)
class MetricWatch:
    """``metric`` (a ``val_*`` name), where ``mode`` min means lower is better; an improvement must
    exceed ``min_delta``. ``field`` names the config field that chose the metric, for errors."""

    metric: str
    mode: str
    field: str
    min_delta: float = 0.0

    def value_in(self, metrics: dict[str, float]) -> float | None:
        """The metric's value in a validation's metrics; None for a training log point. A
        validation without the metric is a one-line error naming what there is."""
        if self.metric in metrics:
            return float(metrics[self.metric])
        if any(name.startswith("val_") for name in metrics):
            there = ", ".join(sorted(name for name in metrics if name.startswith("val_")))
            raise ConfigError(
                self.field, self.metric, f"is not a validation metric of this task (it has {there})"
            )
        return None

    def better(self, value: float, than: float | None) -> bool:
        """Whether ``value`` improves on ``than`` by more than min_delta (a NaN never does)."""
        if math.isnan(value):
            return False
        if than is None:
            return True
        return value < than - self.min_delta if self.mode == "min" else value > than + self.min_delta
