"""Streams and map-style data: every sample once per epoch, the same order whatever the split."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import leantrain as lt
from leantrain.data.loader import build_loader
from leantrain.data.sampler import GlobalBatchSampler
from leantrain.data.shard import GlobalBatchShard, StreamPlan
from leantrain.data.stream import RankShard
from leantrain.errors import DataError
from leantrain.step.batching import BatchSplit
from tests.conftest import RegressionTask, StreamedRegression


class Numbers(IterableDataset):
    """Yields (sample id, epoch); ``set_epoch`` picks the epoch. Optionally sized."""

    def __init__(self, count: int, sized: bool = True, fail_at: int | None = None) -> None:
        self.count, self.sized, self.fail_at = count, sized, fail_at
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in range(self.count):
            if i == self.fail_at:
                raise ValueError("corrupt record")
            yield torch.tensor(i), torch.tensor(self.epoch)

    def __len__(self):
        if not self.sized:
            raise TypeError("unsized")
        return self.count


def stream_batches(dataset, plan, steps, rank, workers, start_step=0):
    shard = GlobalBatchShard(
        StreamPlan(dataset, "train_data", plan.global_batch_size), "train_data", plan, steps, rank, start_step
    )
    return every_batch(DataLoader(shard, batch_size=None, num_workers=workers))


def every_batch(loader: DataLoader) -> list:
    """Every batch ``loader`` gives, its workers stopped at once even when a read fails: otherwise the
    failure's traceback keeps them until the collector stops them, 5 s each, in a later test (see
    leantrain.data.loader.stop_workers)."""
    batches = iter(loader)
    try:
        return list(batches)
    finally:
        getattr(batches, "_shutdown_workers", lambda: None)()  # absent without workers


def map_batches(size, plan, steps, rank, workers, start_step=0):
    ids = torch.arange(size)
    sampler = GlobalBatchSampler(size, plan, steps, shuffle=False, rank=rank, start_step=start_step)
    return list(build_loader(TensorDataset(ids), "train_data", batch_sampler=sampler, num_workers=workers))


@pytest.mark.parametrize("kind", ["stream", "map"])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ranks", [1, 2])
def test_every_sample_is_seen_once_per_epoch_whatever_the_split(kind, workers, ranks):
    size, steps = 48, 6  # 2 epochs of 3 global batches of 16
    plan = BatchSplit(global_batch_size=16, micro_batch_size=4, world_size=ranks)
    seen: list[int] = []
    for rank in range(ranks):
        if kind == "stream":
            batches = stream_batches(Numbers(size), plan, steps, rank, workers)
            assert [int(e) for _, epochs in batches for e in epochs] == [0] * (size // ranks) + [1] * (
                size // ranks
            )
        else:
            batches = map_batches(size, plan, steps, rank, workers)
        assert len(batches) == steps * plan.accumulation_steps
        seen += [int(i) for batch in batches for i in batch[0]]
    assert sorted(seen) == sorted(list(range(size)) * 2)  # each sample once per epoch, none lost


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_gives_the_same_micro_batches_as_map_style_data(workers):
    plan = BatchSplit(global_batch_size=16, micro_batch_size=4, world_size=2)
    for rank in range(2):
        stream = [b[0].tolist() for b in stream_batches(Numbers(48), plan, 6, rank, workers)]
        mapped = [b[0].tolist() for b in map_batches(48, plan, 6, rank, 0)]
        assert stream == mapped


@pytest.mark.parametrize("sized", [True, False])
def test_a_stream_resumes_at_its_step_with_or_without_a_length(sized):
    plan = BatchSplit(global_batch_size=8, micro_batch_size=4)
    whole = [b[0].tolist() for b in stream_batches(Numbers(40, sized), plan, 12, 0, 0)]
    resumed = [b[0].tolist() for b in stream_batches(Numbers(40, sized), plan, 12, 0, 0, start_step=7)]
    assert resumed == whole[7 * 2 :]


class Noisy(IterableDataset):
    """Yields (sample id, the numbers drawn for it from torch's, Python's and NumPy's generators while the
    stream is read): a random augmentation in a stream."""

    def __len__(self) -> int:
        return 40  # 5 steps of 8 an epoch: the 12 steps below read every item 2 or 3 times

    def __iter__(self):
        for i in range(40):
            drawn = [torch.rand(()).item(), random.random(), np.random.random()]
            yield torch.tensor(i), torch.tensor(drawn, dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
def test_what_a_stream_draws_while_read_is_the_same_whatever_the_split_and_after_a_resume(workers):
    """Every worker of every rank reads the stream whole, each from generators of its own: the bug,
    the numbers drawn for an item depended on which worker read it, how many there were, and where
    a run resumed."""
    alone = BatchSplit(global_batch_size=8, micro_batch_size=2)
    whole = stream_batches(Noisy(), alone, 12, 0, 0)
    assert len({float(x) for _, drawn in whole for x in drawn.flatten()}) == 3 * 12 * 8  # all different
    split = BatchSplit(global_batch_size=8, micro_batch_size=2, world_size=2)
    ranks = [stream_batches(Noisy(), split, 12, rank, workers) for rank in range(2)]
    for step in range(12):  # rank 0's 2 micro-batches of the step, then rank 1's
        mine = [b for rank in ranks for b in rank[2 * step : 2 * step + 2]]
        assert all(torch.equal(a[1], b[1]) for a, b in zip(mine, whole[4 * step : 4 * step + 4], strict=True))
    resumed = stream_batches(Noisy(), alone, 12, 0, workers, start_step=7)  # in the second epoch
    assert all(torch.equal(a[1], b[1]) for a, b in zip(resumed, whole[7 * 4 :], strict=True))
    assert len(resumed) == 5 * 4


def test_a_steps_reading_is_seeded_by_the_run_the_step_and_the_source():
    """Two sources of a mixture read at the same step draw numbers of their own, another seed draws
    others, and none are the numbers of the training's generators reseeded after a change of world size
    (run/world_change.py seeds them from the run's seed, a rank and a step)."""
    from leantrain.data.stream import StreamReader
    from leantrain.runtime import derived_seed, host_rng_seeded

    plan = BatchSplit(global_batch_size=4, micro_batch_size=4)

    def read(seed: int) -> list[torch.Tensor]:
        shard = GlobalBatchShard(StreamPlan(Noisy(), "train_data", 4), "train_data", plan, 1, seed=seed)
        readers = [StreamReader(Noisy(), "web"), StreamReader(Noisy(), "code")]
        taken = shard._read_step(0, readers, [4, 4], [set(range(4)), set(range(4))])
        return [torch.stack([item[1] for _, (_, item) in sorted(got.items())]) for got in taken]

    web, code = read(0)
    assert torch.equal(read(0)[0], web) and not torch.equal(web, code)
    assert not torch.equal(read(1)[0], web)
    with host_rng_seeded(derived_seed(0, 0, 0)):  # rank 0 resumed at step 0 on another world size
        assert torch.rand(()).item() not in web[:, 0].tolist()


class NoisyItems(Dataset):
    """Map-style: (sample id, the numbers drawn for it from torch's, Python's and NumPy's generators)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        drawn = [torch.rand(()).item(), random.random(), np.random.random()]
        return torch.tensor(index), torch.tensor(drawn, dtype=torch.float64)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_item_read_again_in_a_later_epoch_draws_new_numbers(workers):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/20412 (Lightning: with
    ``seed_everything(workers=True)`` the loader applied exactly the same augmentations every epoch)
    and https://github.com/pytorch/pytorch/issues/41329 (a stream's NumPy draws repeated every epoch in
    every worker). Here every item of 3 epochs, map-style and stream, draws numbers of its own."""
    plan = BatchSplit(global_batch_size=8, micro_batch_size=2)
    sampler = GlobalBatchSampler(16, plan, 6, shuffle=False)  # 3 epochs of 2 steps
    mapped = list(build_loader(NoisyItems(), "train_data", batch_sampler=sampler, num_workers=workers))
    streamed = stream_batches(Noisy(), plan, 15, 0, workers)  # 3 epochs of 5 steps
    for batches, items in ((mapped, 16 * 3), (streamed, 40 * 3)):
        assert sorted(int(i) for ids, _ in batches for i in ids) == sorted(list(range(items // 3)) * 3)
        drawn = [float(x) for _, numbers in batches for x in numbers.flatten()]
        assert len(drawn) == len(set(drawn)) == 3 * items


def test_a_last_partial_global_batch_is_dropped_as_for_map_style_data():
    plan = BatchSplit(global_batch_size=8, micro_batch_size=4)
    batches = stream_batches(Numbers(20), plan, 4, 0, 0)  # 2 whole global batches per epoch, 4 left over
    assert [b[0].tolist() for b in batches][4] == [0, 1, 2, 3]  # epoch 1 starts after sample 15


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_stream_names_the_item_and_the_epoch(workers):
    plan = BatchSplit(global_batch_size=8, micro_batch_size=4)
    with pytest.raises(
        lt.DataError, match="train_data item 13 of epoch 0 failed: ValueError: corrupt record"
    ):
        stream_batches(Numbers(40, fail_at=13), plan, 4, 0, workers)


def test_a_stream_shorter_than_a_global_batch_is_an_error():
    with pytest.raises(lt.DataError, match="fewer items than one global batch"):
        stream_batches(Numbers(5), BatchSplit(global_batch_size=8, micro_batch_size=4), 2, 0, 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_validation_shards_split_a_stream_between_ranks(workers):
    for rank in range(2):  # every other item, from the rank's own
        loader = DataLoader(RankShard(Numbers(30), "val_data", rank, 2), batch_size=4, num_workers=workers)
        assert sorted(int(i) for batch in loader for i in batch[0]) == list(range(rank, 30, 2))


def test_one_process_validates_the_whole_stream_and_a_failing_item_names_it():
    assert [int(item[0]) for item in RankShard(Numbers(5), "val_data")] == [0, 1, 2, 3, 4]
    with pytest.raises(lt.DataError, match=r"^val_data item 3 of epoch 0 failed"):
        list(RankShard(Numbers(5, fail_at=3), "val_data"))


@pytest.mark.parametrize(("sized", "workers"), [(True, 0), (False, 2)])
def test_training_on_a_stream_equals_training_on_the_same_data_unshuffled(fit, sized, workers):
    settings = dict(global_batch_size=16, micro_batch_size=8, max_steps=14)
    reference = fit(RegressionTask(), shuffle=False, **settings)
    streamed = fit(StreamedRegression(sized), num_workers=workers, **settings)
    for name, value in reference.model.state_dict().items():
        assert torch.equal(streamed.model.state_dict()[name], value), name


def test_an_unsized_stream_needs_max_steps(fit):
    with pytest.raises(lt.TaskError, match="IterableDataset without __len__: set max_steps"):
        fit(StreamedRegression(sized=False), global_batch_size=16)


def test_a_mixtures_source_goes_on_into_its_next_epoch_and_an_empty_one_is_named():
    """A source without whole groups (a mixture's) reads on past the end of an epoch, however few items
    the epoch had (one here); an epoch with none is an error naming the source and the epoch."""
    from leantrain.data.stream import StreamReader

    class Few(IterableDataset):
        def __init__(self, count: int) -> None:
            self.count = count

        def __iter__(self):
            return iter(range(self.count))

    one = StreamReader(Few(1), "web")
    assert [item for _, item in one.take(3, range(3)).values()] == [0, 0, 0]  # epochs 0, 1 and 2
    assert one.position()["epoch"] == 2
    with pytest.raises(DataError) as error:
        StreamReader(Few(0), "code").take(1, ())
    assert str(error.value) == "code yielded no item in epoch 0"
