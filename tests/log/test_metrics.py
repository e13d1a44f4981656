from __future__ import annotations

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


def test_adding_keeps_no_graph():
    weight = torch.ones(1, requires_grad=True)
    tracker = LossTracker()
    loss = (weight * 2).sum()
    tracker.add(0, loss.detach(), 1, True)
    assert all(not t.requires_grad for t in tracker._totals)
