"""Progress display: a live ``rich`` bar on a terminal, plain lines otherwise (CI, pipes)."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressDisplay(Protocol):
    def update(self, step: int, loss: float, samples_per_second: float, eta_seconds: float) -> None: ...

    def message(self, text: str) -> None: ...

    def close(self) -> None: ...


class PlainProgress:
    """One line per log point: readable in CI logs and files."""

    def __init__(self, total_steps: int) -> None:
        self.total = total_steps

    def update(self, step: int, loss: float, samples_per_second: float, eta_seconds: float) -> None:
        eta = timedelta(seconds=round(eta_seconds))
        print(
            f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_second:,.0f} samples/s  eta {eta}",
            flush=True,
        )

    def message(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A live bar with loss, throughput and ETA, updated only at log points."""

    def __init__(self, total_steps: int, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]} samples/s"),
            TimeRemainingColumn(),
            console=console or Console(),
        )
        self._task = self._progress.add_task("train", total=total_steps, loss="-", speed="-")
        self._progress.start()

    def update(self, step: int, loss: float, samples_per_second: float, eta_seconds: float) -> None:
        self._progress.update(
            self._task, completed=step, loss=f"{loss:.4f}", speed=f"{samples_per_second:,.0f}"
        )

    def message(self, text: str) -> None:
        self._progress.console.print(text)

    def close(self) -> None:
        self._progress.stop()


class NoProgress:
    def update(self, step: int, loss: float, samples_per_second: float, eta_seconds: float) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(mode: str, total_steps: int) -> ProgressDisplay:
    """``auto`` picks the live bar only when stdout is an interactive terminal."""
    if mode == "auto":
        mode = "rich" if sys.stdout.isatty() else "plain"
    if mode == "rich":
        return RichProgress(total_steps)
    if mode == "plain":
        return PlainProgress(total_steps)
    return NoProgress()
