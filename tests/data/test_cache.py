"""The memory-mapped cache: exact round trip, interrupted builds, stale and foreign folders."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import leantrain as lt
from leantrain.data.cache import MANIFEST, CacheError, build_cache, fingerprint, open_cache, prepare_cache
from leantrain.data.loader import reads_stored_values
from tests.conftest import RegressionTask


class Records(Dataset):
    """Items of every supported kind, nested: tensors, arrays, ints, floats, bools, tuples and dicts."""

    def __init__(
        self, size: int = 20, offset: int = 0, fail_at: int | None = None, ragged_at: int | None = None
    ):
        self.size, self.offset, self.fail_at, self.ragged_at = size, offset, fail_at, ragged_at

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if index == self.fail_at:
            raise ValueError("corrupt record")
        value = index + self.offset
        length = 4 if index != self.ragged_at else 5
        return (
            torch.arange(length, dtype=torch.float32) * value,
            {
                "label": value % 3,
                "weight": value / 7,
                "keep": value % 2 == 0,
                "raw": np.full(2, value, np.int16),
            },
        )


def assert_same_item(a, b):
    assert torch.equal(a[0], b[0]) and a[0].dtype == b[0].dtype
    assert a[1].keys() == b[1].keys()
    for key in ("label", "weight", "keep"):
        assert a[1][key] == b[1][key] and type(a[1][key]) is type(b[1][key])
    assert np.array_equal(a[1]["raw"], b[1]["raw"]) and a[1]["raw"].dtype == b[1]["raw"].dtype


@pytest.mark.parametrize("workers", [0, 2])
def test_the_cache_returns_the_original_items(tmp_path, workers):
    data = Records()
    cached, built = prepare_cache(data, tmp_path / "c", "test:train", "train_data", workers)
    assert built is not None and len(cached) == len(data)
    for index in range(len(data)):
        assert_same_item(cached[index], data[index])
    for item, index in zip(cached.__getitems__([7, 3, 19]), [7, 3, 19], strict=True):
        assert_same_item(item, data[index])
    for outside in (len(data), -1):  # Python's iteration over __getitem__ stops at the IndexError
        with pytest.raises(
            IndexError, match=f"^index {outside} is out of range for a cache of {len(data)} items$"
        ):
            cached[outside]
    again, rebuilt = prepare_cache(data, tmp_path / "c", "test:train", "train_data")
    assert rebuilt is None and len(again) == len(data)  # complete: read, not built again
    assert reads_stored_values(cached) and not reads_stored_values(data)  # the loader seeds only for data


def test_lists_and_tuples_come_back_as_lists_and_tuples_at_every_level(tmp_path):
    class Nested(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return [torch.tensor([index]), (index, [index / 2, ()]), {"pair": (index, [index])}]

    cached, _ = prepare_cache(Nested(), tmp_path / "c", "test:train", "train_data")
    for index in range(4):
        item = cached[index]
        assert item == [torch.tensor([index]), (index, [index / 2, ()]), {"pair": (index, [index])}]
        kinds = [type(item), type(item[1]), type(item[1][1]), type(item[1][1][1]), type(item[2]["pair"])]
        assert kinds == [list, tuple, list, tuple, tuple] and type(item[2]["pair"][1]) is list


def test_an_interrupted_build_is_never_taken_for_a_complete_cache(tmp_path):
    folder = tmp_path / "c"
    broken = Records(fail_at=13)
    with pytest.raises(lt.DataError, match="train_data item 13 failed"):
        build_cache(broken, folder, fingerprint(Records(), "s", "train_data"), "train_data", 0)
    assert (folder / "leaf0.npy").exists() and not (folder / MANIFEST).exists()
    assert open_cache(folder, fingerprint(Records(), "s", "train_data")) is None
    cached, built = prepare_cache(Records(), folder, "s", "train_data")  # built again, from scratch
    assert built is not None
    assert_same_item(cached[13], Records()[13])


def test_a_cache_of_other_data_is_refused_naming_the_folder(tmp_path):
    folder = tmp_path / "c"
    prepare_cache(Records(), folder, "test:train", "train_data")
    with pytest.raises(CacheError, match=rf"cache {folder} holds other data \(items_sha256"):
        prepare_cache(Records(offset=1), folder, "test:train", "train_data")
    with pytest.raises(CacheError, match=r"holds other data \(source 'test:train' != 'other:train'\)"):
        prepare_cache(Records(), folder, "other:train", "train_data")
    with pytest.raises(CacheError, match="size 20 != 21"):
        prepare_cache(Records(size=21), folder, "test:train", "train_data")


def test_the_fingerprint_is_the_first_middle_and_last_items_the_class_and_the_length(tmp_path):
    """docs/data.md: a SHA-256 of three items (the first, middle and last), the dataset's class and length."""

    class Changed(Records):
        def __init__(self, changed: int | None = None, size: int = 9) -> None:
            super().__init__(size=size)
            self.changed = changed

        def __getitem__(self, index):
            item = super().__getitem__(index)
            return (item[0] + 1, item[1]) if index == self.changed else item

    folder = tmp_path / "c"
    prepare_cache(Changed(), folder, "s", "train_data")
    assert prepare_cache(Changed(changed=3), folder, "s", "train_data")[1] is None  # not one of the three
    for hashed in (0, 4, 8):
        with pytest.raises(CacheError, match=r"holds other data \(items_sha256 "):
            prepare_cache(Changed(changed=hashed), folder, "s", "train_data")

    class Renamed(Changed):
        pass

    with pytest.raises(CacheError) as refused:  # another class, and another length: both said
        prepare_cache(Renamed(size=10), folder, "s", "train_data")
    names = [f"{__name__}.{kind.__qualname__}" for kind in (Changed, Renamed)]
    differ = f"dataset '{names[0]}' != '{names[1]}', size 9 != 10"
    assert str(refused.value).startswith(f"cache {folder} holds other data ({differ}, items_sha256 ")
    with pytest.raises(lt.DataError) as refused:
        prepare_cache(Records(size=0), tmp_path / "empty", "test:train", "train_data")
    assert str(refused.value) == "test:train is empty: nothing to cache"


