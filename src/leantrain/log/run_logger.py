"""The run's log: metrics to the sinks, progress to the terminal."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from leantrain.errors import LeantrainWarning, StorageError
from leantrain.files import writing
from leantrain.log.progress import make_progress
from leantrain.log.sinks import CSVSink, Sink, TensorBoardSink


class RunLogger:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        progress: str,
        tensorboard: bool,
        resumed_at_step: int = 0,
        enabled: bool = True,
    ) -> None:
        """``enabled=False`` (ranks other than 0) writes and prints nothing."""
        self.sinks: list[Sink] = []
        self.enabled = enabled
        self.progress = make_progress(progress if enabled else "none", total_steps)
        if not enabled:
            return
        with writing("the run folder", run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            self.sinks.append(CSVSink(run_dir / "metrics.csv", keep_until_step=resumed_at_step))
            if tensorboard:
                self.sinks.append(TensorBoardSink(run_dir, keep_until_step=resumed_at_step))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            with writing("metrics", sink.path):
                sink.write(step, metrics)

    def message(self, text: str) -> None:
        self.progress.message(text)

    def warning(self, text: str) -> None:
        """A :class:`LeantrainWarning`: on stderr (shown once per text), catchable in Python."""
        if self.enabled:
            warnings.warn(text, LeantrainWarning, stacklevel=2)

    def close_after_error(self) -> None:
        """Close while an error is on its way: a refused write here would only hide that error."""
        with contextlib.suppress(StorageError):
            self.close()

    def close(self) -> None:
        self.progress.close()
        for sink in self.sinks:
            with writing("metrics", sink.path):
                sink.close()
