"""``--cache`` as each process of a run opens it, in this process with the rank's environment: rank 0
builds the split (or finds it, or copies it down from a URL) and says so; every other rank opens what
rank 0 built, copying a URL's cache down first when its machine has no copy, and never builds one."""

from __future__ import annotations

import fsspec
import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from leantrain.cluster import ClusterEnv
from leantrain.config import TrainConfig
from leantrain.data import build
from leantrain.data.cache import MANIFEST, CacheError
from leantrain.data.remote_cache import cache_root
from tests.conftest import RegressionTask

RANK_0 = ClusterEnv("torchrun", rank=0, world_size=1, local_world_size=3)  # alone: no barrier to wait at
RANK_1 = ClusterEnv("torchrun", rank=1, local_rank=1, world_size=1, local_world_size=3)


def one_mebibyte() -> TensorDataset:
    """1,024 items of two rows of 64 float64 values: 1.0 MiB in all."""
    return TensorDataset(
        torch.arange(65536.0, dtype=torch.float64).reshape(1024, 64),
        torch.ones(1024, 64, dtype=torch.float64),
    )


@pytest.fixture
def opened(tmp_path, monkeypatch):
    """``opened(env, cache, task=...)`` -> (the dataset, the notes); ``opened.built`` holds what each
    call gave prepare_cache: (data name, workers, whether it may build)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "machine-a"))
    monkeypatch.chdir(tmp_path)
    real = build.prepare_cache

    def recorded(dataset, folder, source, name, num_workers=0, build=True):
        opened.built.append((name, num_workers, build))
        return real(dataset, folder, source, name, num_workers, build)

    monkeypatch.setattr(build, "prepare_cache", recorded)

    def opened(env, cache, task=None, num_workers=0, data=None):
        notes: list[str] = []
        cfg = TrainConfig(cache=cache, num_workers=num_workers)
        dataset = build._cached(data or one_mebibyte(), task or RegressionTask(), "train", cfg, env, notes)
        return dataset, notes

    opened.built = []
    return opened


def test_rank_0_builds_the_split_then_reads_it_and_another_rank_opens_it_without_building(opened):
    notes = opened(RANK_0, "c", num_workers=1)[1]
    assert len(notes) == 1 and notes[0].startswith("cache c/train: 1,024 train items, 1.0 MiB, built in ")
    assert opened(RANK_0, "c")[1] == ["cache c/train: 1,024 train items, 1.0 MiB, read"]
    again, notes = opened(RANK_1, "c")
    assert notes == [] and len(again) == 1024
    assert all(torch.equal(a, b) for a, b in zip(again[1023], one_mebibyte()[1023], strict=True))
    assert opened.built == [("train_data", 1, True), ("train_data", 0, True), ("train_data", 0, False)]


def test_the_automatic_workers_are_a_share_for_this_nodes_processes(opened, monkeypatch):
    shares = []
    monkeypatch.setattr(build, "auto_workers", lambda processes: shares.append(processes) or 2)
    opened(RANK_0, "c", num_workers="auto")
    assert shares == [3] and opened.built == [("train_data", 2, True)]


def test_another_rank_never_builds_a_missing_cache_and_a_cache_of_another_task_is_refused(opened):
    with pytest.raises(CacheError, match="cache c/train"):
        opened(RANK_1, "c")  # rank 0 has not built it: an error, not a second build
    assert not (cache_root("c") / "train" / MANIFEST).exists()
    opened(RANK_0, "c")

    class OtherTask(RegressionTask):
        pass

    with pytest.raises(CacheError, match="holds other data"):  # the task is part of what a cache holds
        opened(RANK_1, "c", task=OtherTask())


def test_at_a_url_another_machines_rank_copies_the_cache_down_before_opening_it(
    opened, tmp_path, monkeypatch
):
    url = f"memory://{tmp_path.name}/cache"  # fsspec's in-memory storage, a real file system in this process
    try:
        # each machine's copy under its user's cache folder, where docs/data.md says
        assert cache_root(url).parent == tmp_path / "machine-a" / "leantrain" / "data-cache"
        assert opened(RANK_0, url)[1][0].startswith(f"cache {cache_root(url) / 'train'}: 1,024 train items")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "machine-b"))
        local = cache_root(url) / "train"
        assert not local.exists()
        dataset, notes = opened(RANK_1, url)
        assert notes == [] and (local / MANIFEST).is_file() and len(dataset) == 1024
        assert opened(RANK_0, url)[1] == [f"cache {local}: 1,024 train items, 1.0 MiB, fetched"]
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_a_stream_is_refused_naming_the_cache_and_the_split(opened):
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(CacheError) as refused:
        opened(RANK_0, "c", data=Stream())
    assert (
        str(refused.value) == "cache c: train data is an IterableDataset; a cache needs a map-style dataset"
    )
