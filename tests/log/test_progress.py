from __future__ import annotations

import io

from rich.console import Console

from leantrain.log.progress import NoProgress, PlainProgress, RichProgress, make_progress


def test_auto_is_plain_when_stdout_is_not_a_terminal(capsys):
    progress = make_progress("auto", total_steps=10)
    assert isinstance(progress, PlainProgress)
    progress.update(5, loss=0.25, samples_per_second=1234.0, eta_seconds=65)
    assert capsys.readouterr().out == "step 5/10  loss 0.2500  1,234 samples/s  eta 0:01:05\n"


def test_rich_bar_shows_loss_speed_and_progress():
    screen = io.StringIO()
    progress = RichProgress(total_steps=10, console=Console(file=screen, force_terminal=True, width=120))
    progress.update(5, loss=0.25, samples_per_second=1234.0, eta_seconds=65)
    progress.close()
    shown = screen.getvalue()
    assert "5/10" in shown and "loss 0.2500" in shown and "1,234 samples/s" in shown


def test_none_prints_nothing(capsys):
    progress = make_progress("none", total_steps=3)
    assert isinstance(progress, NoProgress)
    progress.update(1, 1.0, 1.0, 1.0)
    progress.message("hello")
    assert capsys.readouterr().out == ""
