"""The run's log: metrics to the sinks, progress to the terminal."""

from __future__ import annotations

from pathlib import Path

from leantrain.log.progress import make_progress
from leantrain.log.sinks import CSVSink, Sink, TensorBoardSink


class RunLogger:
    def __init__(
        self, run_dir: Path, total_steps: int, progress: str, tensorboard: bool, resumed_at_step: int = 0
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.sinks: list[Sink] = [CSVSink(run_dir / "metrics.csv", keep_until_step=resumed_at_step)]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir, keep_until_step=resumed_at_step))
        self.progress = make_progress(progress, total_steps)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def message(self, text: str) -> None:
        self.progress.message(text)

    def close(self) -> None:
        self.progress.close()
        for sink in self.sinks:
            sink.close()
