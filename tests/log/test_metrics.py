from __future__ import annotations

import gc
import io
import math
import random
import weakref

import torch

from leantrain.step.losses import LossTracker


def test_mean_losses_are_weighted_by_samples():
    tracker = LossTracker()
    tracker.add(0, torch.tensor(1.0), 2, True)
    tracker.add(0, torch.tensor(4.0), 2, True)
    tracker.add(1, torch.tensor(10.0), 4, True)
    window = tracker.read()
    assert window.mean_loss == (1 * 2 + 4 * 2 + 10 * 4) / 8
    assert window.last_step_loss == 10.0
    assert tracker.read() is None  # cleared


def test_loss_sums_divide_by_their_total_count():
    tracker = LossTracker()
    tracker.add(3, torch.tensor(6.0), torch.tensor(3), False)
    tracker.add(3, torch.tensor(2.0), 1, False)
    window = tracker.read()
    assert window.mean_loss == 2.0 and window.last_step_loss == 2.0


def test_a_discarded_step_leaves_the_window():
    tracker = LossTracker()
    tracker.add(4, torch.tensor(1.0), 1, True)
    tracker.add(5, torch.tensor(float("nan")), 1, True)
    tracker.add(5, torch.tensor(float("inf")), 1, True)
    tracker.discard_step(5)
    tracker.discard_step(9)  # nothing of step 9: nothing changes
    window = tracker.read()
    assert window.mean_loss == 1.0 and window.last_step_loss == 1.0


def random_window(seed: int, entries: int) -> list[tuple[int, torch.Tensor, torch.Tensor | int, bool]]:
    """Entries of a mixed window: float32 means over int sample counts, LossSums with int or tensor counts."""
    rng = random.Random(seed)
    window = []
    for i in range(entries):
        step = i // 3
        if rng.random() < 0.5:
            window.append((step, torch.tensor(rng.uniform(0, 5)), rng.randint(1, 64), True))
        else:
            count = rng.randint(1, 900)
            weight = torch.tensor(count) if rng.random() < 0.5 else count
            window.append((step, torch.tensor(rng.uniform(0, 5) * count, dtype=torch.float64), weight, False))
    return window


def closed_form(window) -> tuple[float, float]:
    """The window's mean and its last step's, summed exactly on the host (no torch reduction)."""

    def mean(entries) -> float:
        sums = [float(t) * int(w) if is_mean else float(t) for _, t, w, is_mean in entries]
        return math.fsum(sums) / math.fsum(int(weight) for _, _, weight, _ in entries)

    last_step = window[-1][0]
    return mean(window), mean([entry for entry in window if entry[0] == last_step])


def test_a_long_mixed_window_is_the_weighted_mean_of_every_entry():
    window = random_window(seed=0, entries=200)  # more entries than the buffers first hold
    tracker = LossTracker()
    for entry in window:
        tracker.add(*entry)
    read = tracker.read()
    expected_mean, expected_last = closed_form(window)
    assert math.isclose(read.mean_loss, expected_mean, rel_tol=1e-12)
    assert math.isclose(read.last_step_loss, expected_last, rel_tol=1e-12)


def test_a_saved_window_reads_the_same_after_loading():
    window = random_window(seed=1, entries=90)
    kept, restored = LossTracker(), LossTracker()
    for entry in window:
        kept.add(*entry)
    buffer = io.BytesIO()
    torch.save(kept.state_dict(), buffer)  # as a checkpoint holds it
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer), torch.device("cpu"))
    for tracker in (kept, restored):  # the first step after the resume, dropped as non-finite
        tracker.add(99, torch.tensor(float("nan")), 7, True)
        tracker.discard_step(99)
    assert restored.read() == kept.read()


def test_the_tracker_keeps_no_tensor_it_was_given():
    """A tensor per micro-batch kept until the log point fragments the host heap: the process's
    memory climbs between log points (benchmarks/results/memory.md)."""
    weight = torch.ones(3, requires_grad=True)
    tracker = LossTracker()
    given = []
    for step in range(5):
        loss = (weight * step).sum()  # with its graph, as a careless caller might hand it over
        count = torch.tensor(3)
        given += [weakref.ref(loss), weakref.ref(count)]
        tracker.add(step, loss, count, False)
        del loss, count
    gc.collect()
    assert all(ref() is None for ref in given)
    assert not tracker.state_dict()["totals"].requires_grad  # the buffers joined no graph
    assert tracker.read().mean_loss == sum(3 * step for step in range(5)) / 15


def live_tensors() -> int:
    return sum(type(o) is torch.Tensor for o in gc.get_objects())


def test_nothing_of_a_micro_batch_outlives_its_step_between_log_points(fit):
    from tests.conftest import ReadEachStep, RegressionTask

    live = ReadEachStep(live_tensors, steps={3, 28})
    fit(
        RegressionTask(),
        callbacks=[live],
        global_batch_size=16,
        micro_batch_size=4,
        max_steps=30,
        log_every_n_steps=50,
    )
    assert live.values[28] == live.values[3], live.values
