from __future__ import annotations

from itertools import chain

import numpy as np
import pytest

from leantrain.data.sampler import GlobalBatchSampler, steps_per_epoch
from leantrain.errors import LeantrainError
from leantrain.step.batching import BatchSplit


def flat(lists: list[list[int]]) -> list[int]:
    return list(chain.from_iterable(lists))


def step_sets(sampler: GlobalBatchSampler) -> list[list[int]]:
    """Group the yielded micro-batches back into optimizer steps."""
    micro = list(sampler)
    k = sampler.batch_split.accumulation_steps
    return [flat(micro[i : i + k]) for i in range(0, len(micro), k)]


def test_order_does_not_depend_on_the_micro_batch_split():
    steps = 12
    whole = step_sets(GlobalBatchSampler(100, BatchSplit(16, 16), steps, seed=3))
    for micro in (8, 4, 1):
        sampler = GlobalBatchSampler(100, BatchSplit(16, micro), steps, seed=3)
        assert len(sampler) == steps * (16 // micro)
        assert step_sets(sampler) == whole


def test_rank_shares_concatenate_to_the_global_batch():
    steps = 10
    single = step_sets(GlobalBatchSampler(90, BatchSplit(12, 3), steps, seed=1))
    shares = [
        step_sets(GlobalBatchSampler(90, BatchSplit(12, 3, world_size=2), steps, seed=1, rank=r))
        for r in (0, 1)
    ]
    assert [a + b for a, b in zip(*shares, strict=True)] == single


def test_each_epoch_is_a_permutation_drawn_from_seed_and_epoch():
    sampler = GlobalBatchSampler(50, BatchSplit(10, 5), total_steps=15, seed=7)
    steps = step_sets(sampler)
    for epoch in range(3):
        seen = flat(steps[epoch * 5 : (epoch + 1) * 5])
        assert sorted(seen) == list(range(50))
        expected = np.random.default_rng(np.random.SeedSequence([7, epoch])).permutation(50)
        assert seen == expected.tolist()
    assert steps[:5] != steps[5:10]  # a new order each epoch


def test_last_partial_global_batch_is_dropped():
    sampler = GlobalBatchSampler(25, BatchSplit(10, 10), total_steps=4, seed=0)
    steps = step_sets(sampler)
    assert steps_per_epoch(25, BatchSplit(10, 10)) == 2
    assert all(len(s) == 10 for s in steps)
    assert len(set(steps[0] + steps[1])) == 20  # 5 samples left out of epoch 0


def test_resuming_at_a_step_continues_the_same_sequence():
    full = list(GlobalBatchSampler(64, BatchSplit(8, 2), total_steps=20, seed=5))
    resumed = list(GlobalBatchSampler(64, BatchSplit(8, 2), total_steps=20, seed=5, start_step=11))
    assert resumed == full[11 * 4 :]


def test_no_shuffle_keeps_dataset_order():
    steps = step_sets(GlobalBatchSampler(20, BatchSplit(5, 5), total_steps=4, shuffle=False))
    assert flat(steps) == list(range(20))


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(LeantrainError, match="has 3 samples, fewer than one global batch"):
        GlobalBatchSampler(3, BatchSplit(4, 4), total_steps=1)


@pytest.mark.parametrize("start_step", [0, 3, 7, 9])
def test_length_is_what_a_resumed_sampler_yields(start_step):
    """The loader's length (progress bars, epoch ends) is the micro-batches left after a resume:
    none once the run is complete."""
    sampler = GlobalBatchSampler(100, BatchSplit(16, 4), 7, seed=2, start_step=start_step)
    assert len(sampler) == len(list(sampler)) == max(7 - start_step, 0) * 4
