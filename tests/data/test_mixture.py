"""Mixtures: ratios kept per global batch, the same order whatever the split, exact resume, errors."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import leantrain as lt
from leantrain.data.shard import GlobalBatchShard
from leantrain.step.batching import BatchSplit
from tests.conftest import RegressionTask, quiet_config
from tests.test_resume import StopAt


class Tagged(IterableDataset):
    """A stream of (source id, item number); ``set_epoch`` recorded in the item."""

    def __init__(self, source: int, count: int) -> None:
        self.source, self.count, self.epoch = source, count, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in range(self.count):
            yield (torch.tensor([self.source, i, self.epoch]),)


def tagged_map(source: int, count: int) -> TensorDataset:
    return TensorDataset(torch.stack([torch.tensor([source, i, 0]) for i in range(count)]))


WEIGHTS = {"web": 0.7, "code": 0.2, "math": 0.1}


def mixture() -> lt.Mixture:
    sources = {"web": tagged_map(0, 50), "code": Tagged(1, 13), "math": tagged_map(2, 7)}
    return lt.Mixture(sources, weights=WEIGHTS)


def global_batches(mix, split, steps, workers=0, start=0):
    """Every rank's micro-batches, joined into global batches of rows (source, item, epoch)."""
    plan = mix.plan("train_data", split.global_batch_size, seed=3, shuffle=True)
    per_rank = []
    for rank in range(split.world_size):
        shard = GlobalBatchShard(plan, "train_data", split, steps, rank, start, seed=3)
        per_rank.append(
            [b[0] if isinstance(b, list) else b for b in DataLoader(shard, None, num_workers=workers)]
        )
    micro = split.accumulation_steps
    return [
        torch.cat([batch for rank in per_rank for batch in rank[step * micro : (step + 1) * micro]]).tolist()
        for step in range(steps - start)
    ]


def test_the_ratios_over_1000_steps_are_within_one_percent_of_the_weights():
    rows = [row for batch in global_batches(mixture(), BatchSplit(8, 8), 1000) for row in batch]
    seen = Counter(row[0] for row in rows)
    for source, weight in enumerate(WEIGHTS.values()):
        assert abs(seen[source] / len(rows) - weight) <= 0.01 * weight


def test_each_global_batch_keeps_the_ratios_within_one_sample():
    for batch in global_batches(mixture(), BatchSplit(16, 4), 50):
        seen = Counter(row[0] for row in batch)
        for source, weight in enumerate(WEIGHTS.values()):
            assert abs(seen[source] - 16 * weight) < 1


def test_a_source_that_runs_out_starts_its_next_epoch_in_its_own_order():
    batches = global_batches(mixture(), BatchSplit(16, 16), 40)
    rows = [row for batch in batches for row in batch]
    # in its order; within a global batch, the sources' samples are shuffled together
    streamed = [(i, e) for b in batches for e, i in sorted((e, i) for s, i, e in b if s == 1)]
    epochs = len(streamed) // 13
    assert epochs >= 3 and streamed[: 13 * epochs] == [(i, e) for e in range(epochs) for i in range(13)]
    mapped = Counter(item for source, item, _ in rows if source == 2)  # each epoch: every item once
    epochs = sum(mapped.values()) // 7
    assert epochs >= 3 and set(mapped) == set(range(7)) and set(mapped.values()) <= {epochs, epochs + 1}


@pytest.mark.parametrize(("world", "micro", "workers"), [(2, 4, 0), (1, 2, 2), (2, 2, 2)])
def test_the_global_batches_do_not_depend_on_the_split(world, micro, workers):
    reference = global_batches(mixture(), BatchSplit(16, 16), 12)
    assert global_batches(mixture(), BatchSplit(16, micro, world_size=world), 12, workers) == reference
    assert (
        global_batches(mixture(), BatchSplit(16, micro, world_size=world), 12, workers, start=7)
        == reference[7:]
    )


