"""Stop signals: SIGTERM and SIGUSR1 (what schedulers send before pre-emption), recorded while
armed and acted on at the next step boundary (a checkpoint, then ``RunInterrupted``).

The ``leantrain fit`` command arms them first thing (``entry.py``), before torch is imported: a
signal that arrives while the run is set up (imports, the model, the data) stops it before its
first step with the documented line, instead of the default action's silent exit 143.
``Trainer.fit`` arms them for the whole fit in Python. Armed again inside (fit within the command),
the inner recorder tells the outer one too, and starts from what the outer one already received.

Handlers can only be installed from the main thread; elsewhere the signals keep their previous
behaviour. Imports nothing heavy: the command arms it before anything else.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

SIGNALS = ("SIGTERM", "SIGUSR1")


class StopSignals:
    """While entered, SIGTERM and SIGUSR1 only set ``received``; the loop acts on it."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._outer: StopSignals | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                self._previous[number] = signal.signal(number, self._record)
        outer = getattr(self._previous.get(signal.SIGTERM), "__self__", None)
        if isinstance(outer, StopSignals):  # armed already (by the command): one record for both
            self._outer = outer
            self.received = outer.received
        return self

    def _record(self, number: int, frame: Any) -> None:
        self.received = signal.Signals(number)
        if self._outer is not None:
            self._outer._record(number, frame)

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
