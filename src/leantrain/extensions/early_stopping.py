"""Early stopping: the run ends when a validation metric has not improved for ``patience``
validations in a row (``--early-stop-metric``); the loop saves a checkpoint first."""

from __future__ import annotations

from typing import Any

from leantrain.extensions.metric_watch import MetricWatch


class EarlyStopping:
    """A callback: sets ``stop_reason`` once the metric stalls. Its counters travel in checkpoints,
    so a resumed run stops where the uninterrupted one would have."""

    def __init__(self, watch: MetricWatch, patience: int) -> None:
        self.watch = watch
        self.patience = patience
        self.best: float | None = None
        self.best_step = 0
        self.stalled = 0  # validations in a row without improvement
        self.stop_reason: str | None = None

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        value = self.watch.value_in(metrics)
        if value is None or self.stop_reason is not None:
            return
        if self.watch.better(value, self.best):
            self.best, self.best_step, self.stalled = value, step, 0
            return
        self.stalled += 1
        if self.stalled >= self.patience:
            best = (
                "no value was a number"
                if self.best is None
                else f"best {self.best:.6g} at step {self.best_step}"
            )
            self.stop_reason = (
                f"early stop at step {step}: {self.watch.metric} has not improved by more than "
                f"{self.watch.min_delta:g} in {self.patience} validation(s) ({best})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "stalled": self.stalled,
            "stop_reason": self.stop_reason,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.stalled, self.stop_reason = state["stalled"], state["stop_reason"]
