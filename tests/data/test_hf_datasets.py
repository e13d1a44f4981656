"""Hugging Face ``datasets`` as train_data/val_data: tables and streams, collation, cache, workers, resume."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import leantrain as lt
from leantrain.data.cache import MANIFEST, CacheError, prepare_cache, task_source
from leantrain.data.hf import ROWS_PER_READ, stream_rows, torch_rows
from leantrain.data.sampler import GlobalBatchSampler
from leantrain.step.batching import BatchSplit
from tests.conftest import quiet_config
from tests.data.test_stream import stream_batches
from tests.test_resume import StopAt, assert_same_parameters

datasets = pytest.importorskip("datasets")

ROWS = 64  # 4 global batches of 16: runs of 10 steps cross two epoch boundaries
SETTINGS = dict(global_batch_size=16, micro_batch_size=8, max_steps=10)


def columns(rows: int = ROWS) -> dict[str, list]:
    """Python values, as a user's records hold them: an id, a list of floats, an int label."""
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(0))
    return {"id": list(range(rows)), "x": x.tolist(), "label": (x.sum(1) > 0).long().tolist()}


class Rows(Dataset):
    """The same rows as plain tensors: what the table should train like."""

    def __init__(self, rows: int) -> None:
        data = columns(rows)
        self.x = torch.tensor(data["x"])
        self.label = torch.tensor(data["label"])

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "label": self.label[index]}


class HFTask:
    """A classifier on a datasets table or stream (``kind``), with validation data of the same kind."""

    def __init__(self, kind: str = "table", shards: int = 1) -> None:
        self.kind, self.shards = kind, shards

    def data(self, rows: int) -> Any:
        if self.kind == "tensors":
            return Rows(rows)
        table = datasets.Dataset.from_dict(columns(rows))
        if self.kind == "torch-table":
            return table.with_format("torch")
        if self.kind == "table":
            return table  # datasets' default format: rows of lists and Python numbers
        stream = table.to_iterable_dataset(num_shards=self.shards)
        return stream.shuffle(seed=1, buffer_size=8) if self.kind == "shuffled-stream" else stream

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    def train_data(self) -> Any:
        return self.data(ROWS)

    def val_data(self) -> Any:
        return self.data(24)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["label"])

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_same_run(a: lt.FitResult, b: lt.FitResult) -> None:
    """The same weights, and the same validation loss (to rounding: with workers, a stream's
    validation batches hold other rows, each worker taking every other one)."""
    assert_same_parameters(a.model, b.model)
    assert a.val_metrics == pytest.approx(b.val_metrics, rel=1e-6)


@pytest.mark.parametrize("kind", ["table", "torch-table"])
def test_a_table_trains_exactly_as_its_rows_as_tensors(fit, kind):
    """Default collation of dict rows: in datasets' default format a row's list of 6 floats was
    transposed into 6 tensors of the batch size (and would have been float64)."""
    reference = fit(HFTask("tensors"), **SETTINGS)
    assert_same_run(fit(HFTask(kind), **SETTINGS), reference)


def test_a_stream_trains_as_the_table_unshuffled(fit):
    """Also with a worker per CPU: a datasets stream iterated in a DataLoader worker reads only
    that worker's shards, and with one shard worker 1 read nothing (an error)."""
    reference = fit(HFTask("table"), shuffle=False, **SETTINGS)
    assert_same_run(fit(HFTask("stream", shards=1), num_workers=2, **SETTINGS), reference)


def test_a_stream_trains_the_same_with_workers_as_without(fit):
    """With three shards, the workers of a datasets stream kept each other's items (other weights).
    (Not compared with the table: datasets reorders the shards of a stream in every epoch but the first.)"""
    reference = fit(HFTask("stream", shards=3), **SETTINGS)
    assert_same_run(fit(HFTask("stream", shards=3), num_workers=2, **SETTINGS), reference)


@pytest.mark.parametrize("workers", [0, 2])
def test_every_rank_and_worker_gets_its_share_of_the_stream_order(workers):
    stream = torch_rows(HFTask("stream", shards=3).train_data(), "train_data")
    plan = BatchSplit(global_batch_size=16, micro_batch_size=4, world_size=2)
    for rank in range(2):
        ids = [b["id"].tolist() for b in stream_batches(stream, plan, 4, rank, workers)]
        sampler = GlobalBatchSampler(ROWS, plan, 4, shuffle=False, rank=rank)
        assert ids == [list(indices) for indices in sampler]


