"""The hang watchdog: a run that makes no progress ends itself and says where it is stuck."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from leantrain.config import TrainConfig
from leantrain.errors import ConfigError
from leantrain.run import watchdog as watchdog_module
from leantrain.run.watchdog import (
    HANG_EXIT_CODE,
    Heartbeat,
    Watchdog,
    describe,
    process_group_timeout,
    stuck_at,
)
from tests.conftest import python_path

LEANTRAIN = str(Path(sys.executable).parent / "leantrain")


def stuck(seconds: float) -> None:
    time.sleep(seconds)  # where the watchdog must find the training thread


def watch(tmp_path: Path, work, timeout: float = 0.3, paused=lambda: False) -> tuple[list[int], list[str]]:
    """Run ``work`` under a watchdog whose exit only records the code; (exit codes, lines said)."""
    codes: list[int] = []
    said: list[str] = []
    watchdog = Watchdog(
        timeout, Heartbeat(), tmp_path, 0, 1, None, said.append, exit=codes.append, paused=paused
    )
    with watchdog.watching():
        work(watchdog.heartbeat)
    return codes, said


def test_a_stalled_thread_is_reported_with_its_file_line_step_and_stacks(tmp_path):
    def work(heartbeat: Heartbeat) -> None:
        heartbeat.step = 6
        stuck(1.5)

    codes, said = watch(tmp_path, work)
    line = inspect.getsourcelines(stuck)[1] + 1
    assert codes == [HANG_EXIT_CODE]
    seconds = said[0].split()[3]
    assert said == [
        f"no progress for {seconds} s at step 7: stuck at {__file__}:{line} in stuck; every "
        f"rank's stacks are in {tmp_path / 'hang'}"
    ]
    assert (
        0 <= float(seconds) <= 60
    )  # the time since the last progress (1.5 s at most, on a busy machine more)
    stacks = (tmp_path / "hang" / "rank0.txt").read_text()
    header = stacks.splitlines()[0]
    assert re.fullmatch(r"rank 0: no progress for \d+\.\d s at step 7", header), header
    assert float(header.split()[5]) <= 60 and f'File "{__file__}", line {line} in stuck' in stacks


def test_progress_keeps_the_watchdog_quiet(tmp_path):
    def work(heartbeat: Heartbeat) -> None:
        for _ in heartbeat.counted(range(12)):  # 1.2 s in all, never 0.3 s without progress
            time.sleep(0.1)
        heartbeat.after(time.sleep)(0.1)

    codes, said = watch(tmp_path, work)
    assert (codes, said) == ([], [])
    assert not (tmp_path / "hang").exists()


def test_time_spent_compiling_is_not_a_hang(tmp_path):
    compiling = threading.Event()

    def work(heartbeat: Heartbeat) -> None:
        compiling.set()  # torch compiles for 1 s, far over the timeout, and says so
        stuck(1.0)
        compiling.clear()
        stuck(0.1)  # then trains on: the time since the compilation ended is what counts

    assert watch(tmp_path, work, paused=compiling.is_set) == ([], [])


def test_a_zero_timeout_starts_no_thread(tmp_path):
    before = threading.active_count()
    watchdog = Watchdog(0, Heartbeat(), tmp_path, 0, 1, None, print, exit=pytest.fail)
    with watchdog.watching():
        assert threading.active_count() == before
    assert process_group_timeout(0) is None
    assert process_group_timeout(30) == timedelta(
        seconds=30 + 120
    )  # docs/distributed.md: the watchdog speaks first


def test_stacks_that_cannot_be_written_are_one_line_and_the_report_goes_on(tmp_path, capsys):
    (tmp_path / "run").write_text("")  # the run folder is a file: hang/ cannot be made in it
    watchdog = Watchdog(1, Heartbeat(), tmp_path / "run", 0, 1, None, print, exit=pytest.fail)
    assert watchdog._write_stacks(2.0) == tmp_path / "run" / "hang" / "rank0.txt"
    error = capsys.readouterr().err
    assert error == f"leantrain: could not write {tmp_path / 'run' / 'hang' / 'rank0.txt'}: Not a directory\n"
    assert stuck_at(None) == "an unknown place (the thread has no Python frame)"


class Clock:
    """``time`` for the watchdog: ``sleep`` moves ``monotonic`` on, at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now = round(self.now + seconds, 9)


