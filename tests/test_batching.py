"""Accumulation exactness: the global batch defines the math, whatever the split."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from leantrain.runtime import seed_everything
from leantrain.step.batching import BatchSplit
from tests.conftest import RegressionTask

STEPS = 20
GLOBAL = 16


def reference_parameters(task: RegressionTask, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """A plain full-batch loop, written from the documented contract, not from leantrain's code.

    Order: epoch e is the permutation drawn by numpy from SeedSequence([seed, e]); step s
    takes the next GLOBAL indices; a last partial batch is dropped. Loss: the mean over
    the batch, or for a LossSum the summed loss over the summed count.
    """
    seed_everything(seed)
    model = task.model()
    optimizer = task.optimizer(model.parameters())
    per_epoch = len(task.x) // GLOBAL
    for step in range(steps):
        epoch, position = divmod(step, per_epoch)
        order = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(len(task.x))
        index = torch.from_numpy(order[position * GLOBAL : (position + 1) * GLOBAL])
        loss = task.loss(model, (task.x[index], task.y[index], task.mask[index]))
        if isinstance(loss, tuple):
            loss = loss.sum / loss.count
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.cpu() - y.cpu()).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("loss_kind", ["mean", "sum"])
def test_micro_batch_split_does_not_change_the_parameters(fit, loss_kind):
    reference = reference_parameters(RegressionTask(loss_kind=loss_kind), STEPS)
    results = {}
    for micro in (16, 4, 1):
        result = fit(
            RegressionTask(loss_kind=loss_kind),
            global_batch_size=GLOBAL,
            micro_batch_size=micro,
            max_steps=STEPS,
        )
        assert result.accumulation_steps == GLOBAL // micro
        results[micro] = [p.detach() for p in result.model.parameters()]
    for micro, params in results.items():
        assert max_difference(params, reference) <= 1e-10, f"micro {micro} differs from the full-batch loop"
    # the runs did train: parameters moved away from their initial values
    seed_everything(0)
    initial = [p.detach() for p in RegressionTask(loss_kind=loss_kind).model().parameters()]
    assert max_difference(results[16], initial) > 1e-2


def test_loss_sum_is_not_a_mean_of_micro_batch_means(fit):
    """With uneven counts, averaging per-micro-batch means would differ from the exact loss."""
    task = RegressionTask(loss_kind="sum")
    exact = fit(task, global_batch_size=GLOBAL, micro_batch_size=4, max_steps=1)
    seed_everything(0)
    model = task.model()
    optimizer = task.optimizer(model.parameters())
    order = np.random.default_rng(np.random.SeedSequence([0, 0])).permutation(len(task.x))[:GLOBAL]
    for chunk in np.split(order, 4):  # the naive way: mean per micro-batch, averaged
        index = torch.from_numpy(chunk)
        part = task.loss(model, (task.x[index], task.y[index], task.mask[index]))
        ((part.sum / part.count) / 4).backward()
    optimizer.step()
    naive = [p.detach() for p in model.parameters()]
    assert max_difference([p.detach() for p in exact.model.parameters()], naive) > 1e-6


def test_batch_split_derives_accumulation():
    plan = BatchSplit(global_batch_size=64, micro_batch_size=4, world_size=2)
    assert plan.per_rank_batch_size == 32
    assert plan.accumulation_steps == 8
    with pytest.raises(ValueError, match="inconsistent"):
        BatchSplit(global_batch_size=64, micro_batch_size=5)


def test_final_train_loss_is_the_last_global_batch_loss(fit):
    task = RegressionTask(loss_kind="sum")
    split = fit(task, global_batch_size=GLOBAL, micro_batch_size=2, max_steps=3)
    whole = fit(RegressionTask(loss_kind="sum"), global_batch_size=GLOBAL, max_steps=3)
    assert split.final_train_loss == pytest.approx(whole.final_train_loss, rel=1e-12)


class KeepsNothing(RegressionTask):
    """Each loss makes a leaf tensor of its own; it must be gone before the next micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []
        self.alive_at_each_call: list[int] = []

    def loss(self, model, batch):
        self.alive_at_each_call.append(sum(ref() is not None for ref in self.made))
        held = torch.ones(len(batch[0]), 8, requires_grad=True)
        self.made.append(weakref.ref(held))
        return super().loss(model, batch) + 0 * (held * 2).sum()


@pytest.mark.parametrize("strategy", ["single", "split"])
def test_nothing_of_a_micro_batch_outlives_its_backward(fit, strategy):
    """A graph kept to the end of the step would hold every micro-batch's tensors at once: memory
    that grows with the accumulation steps (a real CUDA budget then fails at micro-batch 1)."""
    task = KeepsNothing()
    fields = {"device_map": "cpu,cpu"} if strategy == "split" else {}
    fit(task, global_batch_size=16, micro_batch_size=4, max_steps=2, strategy=strategy, **fields)
    assert len(task.alive_at_each_call) == 8 and set(task.alive_at_each_call) == {0}
