"""Where logged metrics go: a CSV file and TensorBoard event files."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Protocol

from leantrain.log.tfevents import EventFileWriter


class Sink(Protocol):
    path: Path  # the file it writes

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class CSVSink:
    """``metrics.csv``: one row per log point, one column per metric name.

    Validation metrics appear only after the first validation, so a new column can
    arrive late; the file is then rewritten once with the wider header. A resumed run
    keeps the rows up to its checkpoint's step and drops the later ones, which the
    resumed run logs again.
    """

    def __init__(self, path: Path, keep_until_step: int = 0) -> None:
        self.path = path
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        if keep_until_step and path.exists():
            with path.open(newline="", errors="replace") as previous:
                reader = csv.DictReader(previous)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = [row for row in reader if _step_of(row) <= keep_until_step]
        self._file = path.open("w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns)
        self._writer.writeheader()
        self._writer.writerows(self.rows)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row: dict[str, Any] = {"step": step, **metrics}
        self.rows.append(row)
        new = [name for name in row if name not in self.columns]
        if new:
            self.columns.extend(new)
            self._rewrite()
        else:
            self._writer.writerow(row)
        self._file.flush()

    def _rewrite(self) -> None:
        self._file.close()
        self._file = self.path.open("w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns)
        self._writer.writeheader()
        self._writer.writerows(self.rows)

    def close(self) -> None:
        self._file.close()


def _step_of(row: dict[str, Any]) -> float:
    """A kept row's step; infinity (dropped) for a row that is not one: torn by a crash mid-write, the
    zeros a file system may leave after a power loss, or an edited file. Its steps are logged again."""
    try:
        return int(row.get("step") or "")
    except (TypeError, ValueError):
        return math.inf


def tensorboard_tag(name: str) -> str:
    """``val_loss`` -> ``val/loss``, ``train_loss`` -> ``train/loss``, ``lr`` -> ``train/lr``."""
    split, sep, rest = name.partition("_")
    return f"{split}/{rest}" if sep and split in ("train", "val") else f"train/{name}"


class TensorBoardSink:
    """TensorBoard event files in the run folder (``tensorboard --logdir DIR``).

    A resumed run hides the events that the interrupted run wrote after the checkpoint.
    """

    def __init__(self, log_dir: Path, keep_until_step: int = 0) -> None:
        self._writer = EventFileWriter(log_dir, restart_step=keep_until_step + 1 if keep_until_step else None)
        self.path = self._writer.path

    def write(self, step: int, metrics: dict[str, float]) -> None:
        values = {
            tensorboard_tag(name): float(value)
            for name, value in metrics.items()
            if isinstance(value, (int, float)) and math.isfinite(value)
        }
        if values:
            self._writer.add_scalars(step, values)

    def close(self) -> None:
        self._writer.close()
