"""The doctor's clock of tensor parallelism's collectives: what it wraps while entered, what it puts back,
and where each collective's time goes (out of the phase that issued it, into ``communication``)."""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol

from leantrain.diagnose.collectives import WRAPPED, CollectiveClock


class Timer:
    """PhaseTimer's part the clock uses: marks 0, 1, 2, ... and the intervals added."""

    def __init__(self) -> None:
        self.enabled, self.marks, self.intervals = True, 0, []

    def mark(self) -> int:
        self.marks += 1
        return self.marks - 1

    def add_interval(self, phase: str, start: int, end: int) -> None:
        self.intervals.append((phase, start, end))


class Pending:
    """An AsyncCollectiveTensor's part: the result comes from ``wait()``."""

    def __init__(self, value: object) -> None:
        self.value = value

    def wait(self) -> object:
        return ("waited", self.value)


def test_the_collectives_are_wrapped_while_entered_and_put_back_after(monkeypatch):
    originals = {name: getattr(funcol, name) for name in WRAPPED}
    monkeypatch.delattr(funcol, "all_to_all_single")  # a torch without one: skipped, not made
    with CollectiveClock(Timer()):
        assert all(getattr(funcol, name) is not originals[name] for name in WRAPPED[:-1])
        assert not hasattr(funcol, "all_to_all_single")
    assert all(getattr(funcol, name) is originals[name] for name in WRAPPED[:-1])
    assert not hasattr(funcol, "all_to_all_single")


def test_each_collective_is_waited_for_and_its_time_moved_out_of_its_phase(monkeypatch):
    monkeypatch.setattr(funcol, "all_reduce", lambda tensor, *args: Pending(tensor))
    monkeypatch.setattr(funcol, "all_gather_tensor", lambda tensor, *args: ("done", tensor))
    timer = Timer()
    clock = CollectiveClock(timer)
    with clock:
        assert funcol.all_reduce(3, "sum", None) == ("waited", 3)  # marks 0 and 1
        clock.phase = "backward"
        assert funcol.all_gather_tensor(4, 0, None) == ("done", 4)  # not pending: as it is; marks 2, 3
        timer.enabled = False  # a warm-up step: nothing recorded, nothing counted
        assert funcol.all_reduce(5, "sum", None) == ("waited", 5)
    assert clock.count == 2
    assert timer.intervals == [("communication", 0, 1), ("communication", 2, 3), ("backward", 3, 2)]