class Augmented(torch.utils.data.Dataset):
    """A map-style source that draws a random number for each item it loads (an augmentation)."""

    def __len__(self):
        return 9

    def __getitem__(self, i):
        return (torch.cat([torch.tensor([3.0, i, 0.0]), torch.rand(1)]),)


class Failing(IterableDataset):
    """A stream whose second item cannot be read."""

    def __iter__(self):
        yield (torch.tensor([4, 0, 0]),)
        raise OSError("the shard is gone")


def test_a_map_sources_augmentation_is_drawn_alike_by_any_worker_count_and_after_a_restart():
    """Loading a map-style item runs under a generator seeded by the run's seed, the step and the
    micro-batch: a worker process, or a process restarted at a later step, draws the same numbers."""
    mix = lt.Mixture({"aug": Augmented(), "more": Augmented()}, weights={"aug": 1, "more": 1})
    reference = global_batches(mix, BatchSplit(8, 4), 6)
    assert len({row[3] for batch in reference for row in batch}) == 48  # drawn anew for each item
    assert global_batches(mix, BatchSplit(8, 4), 6, workers=2) == reference
    assert global_batches(mix, BatchSplit(8, 4), 6, start=3) == reference[3:]


class Unreadable(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        raise KeyError(i)


def test_an_item_that_fails_is_named_with_its_source_and_run_part():
    bad = lt.Mixture({"table": Unreadable()}, weights={"table": 1})
    with pytest.raises(lt.DataError, match=r"^train_data\['table'\] item [01] failed: KeyError"):
        global_batches(bad, BatchSplit(2, 2), 1)
    stream = lt.Mixture({"logs": Failing()}, weights={"logs": 1})
    with pytest.raises(
        lt.DataError, match=r"^train_data\['logs'\] item 1 of epoch 0 failed: OSError: the shard"
    ):
        global_batches(stream, BatchSplit(2, 2), 1)


class Rows(torch.utils.data.Dataset):
    def __init__(self, task, rows):
        self.task, self.rows = task, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        x, y, mask = self.task.x[row], self.task.y[row], self.task.mask[row]
        return {"x": x, "y": y, "mask": mask, "input_ids": torch.arange(row % 3 + 2)[:2]}  # 2 tokens


class MixedRegression(RegressionTask):
    """RegressionTask's samples as token items, from a map-style source and a stream source."""

    def train_data(self):
        table, rest = Rows(self, range(100)), Rows(self, range(100, 160))

        class Stream(IterableDataset):
            def __iter__(inner):
                return (rest[i] for i in range(len(rest)))

        return lt.Mixture({"table": table, "stream": Stream()}, weights={"table": 3, "stream": 1})

    def loss(self, model, batch):
        return super().loss(model, (batch["x"], batch["y"], batch["mask"]))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_killed_mixture_run_resumes_bit_identical(tmp_path, workers):
    settings = dict(
        global_batch_size=16, micro_batch_size=8, max_steps=14, checkpoint_every=3, num_workers=workers
    )
    reference = lt.Trainer(quiet_config(tmp_path / "whole", **settings)).fit(MixedRegression())
    with pytest.raises(KeyboardInterrupt):
        lt.Trainer(quiet_config(tmp_path / "run", **settings), [StopAt(8)]).fit(MixedRegression())
    resumed = lt.Trainer(quiet_config(tmp_path / "run", resume="auto", **settings)).fit(MixedRegression())
    for name, value in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mixture"] == json.loads((tmp_path / "whole" / "summary.json").read_text())["mixture"]
    counts = summary["mixture"]
    assert counts["table"]["samples"] + counts["stream"]["samples"] == 14 * 16
    assert [counts[n]["tokens"] for n in counts] == [2 * counts[n]["samples"] for n in counts]
    # metrics.csv: the counts so far at each log point; the last row's are the summary's
    with (tmp_path / "run" / "metrics.csv").open() as rows:
        last = [row for row in csv.DictReader(rows) if row["train_loss"]][-1]
    assert {n: int(float(last[f"{n}_samples"])) for n in counts} == {n: counts[n]["samples"] for n in counts}
    assert {n: int(float(last[f"{n}_tokens"])) for n in counts} == {n: counts[n]["tokens"] for n in counts}


class Sized:
    """Has a length but no items."""

    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize(
    ("sources", "weights", "message"),
    [
        (
            {},
            {},
            r"^Mixture needs at least one source: "
            r"Mixture\(\{'name': dataset, \.\.\.\}, weights=\{\.\.\.\}\)$",
        ),
        (
            {"a": tagged_map(0, 3), "c": tagged_map(1, 3)},
            {"a": 1, "b": 1},
            r"^Mixture weight 'b' names no source \(sources: a, c\)$",
        ),
        ({"a": tagged_map(0, 3)}, {"a": True}, "Mixture source 'a' has weight True: a weight must be"),
        ({"a": tagged_map(0, 3)}, {"a": float("inf")}, "Mixture source 'a' has weight inf: a weight must be"),
        ({"a": Sized()}, {"a": 1}, "^Mixture source 'a' is a Sized, not a Dataset or an IterableDataset$"),
        ({"a": tagged_map(0, 3), "b": tagged_map(1, 3)}, {"a": 1}, "Mixture source 'b' has no weight"),
        ({"a": tagged_map(0, 3)}, {"a": 0}, "Mixture source 'a' has weight 0: a weight must be a positive"),
        ({"a": tagged_map(0, 3)}, {"a": -1.0}, "Mixture source 'a' has weight -1.0"),
        ({"a": tagged_map(0, 3)}, {"a": float("nan")}, "Mixture source 'a' has weight nan"),
        ({"a": [1, 2, 3], "b": 5}, {"a": 1, "b": 1}, "Mixture source 'b' is a int, not a Dataset"),
        ({"a": TensorDataset(torch.zeros(0))}, {"a": 1}, "Mixture source 'a' is empty"),
    ],
)
def test_bad_input_is_a_one_line_error_naming_the_source(sources, weights, message):
    with pytest.raises(lt.TaskError, match=message):
        lt.Mixture(sources, weights=weights)


def test_unshuffled_each_step_lists_its_sources_in_turn_and_each_source_is_read_in_order():
    mixture = lt.Mixture({"a": tagged_map(0, 5), "b": tagged_map(1, 7)}, weights={"a": 1, "b": 2})
    plan = mixture.plan("train_data", 6, seed=3, shuffle=False)
    assert plan.layout(4, [2, 4]) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]
    a, _ = plan.readers()
    assert [a._index(n) for n in range(12)] == [n % 5 for n in range(12)]  # epoch after epoch in order
    shuffled = mixture.plan("train_data", 6, seed=3, shuffle=True)
    layouts = [shuffled.layout(step, [2, 4]) for step in range(6)]
    assert all(sorted(one) == plan.layout(0, [2, 4]) for one in layouts)  # the same slots
    assert len({tuple(one) for one in layouts}) > 1  # placed anew each step
    a, _ = shuffled.readers()
    epochs = [[a._index(5 * epoch + n) for n in range(5)] for epoch in range(3)]
    assert all(sorted(epoch) == list(range(5)) for epoch in epochs) and len({tuple(e) for e in epochs}) > 1


