"""Experiment trackers (``--logger mlflow,wandb``) as callbacks, on rank 0 only.

A tracker receives the resolved config as parameters, every row of ``metrics.csv`` at its step,
and ``summary.json``'s values at the end (as ``summary/<name>``, beside the metrics of the same
name); a key naming its run travels in checkpoints, so a resumed run continues that run. Tracker
calls run on a thread of their own: a slow or unreachable server never holds up training. The
first failure is reported once and that tracker is dropped; ``metrics.csv`` still has everything.
"""

from __future__ import annotations

import importlib.util
import queue
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from leantrain.config import TrainConfig
from leantrain.errors import ConfigError

# The package each tracker needs, and the extra that installs it.
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


class Tracker(Protocol):
    name: str

    def start(self, params: dict[str, Any], run_key: str, resumed: bool) -> None:
        """Open the tracker's run named by ``run_key`` (``resumed``: continue it if it exists);
        ``params`` are logged when the run is new."""
        ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, summary: dict[str, Any] | None) -> None:
        """Close the run: finished with ``summary``, or failed/interrupted when it is None."""
        ...


def check_trackers(cfg: TrainConfig) -> None:
    """Before anything starts: every tracker asked for can be imported (a one-line error naming the extra)."""
    for name in cfg.loggers:
        package = PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError("logger", name, f"needs the {package} package: pip install 'leantrain[{name}]'")


def open_trackers(cfg: TrainConfig, run_dir: Path, warn: Callable[[str], None]) -> list[TrackerCallback]:
    """The tracker callbacks ``cfg.logger`` asks for (TensorBoard is a sink of the run's log, not one)."""
    trackers: list[Tracker] = []
    for name in cfg.loggers:
        if name == "mlflow":
            from leantrain.extensions.mlflow_tracker import MLflowTracker

            trackers.append(MLflowTracker(cfg.mlflow_uri, run_dir))
        elif name == "wandb":
            from leantrain.extensions.wandb_tracker import WandbTracker

            trackers.append(WandbTracker(cfg.wandb_project, run_dir))
    return [TrackerCallback(tracker, cfg.to_dict(), warn) for tracker in trackers]


class TrackerCallback:
    """One tracker behind the callback seam: its calls queued to a thread, its failure contained."""

    def __init__(self, tracker: Tracker, params: dict[str, Any], warn: Callable[[str], None]) -> None:
        self.tracker = tracker
        self.params = params
        self.warn = warn
        self.state_key = f"tracker:{tracker.name}"
        # Chosen here, not by the tracker: it is in the first checkpoint even when the tracker
        # (on its own thread) has not opened its run yet, so a resume always finds the same run.
        self.run_key = uuid.uuid4().hex[:16]
        self.resumed = False
        self.failed = False
        self._calls: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        row = dict(metrics)
        self._submit(lambda: self.tracker.log(step, row))

    def on_end(self, summary: dict[str, Any] | None) -> None:
        self._submit(lambda: self.tracker.finish(summary))
        if self._thread is not None:
            self._calls.put(None)
            self._thread.join()  # the last rows and the summary reach the tracker before fit returns

    def state_dict(self) -> dict[str, Any]:
        return {"run_key": self.run_key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_key, self.resumed = state["run_key"], True

    def _submit(self, call: Callable[[], None]) -> None:
        if self.failed:
            return
        if self._thread is None:
            self._calls.put(lambda: self.tracker.start(self.params, self.run_key, self.resumed))
            name = f"leantrain-{self.tracker.name}"
            self._thread = threading.Thread(target=self._work, name=name, daemon=True)
            self._thread.start()
        self._calls.put(call)

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            if self.failed:
                continue
            try:
                call()
            except Exception as error:  # a tracker's failure must never end the training
                self.failed = True
                self.warn(
                    f"logger {self.tracker.name} failed and is switched off for this run "
                    f"({type(error).__name__}: {error}); training goes on, metrics.csv has every value"
                )
