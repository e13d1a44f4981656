from __future__ import annotations

import multiprocessing
from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from leantrain.data.loader import (
    build_loader,
    check_map_style,
    device_batches,
    move_to_device,
    stop_workers,
)
from leantrain.data.sampler import GlobalBatchSampler
from leantrain.errors import DataError, TaskError
from leantrain.step.batching import BatchSplit


class FailsAt(Dataset):
    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad:
            raise ValueError("corrupt record")
        return torch.tensor([float(index)])


class NoisyItems(Dataset):
    """Each item draws from torch's, NumPy's and Python's global generators: random augmentation."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        import random

        import numpy as np

        return torch.tensor([index, torch.rand(()).item(), np.random.rand(), random.random()])


def loaded(workers: int, disturb: bool = False) -> list[torch.Tensor]:
    sampler = GlobalBatchSampler(24, BatchSplit(8, 4), total_steps=5, seed=3)
    batches = []
    for batch in build_loader(NoisyItems(), "train_data", batch_sampler=sampler, num_workers=workers, seed=3):
        batches.append(batch)
        if disturb:  # what a training step (CPU dropout) or a prefetcher reading ahead draws between loads
            torch.rand(5)
    return batches


def test_augmentation_follows_the_micro_batch_position_not_the_loading_process():
    reference = loaded(workers=0)
    assert len({round(float(b[0, 1]), 6) for b in reference}) == len(reference)  # really random
    for other in (loaded(workers=2), loaded(workers=0, disturb=True)):
        assert all(torch.equal(a, b) for a, b in zip(reference, other, strict=True))


def test_each_rank_and_micro_batch_draws_its_own_augmentation():
    """Seeded from the step alone, the two ranks' micro-batches of a step (and the two micro-batches
    of a rank's step) would draw the same random numbers: augmentation repeated across the batch."""
    split = BatchSplit(16, 4, world_size=2)  # per step: 2 ranks x 2 micro-batches
    draws = []
    for rank in (0, 1):
        sampler = GlobalBatchSampler(24, split, total_steps=3, seed=3, rank=rank)
        draws += [b[:, 1:] for b in build_loader(NoisyItems(), "train_data", batch_sampler=sampler, seed=3)]
    assert len(draws) == 2 * 3 * 2
    assert len({tuple(d[0].tolist()) for d in draws}) == len(draws)  # every micro-batch draws anew


def test_loading_in_the_main_process_leaves_the_training_steps_random_stream_alone():
    """Torch's CPU generator is the training step's (CPU dropout, ``augment``): loading must not
    shift it, however many micro-batches it loads."""
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    loaded(workers=0)
    assert torch.equal(torch.rand(3), expected)


def test_loading_stored_values_seeds_nothing_and_augmentation_is_still_seeded(monkeypatch):
    """Seeding the host generators costs ~16-29 µs per micro-batch, skipped where items are stored
    values (a TensorDataset, a subset of one, leantrain's cache): nothing there draws a random number."""
    import leantrain.data.loader as loader_module

    seeds: list[int] = []
    seeded = loader_module.host_rng_seeded
    monkeypatch.setattr(loader_module, "host_rng_seeded", lambda seed: seeds.append(seed) or seeded(seed))
    sampler = GlobalBatchSampler(24, BatchSplit(8, 4), total_steps=2, seed=3)
    stored = TensorDataset(torch.arange(24.0))
    for dataset in (stored, Subset(stored, range(24))):
        assert len(list(build_loader(dataset, "train_data", batch_sampler=sampler, seed=3))) == 4
    assert seeds == []
    assert len(list(build_loader(NoisyItems(), "train_data", batch_sampler=sampler, seed=3))) == 4
    assert len(set(seeds)) == 4  # one seed per micro-batch position


