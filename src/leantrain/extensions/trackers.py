"""Experiment trackers (``--logger mlflow,wandb``) as callbacks, on rank 0 only.

A tracker receives the resolved config as parameters, every row of ``metrics.csv`` at its step,
and ``summary.json``'s values at the end (as ``summary/<name>``, beside the metrics of the same
name); a key naming its run travels in checkpoints, so a resumed run continues that run.

A tracker that is down, slow or silent never holds up training. Its calls run on a thread of
its own, behind a queue of at most ``QUEUE_ROWS`` rows (more are dropped and counted). A call
still unanswered after ``tracker_timeout`` seconds, or the first failure, is one warning and the
tracker is switched off; the end of the run waits for it at most ``tracker_timeout`` seconds, then
says what was not delivered. ``metrics.csv`` has everything either way. The thread is a daemon
that nothing joins: a process whose tracker is stuck still exits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from leantrain.config import TrainConfig
from leantrain.errors import ConfigError, LeantrainError

# The package each tracker needs, and the extra that installs it.
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}

# Rows a tracker's queue holds while its thread is behind: a few floats each, so a few MB at most
# for a tracker that is stuck, and 10,000 log points of slack for one that is only slow.
QUEUE_ROWS = 10_000
# In the run folder: per tracker, the last step handed to its run (see the module's docstring).
MARKS = "trackers"


class Tracker(Protocol):
    name: str
    where: str  # where it sends (a URI, a project), for the messages that name it
    attach: str | None  # the run the environment names (MLFLOW_RUN_ID, WANDB_RUN_ID): it is the run key
    describe: str  # for the run's log: where it logs, and what chose each setting

    def connect(self) -> None:
        """Reach the tracker's server without opening a run (``tracker_required`` checks it)."""
        ...

    def start(self, params: dict[str, Any], run_key: str, resumed: bool) -> int | None:
        """Open the tracker's run named by ``run_key`` (``resumed``: continue it if it exists);
        ``params`` are logged when the run is new. Returns the last step a continued run already
        holds, when the answer to opening it says (no further request), else None."""
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
    """The tracker callbacks ``cfg.logger`` asks for (TensorBoard is a sink of the run's log, not one);
    with ``tracker_required``, each one's server has answered before this returns."""
    trackers: list[Tracker] = []
    for name in cfg.loggers:
        if name == "mlflow":
            from leantrain.extensions.mlflow_tracker import MLflowTracker

            trackers.append(MLflowTracker(cfg.mlflow_uri, run_dir, cfg.tracker_timeout))
        elif name == "wandb":
            from leantrain.extensions.wandb_tracker import WandbTracker

            trackers.append(WandbTracker(cfg.wandb_project, run_dir, cfg.tracker_timeout))
    callbacks = [
        TrackerCallback(
            tracker, cfg.to_dict(), warn, cfg.tracker_timeout, marks=run_dir / MARKS / f"{tracker.name}.json"
        )
        for tracker in trackers
    ]
    if cfg.tracker_required:
        for callback in callbacks:
            callback.connect()
    return callbacks