def test_each_step_holds_the_global_batch_and_every_source_stays_within_one_of_its_share():
    """The slots the whole shares leave go to the sources by their fractional parts: over any number of
    steps each source has given its weight's share of the samples, to within a few (docs/data.md)."""
    mixture = lt.Mixture({"a": tagged_map(0, 5), "b": tagged_map(1, 7), "c": tagged_map(2, 3)},
                         weights={"a": 1, "b": 1.7, "c": 0.45})  # fmt: skip
    for seed in (0, 1):
        plan = mixture.plan("train_data", 10, seed=seed, shuffle=True)
        shares = [10 * mixture.weights[name] for name in ("a", "b", "c")]
        given = [0, 0, 0]
        for step in range(1000):
            counts = plan.counts(step)
            assert sum(counts) == 10 and all(
                math.floor(s) <= c <= math.ceil(s) for c, s in zip(counts, shares, strict=True)
            )
            given = [g + c for g, c in zip(given, counts, strict=True)]
            assert all(abs(g - (step + 1) * s) < 4 for g, s in zip(given, shares, strict=True)), (seed, step)
        assert plan.draws_before(1000) == given
    far = 3 * 2**20 + 7  # summed in chunks of 2**20 steps: the same as summed at once
    assert plan.draws_before(far) == (plan.base * far + plan._extras(np.arange(far)).sum(axis=0)).tolist()


