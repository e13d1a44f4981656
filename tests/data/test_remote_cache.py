"""A data cache at a URL: its files copied down and up with ``cache.json`` last, so that a copy or an
upload stopped half way is never taken for a cache; files already here in full are not fetched again.
(A real object store, through moto: tests/test_object_storage.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from leantrain.data import remote_cache
from leantrain.data.cache import MANIFEST

URL = "s3://bucket/cache"


class FakeRemote:
    """What the cache asks of a RemoteFolder: the sizes under a folder, and gets and puts, in order."""

    held: ClassVar[dict[str, bytes]] = {}  # shared by the instances the code under test makes
    calls: ClassVar[list[str]] = []

    def __init__(self, url: str) -> None:
        assert url == URL

    def sizes(self, folder: str) -> dict[str, int]:
        FakeRemote.calls.append(f"sizes {folder}")
        return {name: len(data) for name, data in self.held.items() if name.startswith(f"{folder}/")}

    def get(self, name: str, path: Path) -> None:
        FakeRemote.calls.append(f"get {name}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.held[name])

    def put(self, path: Path, name: str) -> None:
        FakeRemote.calls.append(f"put {name}")
        self.held[name] = path.read_bytes()


@pytest.fixture
def remote(monkeypatch, tmp_path) -> type[FakeRemote]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(remote_cache, "RemoteFolder", FakeRemote)
    FakeRemote.held, FakeRemote.calls = {}, []
    return FakeRemote


def test_an_upload_puts_the_arrays_first_and_the_manifest_last(remote):
    local = remote_cache.cache_root(URL) / "train"
    local.mkdir(parents=True)
    for name in ("a.npy", MANIFEST, "z.npy"):
        (local / name).write_bytes(b"12345")
    (local / "tmp").mkdir()  # folders are not uploaded
    remote_cache.publish_split(URL, "train")
    assert remote.calls == ["put train/a.npy", "put train/z.npy", f"put train/{MANIFEST}"]


def test_a_download_fetches_what_is_missing_or_short_and_the_manifest_last(remote):
    assert remote_cache.fetch_split(URL, "train") is False  # nothing there: built here instead
    assert remote.calls == ["sizes train"]
    remote.held = {
        "train/a.npy": b"aaa",
        f"train/{MANIFEST}": b"{}",
        "train/b.npy": b"bbbb",
        "train/z.npy": b"z",
    }
    local = remote_cache.cache_root(URL) / "train"
    local.mkdir(parents=True)
    (local / "a.npy").write_bytes(b"aaa")  # here in full: kept
    (local / "b.npy").write_bytes(b"bb")  # cut short: fetched again
    remote.calls = []
    assert remote_cache.fetch_split(URL, "train") is True
    assert remote.calls == ["sizes train", "get train/b.npy", "get train/z.npy", f"get train/{MANIFEST}"]
    assert (local / "b.npy").read_bytes() == b"bbbb"
    remote.calls = []
    assert remote_cache.fetch_split(URL, "train") is True  # again: the manifest only, which may have changed
    assert remote.calls == ["sizes train", f"get train/{MANIFEST}"]
    remote.held = {"train/a.npy": b"aaa"}  # an upload stopped before its manifest
    assert remote_cache.fetch_split(URL, "other") is False