def test_a_missing_cache_is_an_error_where_it_may_not_be_built(tmp_path):
    with pytest.raises(CacheError) as refused:
        prepare_cache(Records(), tmp_path / "c", "s", "train_data", build=False)
    refusal = "is not complete; it should have been built by rank 0"
    assert str(refused.value) == f"cache {tmp_path / 'c'} {refusal}"


def test_a_datasets_dict_of_splits_is_named_as_the_tasks_data(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [1.0, 2.0]})})
    with pytest.raises(lt.LeantrainError, match=r"^val_data is a datasets.DatasetDict \(splits: train\)"):
        prepare_cache(splits, tmp_path / "c", "s", "val_data")


def test_a_cache_of_another_format_or_an_unreadable_manifest_is_refused(tmp_path):
    folder = tmp_path / "c"
    prepare_cache(Records(), folder, "s", "train_data")
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(CacheError, match="has format 99"):
        prepare_cache(Records(), folder, "s", "train_data")
    (folder / MANIFEST).write_text("{not json")
    with pytest.raises(CacheError, match=r"cache\.json is unreadable"):
        prepare_cache(Records(), folder, "s", "train_data")


def test_a_folder_of_other_files_is_never_overwritten(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CacheError, match="holds files that are not a leantrain cache"):
        prepare_cache(Records(), tmp_path, "s", "train_data")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_items_of_another_structure_or_type_name_the_item_and_the_field(tmp_path):
    class Mixed(Dataset):
        def __init__(self, odd: int, item: object) -> None:
            self.odd, self.item = odd, item

        def __len__(self):
            return 8

        def __getitem__(self, index):
            return self.item if index == self.odd else (torch.zeros(2), torch.ones(2))

    with pytest.raises(lt.DataError) as refused:  # as many fields, in a list instead of a tuple
        prepare_cache(Mixed(5, [torch.zeros(2), torch.ones(2)]), tmp_path / "a", "s", "train_data")
    refusal = "train_data item 5 is structured differently from item 0; a cache needs one layout"
    assert str(refused.value) == refusal
    for odd in (0, 5):
        with pytest.raises(lt.DataError) as refused:
            prepare_cache(Mixed(odd, (torch.zeros(2), "text")), tmp_path / f"b{odd}", "s", "train_data")
        assert str(refused.value).startswith(f"train_data item {odd}[1] is a str: a cache stores tensors, ")


