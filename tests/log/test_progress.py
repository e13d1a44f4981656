from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys

from rich.console import Console

from leantrain.log.progress import NoProgress, PlainProgress, RichProgress, make_progress


def test_auto_is_plain_when_stdout_is_not_a_terminal(capsys):
    progress = make_progress("auto", total_steps=10)
    assert isinstance(progress, PlainProgress)
    progress.update(5, loss=0.25, samples_per_second=1234.0, eta_seconds=65)
    assert capsys.readouterr().out == "step 5/10  loss 0.2500  1,234 samples/s  eta 0:01:05\n"


def without_colours(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_rich_bar_shows_loss_speed_and_progress():
    screen = io.StringIO()
    progress = RichProgress(total_steps=10, console=Console(file=screen, force_terminal=True, width=120))
    progress._progress.refresh()  # before the first log point: a dash for each value
    first = without_colours(screen.getvalue())
    # the label, the bar, steps done of all, the loss and speed not known yet, the time left not yet known
    assert re.search(r"\btrain ━+ +0/10 loss - - samples/s -:--:--", first), first
    progress.update(5, loss=0.25, samples_per_second=1234.0, eta_seconds=65)
    progress.message("saved a checkpoint")
    progress.close()
    shown = without_colours(screen.getvalue())[len(first) :]
    assert re.search(r" +5/10 loss 0\.2500 1,234 samples/s ", shown), shown
    assert "saved a checkpoint" in shown


def test_plain_lines_reach_a_pipe_as_they_are_written():
    """A run piped into a log file or `tee` shows each line when it happens, not when the run ends."""
    code = (
        "import sys; from leantrain.log.progress import PlainProgress; p = PlainProgress(3); "
        "p.update(1, 0.5, 10.0, 1.0); p.message('saved'); sys.stdin.read()"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe: Python buffers
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        shown = b""
        while shown.count(b"\n") < 2:  # the process waits on its stdin meanwhile: only a flushed line arrives
            assert select.select([child.stdout], [], [], 120)[0], f"only {shown!r} reached the pipe"
            shown += os.read(child.stdout.fileno(), 4096)
        assert shown == b"step 1/3  loss 0.5000  10 samples/s  eta 0:00:01\nsaved\n"
    finally:
        child.stdin.close()
        child.wait(timeout=120)


def test_none_prints_nothing(capsys):
    progress = make_progress("none", total_steps=3)
    assert isinstance(progress, NoProgress)
    progress.update(1, 1.0, 1.0, 1.0)
    progress.message("hello")
    assert capsys.readouterr().out == ""
