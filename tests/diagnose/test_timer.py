"""PhaseTimer: phases add up to the step, disabled stretches are not recorded."""

from __future__ import annotations

import time

import pytest

from leantrain.diagnose import PHASES, PhaseTimer


def test_phases_and_other_add_up_to_the_step() -> None:
    timer = PhaseTimer("cpu")
    timer.restart_step()
    for _ in range(3):
        with timer.phase("forward"):
            time.sleep(0.002)
        with timer.phase("data", host=True):
            time.sleep(0.001)
        timer.add_seconds("h2d", 0.0005)
        time.sleep(0.001)  # covered by no phase: "other"
        timer.end_step()
    steps = timer.steps()
    assert len(steps) == 3
    for row in steps:
        assert sum(row[p] for p in PHASES) == pytest.approx(row["total"])
        # the 1 ms outside every phase, less the 0.5 ms said to be h2d
        assert row["forward"] >= 0.002 and row["data"] >= 0.001 and row["other"] >= 0.0005
        assert row["h2d"] == 0.0005
    mean = timer.mean()
    assert mean["total"] == pytest.approx(sum(r["total"] for r in steps) / 3)


def test_disabled_steps_are_not_recorded() -> None:
    timer = PhaseTimer()
    timer.enabled = False
    with timer.phase("forward"):
        pass
    timer.end_step()
    assert timer.steps() == [] and timer.mean()["total"] == 0.0
    timer.enabled = True
    timer.add_seconds("optimizer", 0.25)
    timer.end_step()
    assert [row["optimizer"] for row in timer.steps()] == [0.25]


def test_a_phase_that_raises_is_still_timed() -> None:
    timer = PhaseTimer()
    with pytest.raises(ValueError), timer.phase("backward"):
        raise ValueError("boom")
    timer.end_step()
    assert timer.steps()[0]["backward"] > 0
