"""Seconds per step by phase: where a training step's time goes.

A phase is an interval of a step: ``data`` (waiting for the next batch), ``h2d`` (moving it
to the device), ``forward`` (the model and the loss), ``backward``, ``communication`` (the
part of the gradient all-reduce that backward waits for), ``optimizer``; ``other`` is the
rest of the step (clipping, the finite check, logging, the user's callbacks).

On CUDA, device work is timed with CUDA events recorded on the current stream (reading a
host clock would only time the kernel launches); the events are read once, when the
results are asked for, so timing adds no host synchronisation to a step. Waiting for data
is host time on every device. Usable on a hand-written loop::

    timer = PhaseTimer(device)
    for batch in loader:                       # or: with timer.phase("data"): batch = next(it)
        with timer.phase("forward"):
            loss = model(batch).mean()
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("optimizer"):
            optimizer.step(); optimizer.zero_grad()
        timer.end_step()
    print(timer.mean())
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

PHASES = ("data", "h2d", "forward", "backward", "communication", "optimizer", "other")


class WallClock:
    """Host time: a mark is a ``perf_counter()`` reading."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return end - start

    def settle(self) -> None:
        """Nothing is pending on the host."""


class CudaClock(WallClock):
    """Device time: a mark is a CUDA event recorded on the current stream."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def settle(self) -> None:
        torch.cuda.synchronize()  # once, when the results are read: every event has completed


@dataclass
class _Interval:
    step: int
    phase: str
    clock: WallClock
    start: Any
    end: Any


class PhaseTimer:
    """Collects phase intervals per step; ``steps()`` and ``mean()`` turn them into seconds."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.host = WallClock()
        self.device_clock = CudaClock() if torch.device(device).type == "cuda" else self.host
        self._intervals: list[_Interval] = []
        self._step_seconds: list[float] = []
        self._step_started = time.perf_counter()
        self.enabled = True  # off: phases and steps are not recorded (warm-up, audited steps)

    @property
    def step_index(self) -> int:
        return len(self._step_seconds)

    def mark(self, host: bool = False) -> Any:
        """A point in time on the device clock (or the host's), for ``add_interval``."""
        return (self.host if host else self.device_clock).mark()

    def add_interval(self, phase: str, start: Any, end: Any, host: bool = False) -> None:
        if self.enabled:
            clock = self.host if host else self.device_clock
            self._intervals.append(_Interval(self.step_index, phase, clock, start, end))

    def add_seconds(self, phase: str, seconds: float) -> None:
        """Host seconds measured elsewhere (e.g. a wait less the part another phase covers)."""
        self.add_interval(phase, 0.0, seconds, host=True)

    @contextmanager
    def phase(self, name: str, host: bool = False) -> Iterator[None]:
        """Time the enclosed code as ``name``; ``host=True`` for waiting done by the host (data)."""
        start = self.mark(host)
        try:
            yield
        finally:
            self.add_interval(name, start, self.mark(host), host)

    def end_step(self) -> None:
        """Close the current step (its wall time counts from the previous ``end_step``)."""
        now = time.perf_counter()
        if self.enabled:
            self._step_seconds.append(now - self._step_started)
        self._step_started = now

    def restart_step(self) -> None:
        """Start the next step's wall time now (after something that is not part of a step)."""
        self._step_started = time.perf_counter()

    def steps(self) -> list[dict[str, float]]:
        """Seconds by phase for every recorded step, ``other`` being what no phase covers."""
        self.device_clock.settle()
        table = [dict.fromkeys(PHASES, 0.0) for _ in self._step_seconds]
        for interval in self._intervals:
            if interval.step < len(table):
                table[interval.step][interval.phase] += interval.clock.seconds(interval.start, interval.end)
        for row, total in zip(table, self._step_seconds, strict=True):
            # Device and host intervals can overlap on CUDA: never a negative remainder.
            row["other"] = max(0.0, total - sum(row.values()))
            row["total"] = total
        return table

    def mean(self) -> dict[str, float]:
        """Mean seconds per step by phase (and ``total``); zeros before any step."""
        table = self.steps()
        keys = (*PHASES, "total")
        if not table:
            return dict.fromkeys(keys, 0.0)
        return {key: sum(row[key] for row in table) / len(table) for key in keys}