def test_a_file_where_the_cache_goes_is_refused_and_one_item_is_a_cache(tmp_path):
    (tmp_path / "file").write_text("kept")
    with pytest.raises(CacheError) as refused:
        prepare_cache(Records(size=1), tmp_path / "file", "s", "train_data")
    assert str(refused.value) == f"cache {tmp_path / 'file'} is a file, not a folder"
    assert (tmp_path / "file").read_text() == "kept"
    one = TensorDataset(torch.tensor([[1.0, 2.0]]))  # item 1 is an IndexError
    cached, _ = prepare_cache(one, tmp_path / "one", "s", "train_data")
    assert len(cached) == 1 and torch.equal(cached[0][0], one[0][0])


def test_each_array_file_holds_its_array_and_nothing_more_and_workers_load_the_items(tmp_path):
    """Its space is reserved, not grown past the array; with workers, the items are loaded in them."""
    main = os.getpid()

    class WhereLoaded(Records):
        def __getitem__(self, index):
            return (*super().__getitem__(index), os.getpid() != main)

    started = time.perf_counter()
    cached, manifest = prepare_cache(WhereLoaded(), tmp_path / "c", "s", "train_data", num_workers=2)
    assert 0 <= manifest["build_seconds"] <= time.perf_counter() - started
    held = 0
    for number, path in enumerate(sorted((tmp_path / "c").glob("leaf*.npy"))):
        array = np.load(path, mmap_mode="r")
        assert path.stat().st_size == array.offset + array.nbytes, path.name
        leaf = manifest["leaves"][number]  # cache.json describes each array as it is
        assert (leaf["dtype"], leaf["shape"]) == (array.dtype.name, list(array.shape[1:]))
        held += array.nbytes
    assert manifest["bytes"] == held == cached.nbytes
    assert all(isinstance(array, np.memmap) for array in cached.arrays)  # mapped, not read into memory
    assert WhereLoaded()[0][2] is False  # here, in this process
    assert all(cached[index][2] is True for index in range(len(cached)))  # each loaded in a worker


def test_items_of_different_shapes_name_the_item(tmp_path):
    with pytest.raises(
        lt.DataError, match=r"train_data item 6, field 0: float32 \(5,\) differs from item 0's"
    ):
        prepare_cache(Records(ragged_at=6), tmp_path / "c", "s", "train_data")


def test_the_fingerprint_ignores_the_callers_random_state_and_restores_it():
    class Noisy(Records):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            return (item[0] + torch.rand(4), item[1])

    torch.manual_seed(5)
    first = fingerprint(Noisy(), "s", "train_data")
    expected_next = torch.rand(1)
    torch.manual_seed(5)
    assert fingerprint(Noisy(), "s", "train_data") == first
    assert torch.equal(torch.rand(1), expected_next)


class Augmented(RegressionTask):
    """Adds noise to each training micro-batch on the device; counts the calls."""

    calls = 0

    def augment(self, batch):
        self.calls += 1
        x, y, mask = batch
        return x + 0.01 * torch.randn_like(x), y, mask


def test_fit_from_the_cache_trains_exactly_as_from_the_dataset(fit, tmp_path):
    settings = dict(global_batch_size=16, micro_batch_size=8, max_steps=12)
    reference = fit(Augmented(), **settings)
    first = fit(Augmented(), cache=str(tmp_path / "cache"), **settings)  # builds it
    second = fit(Augmented(), cache=str(tmp_path / "cache"), num_workers=2, **settings)  # reads it
    assert (tmp_path / "cache" / "train" / MANIFEST).is_file()
    for result in (first, second):
        for name, value in reference.model.state_dict().items():
            assert torch.equal(result.model.state_dict()[name], value), name


def test_augment_runs_on_every_training_micro_batch(fit):
    task = Augmented()
    fit(task, global_batch_size=16, micro_batch_size=4, max_steps=3)
    assert task.calls == 3 * 4


def test_auto_loads_from_the_cache_in_the_main_process(fit, tmp_path):
    result = fit(
        RegressionTask(), cache=str(tmp_path / "cache"), num_workers="auto", global_batch_size=16, max_steps=2
    )
    assert result.num_workers == 0