class TensorItems(TensorDataset):
    """A TensorDataset subclass: its own __getitem__ (augmentation, say) must still be called."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        image, label = super().__getitem__(index)
        return image + 1000, label


def _columns() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(40, 3, 2, generator=generator),  # image-like items
        torch.randint(0, 10, (40,), generator=generator),  # 0-dim labels
        torch.rand(40, generator=generator) > 0.5,  # bool
    )


def _one_by_one(dataset: Dataset, batch: list[int]) -> list[torch.Tensor]:
    from torch.utils.data import default_collate

    return default_collate([dataset[i] for i in batch])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_tensor_dataset_is_read_per_micro_batch_and_gives_what_the_items_collate_to(workers):
    """One indexed read per tensor instead of an item tuple per row: the same batches, for the
    dataset, a subset and a subset of a subset; a subclass keeps its own __getitem__."""
    stored = _columns()
    subsets = Subset(stored, list(range(39, -1, -2)))  # every other row, backwards
    for dataset in (stored, subsets, Subset(subsets, [3, 1, 4, 15, 9, 2, 6, 5, 0, 7, 8, 10])):
        sampler = GlobalBatchSampler(len(dataset), BatchSplit(8, 4), total_steps=3, seed=5)
        batches = list(build_loader(dataset, "train_data", batch_sampler=sampler, num_workers=workers))
        expected = [_one_by_one(dataset, list(rows)) for rows in sampler]
        assert len(batches) == len(expected) == 6
        for batch, reference in zip(batches, expected, strict=True):
            assert type(batch) is list and len(batch) == 3
            pairs = zip(batch, reference, strict=True)
            assert all(torch.equal(b, r) and b.dtype == r.dtype for b, r in pairs)
    subclass = TensorItems(*_columns().tensors[:2])
    batch = next(iter(build_loader(subclass, "train_data", batch_size=4)))
    assert batch[0].min() > 900


def test_a_tensor_dataset_is_not_read_item_by_item(monkeypatch):
    def one_item(self, index):
        raise AssertionError("an item tuple was built")

    monkeypatch.setattr(TensorDataset, "__getitem__", one_item)
    sampler = GlobalBatchSampler(40, BatchSplit(8, 4), total_steps=2, seed=5)
    assert len(list(build_loader(_columns(), "train_data", batch_sampler=sampler))) == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_in_batches_of_a_size_gives_what_a_dataloader_gives(workers):
    """Validation's loader (a batch size, a partial last batch): in the main process it is not a
    DataLoader, and must still give the same batches, dict items included."""
    from torch.utils.data import DataLoader

    class Records(Dataset):
        def __len__(self) -> int:
            return 13

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"x": torch.full((2,), float(index)), "y": torch.tensor(index % 3)}

    for dataset in (_columns(), Records()):
        ours = build_loader(dataset, "val_data", batch_size=5, num_workers=workers)
        theirs = list(DataLoader(dataset, batch_size=5))
        assert len(ours) == len(theirs) == -(-len(dataset) // 5)  # the partial batch counts
        for batch, reference in zip(ours, theirs, strict=True):
            flat = batch.values() if isinstance(batch, dict) else batch
            expected = reference.values() if isinstance(reference, dict) else reference
            assert all(torch.equal(b, r) for b, r in zip(flat, expected, strict=True))


def test_a_tensor_dataset_row_out_of_range_is_a_data_error_naming_the_item():
    stored = TensorDataset(torch.arange(4.0))
    for dataset in (stored, Subset(stored, [3, 2, 1])):
        loader = build_loader(dataset, "train_data", batch_sampler=[[1, 2], [0, 7]])
        with pytest.raises(DataError) as caught:
            list(loader)
        size = len(dataset)
        assert (
            str(caught.value)
            == f"train_data item 7 failed: IndexError: index 7 is out of range for {size} items"
        )


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_item_names_its_index_and_the_original_error(workers):
    before = set(multiprocessing.active_children())  # another test's, under pytest-xdist
    loader = build_loader(FailsAt(bad=11), "train_data", batch_size=4, num_workers=workers)
    with pytest.raises(DataError) as caught:
        list(loader)
    assert str(caught.value) == "train_data item 11 failed: ValueError: corrupt record"
    if workers:
        assert "Traceback" in caught.value.details  # the worker's traceback is kept for debugging
    assert len(set(multiprocessing.active_children()) - before) == workers
    stop_workers(loader)  # at once, and not left to the collector (see the function)
    assert set(multiprocessing.active_children()) - before == set()


def test_check_map_style_rejects_what_is_neither_map_style_nor_a_stream():
    with pytest.raises(TaskError, match=r"must be a map-style Dataset .* or an IterableDataset, got int"):
        check_map_style(3, "val_data")
    assert check_map_style([1, 2, 3], "train_data") == 3


def test_move_to_device_keeps_the_structure():
    Pair = namedtuple("Pair", "a b")
    batch = {
        "x": torch.ones(2),
        "rest": [Pair(torch.zeros(1), 3), (torch.ones(1), torch.ones(3))],
        "name": "n",
    }
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta"
    assert isinstance(moved["rest"][0], Pair) and moved["rest"][0].a.device.type == "meta"
    assert moved["rest"][0].b == 3 and moved["name"] == "n"
    pair = moved["rest"][1]
    assert type(pair) is tuple and [t.shape for t in pair] == [(1,), (3,)]
    assert all(t.device.type == "meta" for t in pair)


def test_cpu_batches_pass_through_untouched():
    batches = [torch.ones(2), torch.zeros(2)]
    assert [b is o for b, o in zip(device_batches(batches, torch.device("cpu")), batches, strict=True)] == [
        True,
        True,
    ]


def test_a_dtype_casts_floating_tensors_only():
    batch = {"x": torch.ones(2), "label": torch.tensor([1, 2])}
    (out,) = device_batches([batch], torch.device("cpu"), torch.bfloat16)
    assert out["x"].dtype == torch.bfloat16 and out["label"].dtype == torch.int64
    assert torch.equal(out["label"], batch["label"])


def test_a_dtype_reaches_the_fields_of_every_container():
    """The inputs of a true 16-bit model, however the task nests them (a namedtuple's float field
    left in fp32 would meet bf16 weights)."""
    Pair = namedtuple("Pair", "x label")
    batch = [Pair(torch.ones(2), torch.tensor([1])), (torch.ones(2),), {"x": [torch.ones(1)]}]
    (out,) = device_batches([batch], torch.device("cpu"), torch.bfloat16)
    assert out[0].x.dtype == torch.bfloat16 and out[0].label.dtype == torch.int64
    assert out[1][0].dtype == torch.bfloat16 and out[2]["x"][0].dtype == torch.bfloat16


def test_other_devices_get_batches_moved():
    out = list(device_batches([(torch.ones(2),)], torch.device("meta")))
    assert out[0][0].device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetcher_delivers_every_batch_in_order():
    batches = [torch.full((4,), float(i)).pin_memory() for i in range(5)]
    out = [b.cpu() for b in device_batches(batches, torch.device("cuda"))]
    assert [float(b[0]) for b in out] == [0, 1, 2, 3, 4]