def test_each_epoch_reads_the_streams_own_order_for_that_epoch():
    """datasets reshuffles a stream (its buffer and its shards) from the epoch set by set_epoch."""
    stream = HFTask("shuffled-stream", shards=3).train_data()
    orders = [[int(row["id"]) for row in stream_rows(stream, "train_data", epoch)] for epoch in range(2)]
    for epoch, order in enumerate(orders):
        stream.set_epoch(epoch)
        assert order == [row["id"] for row in stream]
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(ROWS))


@pytest.mark.parametrize(
    ("kind", "workers"), [("table", 2), ("stream", 0), ("stream", 2), ("shuffled-stream", 2)]
)  # an unshuffled stream resumes from its state_dict(); a shuffled one reads its epoch again
def test_a_resumed_run_ends_as_an_uninterrupted_one(fit, tmp_path, monkeypatch, kind, workers):
    # blocks of 8 rows: the checkpoint (step 6, 32 rows into epoch 1) is inside the stream's fifth block
    monkeypatch.setattr("leantrain.data.hf.ROWS_PER_READ", 8)
    settings = dict(SETTINGS, num_workers=workers, checkpoint_every=3)
    reference = fit(HFTask(kind, shards=3), **settings)
    with pytest.raises(KeyboardInterrupt):
        lt.Trainer(quiet_config(tmp_path / "run", **settings), [StopAt(8)]).fit(HFTask(kind, shards=3))
    resumed = lt.Trainer(quiet_config(tmp_path / "run", resume="auto", **settings)).fit(
        HFTask(kind, shards=3)
    )
    assert_same_run(resumed, reference)  # from the checkpoint of step 6, in epoch 1


def test_the_cache_stores_a_tables_columns_as_tensors_and_trains_as_the_table(fit, tmp_path):
    """`leantrain cache` (prepare_cache on the task's own table) stored each of a row's 6 floats as
    a field of its own, and `fit --cache` then read back lists of numbers, which do not collate."""
    task, folder = HFTask("table"), tmp_path / "cache" / "train"
    prepare_cache(task.train_data(), folder, task_source(task, "train"), "train_data")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert [leaf["shape"] for leaf in manifest["leaves"]] == [[], [6], []]  # id, x, label
    reference = fit(HFTask("table"), **SETTINGS)
    cached = fit(HFTask("table"), cache=str(tmp_path / "cache"), num_workers=2, **SETTINGS)
    assert_same_run(cached, reference)


def test_a_string_column_is_named_when_a_table_is_cached(tmp_path):
    table = HFTask().train_data().add_column("text", ["a row"] * ROWS)
    with pytest.raises(lt.DataError, match=r"^train_data item 0\['text'\] is a str: .* remove_columns\)$"):
        prepare_cache(table, tmp_path / "cache", "tests:HFTask", "train_data")


def test_leantrain_cache_of_a_stream_is_refused_in_one_line(tmp_path):
    """`leantrain cache` (prepare_cache) on a stream stopped with TypeError: no len()."""
    with pytest.raises(
        CacheError, match=r"train_data is an IterableDataset; a cache needs a map-style dataset$"
    ):
        prepare_cache(HFTask("stream").train_data(), tmp_path / "cache", "tests:HFTask", "train_data")


def test_a_stream_with_a_shuffle_buffer_anywhere_is_read_again_on_resume():
    """datasets' state_dict() leaves a shuffle buffer out: such a stream cannot resume from its state.
    Bug: the check read a private attribute that datasets 5 no longer sets, so every shuffled stream
    claimed an exact resume (and resumed elsewhere once a checkpoint fell past its first block of rows)."""
    from leantrain.data.hf import resumes_exactly

    plain = HFTask("stream", shards=2).train_data()
    shuffled = HFTask("shuffled-stream", shards=2).train_data()
    assert resumes_exactly(plain) and resumes_exactly(datasets.interleave_datasets([plain, plain]))
    assert not resumes_exactly(shuffled) and not resumes_exactly(shuffled.map(lambda row: row))
    assert not resumes_exactly(datasets.interleave_datasets([plain, shuffled]))
    assert not resumes_exactly(datasets.interleave_datasets([shuffled, plain]))
    from types import SimpleNamespace

    assert not resumes_exactly(SimpleNamespace(_shuffling=object()))  # as datasets before 5 marks it
    assert resumes_exactly(SimpleNamespace())
    from leantrain.data.hf import MAX_STREAM_CHAIN

    chain = None
    for _ in range(MAX_STREAM_CHAIN + 1):  # longer than the walk goes: not trusted
        chain = SimpleNamespace(ex_iterable=chain)
    assert not resumes_exactly(SimpleNamespace(_ex_iterable=chain))


