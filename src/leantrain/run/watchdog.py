"""The hang watchdog (``--hang-timeout SECONDS``): a run that stops making progress ends itself,
saying which rank did not arrive and where it is stuck.

The loop marks progress (``Heartbeat.beat``) whenever a micro-batch arrives, a loss returns, a
validation batch arrives or a checkpoint is saved: a few attribute writes, nothing on the device.
A thread on every rank looks every few seconds. When a rank has made no progress for
``hang_timeout`` seconds, its thread:

1. writes the rank's Python stacks (every thread, ``faulthandler``) and its step into
   ``DIR/hang/rank<N>.txt``;
2. publishes its progress count, step and the innermost frame of the training thread in the
   process group's store, and waits a little for the other ranks' (they stall too: they wait
   for this one in a collective);
3. the lowest rank that reported prints one line: the rank(s) behind the others (fewest
   progress marks, or no report at all: their Python does not run), the step, and the
   file:line each of them is at;
4. exits with code 75 (``EX_TEMPFAIL``): torchrun restarts the group under ``--max-restarts``,
   and ``--resume auto`` continues from the last checkpoint.

The process group's own timeout is set above ``hang_timeout`` (``process_group_timeout``) so
the watchdog speaks first; a collective that times out says far less.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

HANG_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: try again (torchrun's --max-restarts does)
_GATHER_SECONDS = (10.0, 60.0)  # how long the reporting rank waits for the others' reports
_STATUS_KEY = "leantrain/hang/{rank}"


def process_group_timeout(hang_timeout: float) -> timedelta | None:
    """The process group's collective timeout: after the watchdog has spoken, or torch's default."""
    if not hang_timeout:
        return None
    return timedelta(seconds=hang_timeout + _GATHER_SECONDS[1] + 60)


class Heartbeat:
    """What the loop marks: how many times it moved on, when last, and at which step."""

    __slots__ = ("count", "last", "step")

    def __init__(self) -> None:
        self.count = 0
        self.last = time.monotonic()
        self.step = 0

    def beat(self) -> None:
        self.count += 1
        self.last = time.monotonic()

    def counted(self, items: Iterable[Any]) -> Iterator[Any]:
        """``items``, marking progress as each one arrives."""
        for item in items:
            self.beat()
            yield item

    def after(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function``, marking progress each time it returns."""

        def marked(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            self.beat()
            return result

        return marked


class Watchdog:
    """The thread described above, watching the thread that calls ``watching()``."""

    def __init__(
        self,
        timeout: float,
        heartbeat: Heartbeat,
        folder: Path,
        rank: int,
        world_size: int,
        store: Any | None,
        say: Callable[[str], None],
        exit: Callable[[int], None] = os._exit,
        paused: Callable[[], bool] = lambda: False,
    ) -> None:
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.folder = folder
        self.rank, self.world_size = rank, world_size
        self.store = store  # the process group's; None on one process
        self.say = say
        self.exit = exit
        self.paused = paused  # true while torch compiles (--compile): that is progress too
        self._stopped = threading.Event()
        self._watched = 0  # the training thread's id

    @contextmanager
    def watching(self) -> Iterator[None]:
        if not self.timeout:
            yield
            return
        self._watched = threading.get_ident()
        self.heartbeat.beat()
        thread = threading.Thread(target=self._watch, name="leantrain-hang-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stopped.set()
            thread.join()

    def _watch(self) -> None:
        poll = min(5.0, max(self.timeout / 5, 0.05))
        while not self._stopped.wait(poll):
            if self.paused():
                self.heartbeat.last = time.monotonic()
            elif time.monotonic() - self.heartbeat.last > self.timeout:
                self._report()
                self.exit(HANG_EXIT_CODE)
                return

    def _report(self) -> None:
        stalled = time.monotonic() - self.heartbeat.last
        where = stuck_at(sys._current_frames().get(self._watched))
        stacks = self._write_stacks(stalled)
        mine = {"count": self.heartbeat.count, "where": where}
        reports = self._gather(mine)
        if min(rank for rank, report in reports.items() if report is not None) != self.rank:
            return  # a lower rank that reported says it (a rank whose Python is stuck cannot)
        self.say(
            f"no progress for {stalled:.0f} s at step {self.heartbeat.step + 1}: "
            f"{describe(reports, self.world_size)}; every rank's stacks are in {stacks.parent}"
        )

    def _write_stacks(self, stalled: float) -> Path:
        path = self.folder / "hang" / f"rank{self.rank}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as handle:
                handle.write(
                    f"rank {self.rank}: no progress for {stalled:.1f} s at step {self.heartbeat.step + 1}\n"
                )
                handle.flush()
                faulthandler.dump_traceback(handle, all_threads=True)
        except OSError as error:  # a full disk must not keep the run from ending
            print(f"leantrain: could not write {path}: {error.strerror}", file=sys.stderr)
        return path

    def _gather(self, mine: dict[str, Any]) -> dict[int, dict[str, Any] | None]:
        """Every rank's report (None: none came within the wait), this one's included."""
        if self.store is None:
            return {self.rank: mine}
        self.store.set(_STATUS_KEY.format(rank=self.rank), json.dumps(mine))
        keys = {rank: _STATUS_KEY.format(rank=rank) for rank in range(self.world_size)}
        wait = min(max(self.timeout, _GATHER_SECONDS[0]), _GATHER_SECONDS[1])
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.2)
        reports: dict[int, dict[str, Any] | None] = {}
        for rank, key in keys.items():
            reports[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return reports


def stuck_at(frame: FrameType | None) -> str:
    """``file:line in function`` of the innermost Python frame of a thread."""
    if frame is None:
        return "an unknown place (the thread has no Python frame)"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def describe(reports: dict[int, dict[str, Any] | None], world_size: int) -> str:
    """Which rank(s) did not arrive and where they are, then where the others wait."""
    heard = {rank: report for rank, report in reports.items() if report is not None}
    if world_size == 1:
        return f"stuck at {heard[min(heard)]['where']}"
    silent = [rank for rank, report in reports.items() if report is None]
    if silent:
        behind = silent
        why = "did not report (its Python does not run: stuck in native code?)"
    else:
        fewest = min(report["count"] for report in heard.values())
        behind = [rank for rank, report in heard.items() if report["count"] == fewest]
        why = "did not arrive" if len(behind) < len(heard) else "all wait, none behind the others"
    places = [f"rank {rank} at {heard[rank]['where']}" for rank in behind if rank in heard]
    waiting = [
        f"rank {rank} waits at {report['where']}" for rank, report in heard.items() if rank not in behind
    ]
    ranks = f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))}"
    return "; ".join([f"{ranks} {why}", *places, *waiting])