@pytest.mark.parametrize(("timeout", "waited"), [(0.1, 0.4), (1.0, 1.0), (9.0, 5.0)])
def test_a_rank_waits_for_the_others_reports_its_timeout_within_the_bounds(
    monkeypatch, tmp_path, timeout, waited
):
    """Looked for every 0.2 s, for the hang timeout, but at least and at most the bounds (here 0.4 and
    5 s): long enough for the others to write theirs, short enough for the run to end."""
    clock = Clock()
    monkeypatch.setattr(watchdog_module, "time", clock)
    monkeypatch.setattr(watchdog_module, "_GATHER_SECONDS", (0.4, 5.0))
    rank_1 = Watchdog(timeout, Heartbeat(), tmp_path, 1, 2, StoreOfTwo(), print, exit=pytest.fail)
    mine = {"count": 3, "where": "a.py:1 in f"}
    assert rank_1._gather(mine) == {0: None, 1: mine}  # rank 0 never reported
    assert clock.now == waited


class StoreOfTwo:
    """The process group's store as the watchdog uses it (set, check, get), shared by two ranks."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def test_when_rank_0_cannot_report_the_next_rank_says_it(tmp_path, monkeypatch):
    """Rank 0's Python is stuck (it never reports): rank 1 is the lowest rank that reported, so it
    prints the line, naming rank 0 as the one that did not report."""
    monkeypatch.setattr(watchdog_module, "_GATHER_SECONDS", (0.2, 0.2))
    said: list[str] = []
    heartbeat = Heartbeat()
    heartbeat.last -= 10
    rank_1 = Watchdog(1, heartbeat, tmp_path, 1, 2, StoreOfTwo(), said.append, exit=lambda code: None)
    rank_1._report()
    assert len(said) == 1 and "rank 0 did not report" in said[0]


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        (
            {0: {"count": 9, "where": "a.py:1 in f"}, 1: {"count": 8, "where": "b.py:2 in g"}},
            "rank 1 did not arrive; rank 1 at b.py:2 in g; rank 0 waits at a.py:1 in f",
        ),
        (
            {0: {"count": 9, "where": "a.py:1 in f"}, 1: None},
            "rank 1 did not report (its Python does not run: stuck in native code?); "
            "rank 0 waits at a.py:1 in f",
        ),
        (
            {0: {"count": 9, "where": "a.py:1 in f"}, 1: {"count": 9, "where": "b.py:2 in g"}},
            "ranks 0, 1 all wait, none behind the others; rank 0 at a.py:1 in f; rank 1 at b.py:2 in g",
        ),
    ],
    ids=["behind", "silent", "deadlock"],
)
def test_the_report_names_the_rank_behind_the_others(reports, expected):
    assert describe(reports, 2) == expected


def test_a_negative_timeout_is_a_one_line_error():
    with pytest.raises(
        ConfigError, match=r"hang_timeout=-1: must be 0 \(off\) or a positive number of seconds"
    ):
        TrainConfig(hang_timeout=-1)


def test_a_hung_fit_ends_by_itself_with_exit_code_75(tmp_path):
    """Through the CLI: the process really ends (the training thread never returns)."""
    task = tmp_path / "hangs.py"
    task.write_text(
        "import time\nfrom tests.conftest import RegressionTask\n\n"
        "class Hangs(RegressionTask):\n"
        "    def loss(self, model, batch):\n"
        "        time.sleep(3600)\n"
    )
    started = time.monotonic()
    done = subprocess.run(
        [LEANTRAIN, "fit", "--task", "hangs:Hangs", "--hang-timeout", "1", "--out", str(tmp_path / "run"),
         "--progress", "none", "--logger", "none"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": python_path(tmp_path, Path(__file__).parent.parent)},
    )  # fmt: skip
    assert done.returncode == HANG_EXIT_CODE, done.stderr
    assert time.monotonic() - started < 60
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("leantrain: error: no progress for ") and " s at step 1: stuck at " in last
    assert last.endswith(f"hangs.py:6 in loss; every rank's stacks are in {tmp_path / 'run' / 'hang'}")