class TrackerCallback:
    """One tracker behind the callback seam: its calls queued to a thread, bounded in time and
    memory, its failure contained. Nothing the training thread does waits on the tracker, except
    ``connect`` (asked for) and ``on_end`` (at most ``timeout`` seconds). ``marks``: the file that
    records the last step handed to the tracker (None: not recorded, nothing skipped on resume)."""

    def __init__(
        self,
        tracker: Tracker,
        params: dict[str, Any],
        warn: Callable[[str], None],
        timeout: float,
        max_rows: int = QUEUE_ROWS,
        marks: Path | None = None,
    ) -> None:
        self.tracker = tracker
        self.params = params
        self.warn = warn
        self.timeout = timeout
        self.max_rows = max_rows
        self.label = f"logger {tracker.name} at {tracker.where}"
        self.state_key = f"tracker:{tracker.name}"
        # Chosen here, not by the tracker: it is in the first checkpoint even when the tracker
        # (on its own thread) has not opened its run yet, so a resume always finds the same run.
        self.run_key = getattr(tracker, "attach", None) or uuid.uuid4().hex[:16]
        self.resumed = False
        self.marks = marks
        # A resumed run's rows at or below this step reached the tracker before the interruption:
        # set from the marks file (training thread, before the tracker's thread starts), then
        # raised by the tracker's own answer (that thread, before it delivers any row).
        self.sent_before: int | None = None
        self.not_resent = 0  # rows of retrained steps the tracker already had
        self._marked: int | None = None  # the step the marks file holds (the tracker's thread)
        self.switched_off = False
        self.dropped = 0  # rows refused because the queue was full
        self._unsent = 0  # rows queued or in flight
        self._ended = False  # the run's end (finish) reached the tracker
        self._busy_since: float | None = None  # when the call in flight began (time.monotonic)
        self._lock = threading.Lock()  # the counts and the switch, shared with the tracker's thread
        self._calls: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def connect(self) -> None:
        """The tracker's server answers within the bound, else a one-line error before training."""
        outcome: list[Exception | None] = []

        def reach() -> None:
            try:
                self.tracker.connect()
                outcome.append(None)
            except Exception as error:
                outcome.append(error)

        # A thread of its own: a server that never answers is left behind, not waited on.
        thread = threading.Thread(target=reach, name=f"leantrain-{self.tracker.name}-connect", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if not outcome:
            raise LeantrainError(
                f"{self.label} did not answer within {self.timeout:g} s and tracker_required is set; "
                "nothing was trained"
            )
        if (error := outcome[0]) is not None:
            raise LeantrainError(
                f"{self.label} cannot be reached and tracker_required is set ({type(error).__name__}: "
                f"{error}); nothing was trained"
            )

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > self.timeout:
            self._switch_off(
                f"{self.label} did not answer within {self.timeout:g} s and is switched off for this run; "
                "training goes on, metrics.csv has every value"
            )
        if self.switched_off:
            return
        with self._lock:
            if self._unsent >= self.max_rows:  # the tracker is behind by a full queue: memory stays bounded
                self.dropped += 1
                return
            self._unsent += 1
        row = dict(metrics)
        self._submit(lambda: self._deliver(step, row))

    def on_end(self, summary: dict[str, Any] | None) -> None:
        if not self.switched_off:
            self._submit(lambda: self._finish(summary))
        if self._thread is None:
            return
        self._calls.put(None)  # the thread ends once it gets there (a switched-off one skips the rest)
        if self.switched_off:
            return
        # The last rows and the summary reach the tracker before fit returns, unless it takes
        # longer than the bound: then fit returns without them and the daemon thread is abandoned.
        self._thread.join(self.timeout)
        with self._lock:
            unsent, ended = self.dropped + self._unsent, self._ended
        if unsent or not ended:
            self._switch_off(
                f"{self.label}: {self._undelivered(unsent, ended, summary)}; metrics.csv has every value"
            )

    def _undelivered(self, unsent: int, ended: bool, summary: dict[str, Any] | None) -> str:
        """What did not reach the tracker, and why: "12 rows and the summary were not delivered within 30 s"
        (``unsent`` counts the rows dropped, queued and in flight)."""
        what = [f"{unsent} row{'s' * (unsent != 1)}"] if unsent else []
        what += [] if ended else ["the summary" if summary is not None else "the end of its run"]
        singular = len(what) == 1 and unsent <= 1
        text = f"{' and '.join(what)} {'was' if singular else 'were'} not delivered"
        if self._thread is not None and self._thread.is_alive():
            text += f" within {self.timeout:g} s"
        if self.dropped:
            text += f" ({self.dropped} dropped from its full queue of {self.max_rows} rows)"
        return text

    def state_dict(self) -> dict[str, Any]:
        return {"run_key": self.run_key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A run the environment names wins over the checkpoint's (the user moved the run there).
        self.run_key = getattr(self.tracker, "attach", None) or state["run_key"]
        self.resumed = True
        if self.marks is not None:
            self.sent_before = read_mark(self.marks, self.run_key)

    def setup_lines(self) -> list[str]:
        """For the run's log: where the tracker logs, what chose it, and what a resume will not resend."""
        line = f"logger {self.tracker.name}: {getattr(self.tracker, 'describe', self.tracker.where)}"
        if self.resumed:
            line += "; continues its run"
            if self.sent_before is not None:
                line += (
                    f", which got the rows up to step {self.sent_before} before the interruption: "
                    "those steps, retrained, are not sent again"
                )
        return [line]

    def _submit(self, call: Callable[[], None]) -> None:
        if self._thread is None:
            self._calls.put(self._start)
            name = f"leantrain-{self.tracker.name}"
            # A daemon: a tracker stuck for good must not keep the process from exiting.
            self._thread = threading.Thread(target=self._work, name=name, daemon=True)
            self._thread.start()
        self._calls.put(call)

    def _start(self) -> None:
        held = self.tracker.start(self.params, self.run_key, self.resumed)
        if self.resumed and held is not None:  # the tracker's own record covers a marks file that lags it
            self.sent_before = held if self.sent_before is None else max(self.sent_before, held)

    def _deliver(self, step: int, row: dict[str, float]) -> None:
        if self.sent_before is not None and step <= self.sent_before:
            self.not_resent += 1  # a retrained step the tracker has: never twice, never backwards
        else:
            if self.marks is not None and step != self._marked:
                # Written before the call, so a kill during it leaves the file ahead, never behind.
                write_mark(self.marks, self.run_key, step)
                self._marked = step
            self.tracker.log(step, row)
        with self._lock:
            self._unsent -= 1

    def _finish(self, summary: dict[str, Any] | None) -> None:
        self.tracker.finish(summary)
        with self._lock:
            self._ended = True

    def _switch_off(self, message: str) -> None:
        """Warn once: whichever of the training thread and the tracker's thread gets here first."""
        with self._lock:
            if self.switched_off:
                return
            self.switched_off = True
        self.warn(message)

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            if self.switched_off:
                continue
            self._busy_since = time.monotonic()
            try:
                call()
            except Exception as error:  # a tracker's failure must never end the training
                self._switch_off(
                    f"{self.label} failed and is switched off for this run "
                    f"({type(error).__name__}: {error}); training goes on, metrics.csv has every value"
                )
            finally:
                self._busy_since = None


def read_mark(path: Path, run_key: str) -> int | None:
    """The last step handed to the tracker run ``run_key``, as ``path`` records it; None when the file
    is missing, unreadable, or about another run."""
    try:
        with path.open("rb") as file:
            mark = json.loads(file.read(4096))  # a few dozen bytes: more is not a marks file
        step = mark["step"] if mark.get("run") == run_key else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def write_mark(path: Path, run_key: str, step: int) -> None:
    """Record ``step`` as handed to the tracker run ``run_key``: replaced whole (a reader sees the old
    file or the new one), not fsynced (a killed process loses nothing; once per row, on the
    tracker's thread). A hidden temporary file, as the run folder's mirror skips them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"run": run_key, "step": step}) + "\n")
    os.replace(tmp, path)
