"""Streams resume where they stopped: from their saved state, not by re-reading what was trained on."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import IterableDataset

import leantrain as lt
from leantrain.data.shard import DataPosition, GlobalBatchShard, MarkedLoader, StreamPlan
from leantrain.step.batching import BatchSplit
from tests.conftest import RegressionTask, quiet_config
from tests.test_resume import StopAt

SIZE = 1_000_000


class Counted(IterableDataset):
    """Items 0..count-1, counting the items it produces; ``state_dict`` (Stateful) unless ``stateless``."""

    def __init__(self, count: int, stateless: bool = False) -> None:
        self.count, self.start, self.next, self.produced = count, 0, 0, 0
        if stateless:
            self.state_dict = None  # not callable: no fast resume

    def __iter__(self):
        self.next, self.start = self.start, 0
        while self.next < self.count:
            self.produced += 1
            self.next += 1
            yield (self.next - 1,)

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.start = state["next"]


def shard_batches(stream, split, total, start=0, saved=None, rank=0):
    """This rank's micro-batches of steps start..total-1, and the loader's DataPosition."""
    plan = StreamPlan(stream, "train_data", split.global_batch_size)
    shard = GlobalBatchShard(plan, "train_data", split, total, rank, start, saved, marks=True)
    loader = MarkedLoader(shard, DataPosition(plan.names, start, saved or [None], [0]))
    return [batch[0].tolist() for batch in loader], loader.position


@pytest.mark.parametrize(("stateless", "size"), [(False, SIZE), (True, 1_000)])
def test_a_stream_of_a_million_items_killed_at_step_900_resumes_without_rereading(stateless, size):
    """The fallback (a stream without state) on a small stream: it re-reads what the other skips."""
    split = BatchSplit(
        global_batch_size=1024 if size == SIZE else 1, micro_batch_size=512 if size == SIZE else 1
    )
    first = Counted(size, stateless)
    _, position = shard_batches(first, split, 900)
    saved = position.after(900)
    again = Counted(size, stateless)
    started = time.perf_counter()
    resumed, _ = shard_batches(again, split, 901, start=900, saved=saved)
    print(f"resume at step 900: {time.perf_counter() - started:.3f} s, {again.produced:,} items read")
    batch, micro = split.global_batch_size, split.micro_batch_size
    assert resumed == [
        list(range(900 * batch + i * micro, 900 * batch + (i + 1) * micro)) for i in range(batch // micro)
    ]
    # the fallback re-reads the epoch up to the position; a Stateful stream reads the step's own items
    assert again.produced == (901 * batch if stateless else batch)


class SizedCounted(Counted):
    def __len__(self) -> int:
        return self.count


def test_what_a_stream_reads_again_to_reach_its_position():
    """From a saved snapshot: nothing, when the stream restores its state; else the items read in the
    saved epoch. With no saved position: the items of the current epoch, or all of them unsized."""
    from leantrain.data.stream import StreamReader

    stateful, stateless = StreamReader(Counted(10), "d"), StreamReader(Counted(10, stateless=True), "d")
    snapshot, none = (
        {"epoch": 2, "read": 7, "snapshot": {"next": 7}},
        {"epoch": 2, "read": 7, "snapshot": None},
    )
    assert stateful.rereads(27, snapshot) == 0
    assert stateless.rereads(27, snapshot) == 7 and stateful.rereads(27, none) == 7
    assert StreamReader(SizedCounted(10), "d").rereads(27, None) == 7  # into epoch 2
    assert stateful.rereads(27, None) == 27  # no length: from the very start


def test_the_saved_position_resumes_on_another_world_size():
    stream = Counted(200)
    _, position = shard_batches(stream, BatchSplit(16, 8), 5)
    whole = [shard_batches(Counted(200), BatchSplit(16, 4, world_size=2), 9, rank=r)[0] for r in range(2)]
    for rank in range(2):
        resumed, _ = shard_batches(
            Counted(200), BatchSplit(16, 4, world_size=2), 9, 5, position.after(5), rank
        )
        assert resumed == whole[rank][5 * 2 :]


class StreamTask(RegressionTask):
    """``noisy``: noise drawn while the stream is read (in the loader's workers, where it has them)."""

    def __init__(self, stateless: bool = False, noisy: bool = False) -> None:
        super().__init__()
        self.stateless, self.noisy = stateless, noisy

    def train_data(self):
        task = self

        class Stream(Counted):
            def __iter__(inner):
                for (index,) in super().__iter__():
                    x = task.x[index]
                    if task.noisy:
                        x = x + torch.rand(x.shape, dtype=x.dtype)
                    yield x, task.y[index], task.mask[index]

        return Stream(len(self.x), self.stateless)


class AugmentedStream(StreamTask):
    """Random noise drawn twice: while the stream is read, and in Task.augment (in the training process,
    from the generator a checkpoint restores)."""

    def __init__(self, stateless: bool = False) -> None:
        super().__init__(stateless, noisy=True)

    def augment(self, batch):
        x, y, mask = batch
        return x + torch.rand(x.shape, dtype=x.dtype), y, mask


@pytest.mark.parametrize(("workers", "stateless"), [(0, False), (2, False), (2, True)])
def test_a_killed_run_on_a_stream_resumes_bit_identical(tmp_path, workers, stateless, capsys):
    """With random augmentation (the bugs: a stream's loader drew its workers' base seed from the global
    generator when it started, so a resumed run's augmentation drew other numbers; what the stream drew
    while read came from its worker's generators, which a resume starts anew)."""
    settings = dict(
        global_batch_size=16, micro_batch_size=8, max_steps=14, checkpoint_every=3, num_workers=workers
    )
    reference = lt.Trainer(quiet_config(tmp_path / "whole", **settings)).fit(AugmentedStream(stateless))
    with pytest.raises(KeyboardInterrupt):
        lt.Trainer(quiet_config(tmp_path / "run", **settings), [StopAt(8)]).fit(AugmentedStream(stateless))
    capsys.readouterr()
    config = quiet_config(tmp_path / "run", resume="auto", progress="plain", **settings)
    resumed = lt.Trainer(config).fit(AugmentedStream(stateless))
    for name, value in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    # The run log says how the stream got back to step 6 (the checkpoint before the kill).
    said = capsys.readouterr().out
    if stateless:  # read again from the start of its epoch: 6 steps x 16 items
        assert "train_data: re-reads 96 items to reach step 6 (no exact state_dict())" in said
    else:
        assert (
            "train_data: resumed from the stream's saved state at epoch 0, item 96 (nothing re-read)" in said
        )


class Endless(IterableDataset):
    def __iter__(self):
        return iter(range(10**6))


class EndlessWithState(Endless):
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_the_run_log_says_for_each_stream_of_a_mixture_how_it_got_back():
    """Map-style sources say nothing (they are indexed), wherever they come in the list; each stream
    says whether its saved state put it back, or how many items it reads again and why."""
    from types import SimpleNamespace

    from leantrain.data.build import _resume_notes, _saved_positions
    from leantrain.data.stream import StreamReader

    names = ["books", "web", "code"]
    readers = [list(range(10)), StreamReader(Endless(), "web"), StreamReader(EndlessWithState(), "code")]
    plan = SimpleNamespace(
        names=names, readers=lambda: readers, draws_before=lambda step: [0, 8 * step, 2 * step]
    )
    assert _resume_notes(plan, 0, None) == []  # not resumed
    assert _resume_notes(plan, 5, None) == [
        "web: re-reads 40 items to reach step 5 (no saved position for this step)",
        "code: re-reads 10 items to reach step 5 (no saved position for this step)",
    ]
    positions = [
        None,
        {"epoch": 0, "read": 7, "snapshot": None},
        {"epoch": 1, "read": 3, "snapshot": {"s": 1}},
    ]
    assert _resume_notes(plan, 5, positions) == [
        "web: re-reads 7 items to reach step 5 (no exact state_dict())",
        "code: resumed from the stream's saved state at epoch 1, item 3 (nothing re-read)",
    ]
    # the positions a checkpoint saved count only at its step and for the same sources
    saved = {"step": 5, "sources": names, "positions": positions}
    assert _saved_positions(saved, 5, names) is positions
    assert _saved_positions(saved, 4, names) is None
    assert _saved_positions(saved, 5, ["web", "code"]) is None
    assert _saved_positions(None, 5, names) is None


def test_token_counts_fold_in_only_the_steps_done_though_the_loader_reads_ahead():
    position = DataPosition(["web", "code"], 4, [None, None], [100, 50])  # resumed at step 4
    for step, tokens in ((4, [1, 2]), (4, [3, 4]), (5, [10, 20]), (6, [7, 7])):  # step 4: two micro-batches
        position.record({"step": step, "tokens": tokens})
    assert position.tokens(4) == [100, 50]  # nothing done since the resume
    assert position.tokens(6) == [114, 76]  # steps 4 and 5; step 6, read ahead, not yet
    assert position.tokens(7) == [121, 83]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_streams_loader_takes_the_runs_loader_settings(workers):
    """Workers, pinning and prefetch as chosen; workers kept alive from epoch to epoch when there are any."""
    from leantrain.cluster import ClusterEnv
    from leantrain.data.build import build_train_loader, load_train_data

    prefetch = 3 if workers else None
    cfg = lt.TrainConfig(global_batch_size=16, max_steps=4, num_workers=workers, prefetch_factor=prefetch)
    data = load_train_data(StreamTask(), cfg, ClusterEnv("single"))
    loader, _, _ = build_train_loader(data, cfg, ClusterEnv("single"), BatchSplit(16, 16), 4, 0, True)
    assert (loader.num_workers, loader.pin_memory) == (workers, True)
    assert (loader.prefetch_factor, loader.persistent_workers) == (prefetch, workers > 0)


def test_only_a_stream_without_a_length_needs_max_steps():
    from leantrain.data.stream import check_stream_steps

    class Sized(Endless):
        def __len__(self):
            return 100

    check_stream_steps(Sized(), "train_data", None)  # its epochs have a length
    check_stream_steps(Endless(), "train_data", 10)
    with pytest.raises(
        lt.TaskError, match=r"^train_data is an IterableDataset without __len__: set max_steps"
    ):
        check_stream_steps(Endless(), "train_data", None)