def test_a_mixture_needs_max_steps(fit):
    task = MixedRegression()
    with pytest.raises(lt.TaskError, match="train_data is a Mixture: set max_steps"):
        fit(task, global_batch_size=16, max_epochs=1)


class PackedSources:
    """Two sources of token documents (tokens 0-49 and 50-99, lengths 3-40) mixed 3:1 and packed: a
    row must hold one source's tokens, and the tokens must keep the weights."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, 41, (300,), generator=gen).tolist()
        self.documents = {
            name: [torch.randint(low, low + 50, (n,), generator=gen) for n in lengths]
            for name, low in (("web", 0), ("code", 50))
        }
        self.mixed_rows = 0

    def model(self):
        return torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100))

    def train_data(self):
        return lt.Mixture(self.documents, weights={"web": 3, "code": 1})

    def loss(self, model, batch):
        ids, labels = batch["input_ids"], batch["labels"]
        self.mixed_rows += int(((ids < 50).any(1) & (ids >= 50).any(1)).sum())
        logits = model(ids)
        kept = labels != -100
        return lt.LossSum(
            torch.nn.functional.cross_entropy(logits[kept], labels[kept], reduction="sum"), kept.sum()
        )

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)


def test_a_packed_mixture_packs_within_each_source_and_keeps_the_token_ratios(tmp_path):
    task = PackedSources()
    config = quiet_config(tmp_path / "run", global_batch_size=8, max_steps=200, pack_length=16)
    result = lt.Trainer(config).fit(task)
    assert task.mixed_rows == 0
    tokens = {name: counts["tokens"] for name, counts in result.mixture.items()}
    assert tokens["web"] + tokens["code"] == 200 * 8 * 16
    assert abs(tokens["web"] / (200 * 8 * 16) - 0.75) < 0.01
    with pytest.raises(
        lt.ConfigError,
        match=r"^invalid pack_length=16: packs map-style data; train_data source 'web' is an IterableDataset",
    ):
        lt.Trainer(quiet_config(tmp_path / "stream", global_batch_size=8, max_steps=2, pack_length=16)).fit(
            StreamSource()
        )


class StreamSource(PackedSources):
    def train_data(self):
        documents = self.documents["web"]

        class Stream(IterableDataset):
            def __iter__(self):
                return iter(documents)

        return lt.Mixture({"web": Stream(), "code": self.documents["code"]}, weights={"web": 1, "code": 1})


def test_iterating_a_mixture_looks_at_its_sources_items_in_turn():
    """Not the run's order (fit draws by weight): a look at the items, each source's in turn until
    each ends."""

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(torch.tensor([10]),), (torch.tensor([11]),)])

    class Table(Dataset):
        """Map-style: its items are those of ``range(len)``; past the end is undefined (a KeyError here,
        where Python's own iteration over ``__getitem__`` would wait for an IndexError)."""

        def __init__(self) -> None:
            self.rows = {0: (torch.tensor([0]),), 1: (torch.tensor([1]),), 2: (torch.tensor([2]),)}

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, index: int):
            return self.rows[index]

    mixture = lt.Mixture({"table": Table(), "stream": Stream()}, weights={"table": 1, "stream": 1})
    assert [item.item() for (item,) in mixture] == [0, 10, 1, 11, 2]