def test_a_stream_resumed_from_its_state_saves_that_state_until_it_reads_its_next_block(monkeypatch):
    """A snapshot is the state at the start of the block being read and the rows of it already given:
    a reader restored from a snapshot, saved again before its next block, saves the same snapshot."""
    monkeypatch.setattr("leantrain.data.hf.ROWS_PER_READ", 8)
    stream = HFTask("stream", shards=2).train_data()
    first = stream_rows(stream, "train_data", 0)
    ids = [int(next(first)["id"]) for _ in range(10)]
    saved = first.snapshot()
    assert saved["skip"] == 2  # 2 rows of the second block given
    again = stream_rows(stream, "train_data", 0, saved["state"])
    assert [int(next(again)["id"]) for _ in range(2)] == ids[8:]
    assert again.snapshot() == saved
    third = stream_rows(stream, "train_data", 0, saved["state"])
    assert [int(next(third)["id"]) for _ in range(8)] == ids[8:] + [int(next(first)["id"]) for _ in range(6)]


def test_a_dict_of_splits_or_a_stream_split_by_node_is_refused_in_one_line():
    splits = datasets.DatasetDict({"train": HFTask().train_data(), "test": HFTask().val_data()})
    with pytest.raises(lt.TaskError, match=r"^train_data is a datasets.DatasetDict \(splits: train, test\)"):
        torch_rows(splits, "train_data")
    with pytest.raises(
        lt.TaskError, match=r"^Mixture source 'web' is a datasets.DatasetDict \(splits: train, test\)"
    ):
        lt.Mixture({"web": splits}, weights={"web": 1})
    from datasets.distributed import split_dataset_by_node

    mine = split_dataset_by_node(HFTask("stream").train_data(), rank=1, world_size=2)
    with pytest.raises(lt.TaskError, match=r"by split_dataset_by_node \(rank 1 of 2\): return the whole"):
        torch_rows(mine, "train_data")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_row_names_its_block_of_rows_and_the_epoch(workers):
    def corrupt(row: dict) -> dict:
        if row["id"] == 140:
            raise ValueError("corrupt record")
        return row

    table = datasets.Dataset.from_dict(columns(192))
    stream = torch_rows(table.to_iterable_dataset().map(corrupt), "train_data")
    with pytest.raises(lt.DataError) as caught:
        stream_batches(stream, BatchSplit(global_batch_size=16, micro_batch_size=8), 10, 0, workers)
    block = f"{2 * ROWS_PER_READ}-{3 * ROWS_PER_READ - 1}"  # row 140 is in the third block read
    failed = "reading them failed: ValueError: corrupt record"
    assert str(caught.value) == f"train_data items {block} of epoch 0: {failed}"


@pytest.mark.parametrize("kind", ["table", "stream"])
def test_plan_reads_a_table_as_fit_does(kind):
    """Rows in datasets' default format: plan collates them as the run does (a list column would
    reach the loss as a list of tensors otherwise)."""
    from leantrain.memory.estimate import estimate_memory

    rows = estimate_memory(HFTask(kind), lt.TrainConfig(global_batch_size=16, micro_batch_size=8)).rows
    assert [row.micro_batch_size for row in rows] == [1, 2, 4, 8, 16]
    assert all(row.memory.activation_bytes > 0 for row in rows)


def test_a_table_without_a_transform_is_loaded_without_seeding_and_one_with_a_transform_is_seeded():
    from leantrain.data.loader import reads_stored_values

    table = datasets.Dataset.from_dict(columns(8))
    assert reads_stored_values(torch_rows(table, "train_data"))
    assert not reads_stored_values(table.with_transform(lambda rows: rows))  # a transform may draw
