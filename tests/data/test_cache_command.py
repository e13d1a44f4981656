"""``leantrain cache``, run in this process: each split built with the workers asked for, found complete
the next time, at a URL uploaded by one machine and copied down by another; its refusals, one line each
naming the field. (The installed command: tests/e2e/test_cli.py.)"""

from __future__ import annotations

import errno
import re

import fsspec
import pytest
import torch
from torch.utils.data import TensorDataset

from leantrain import cli
from leantrain.cli import main
from leantrain.data.remote_cache import cache_root
from tests.conftest import RegressionTask

BUILT = r"built in \d+\.\d s with {} worker\(s\)"


class ValidationOnly(RegressionTask):
    """No training data, only validation data (1,024 items of two rows of 64 float64 values: 1.0 MiB): the
    cache holds the one split there is."""

    def train_data(self):
        return None

    def val_data(self):
        values = torch.arange(65536.0, dtype=torch.float64).reshape(1024, 64)
        return TensorDataset(values, torch.ones(1024, 64, dtype=torch.float64))


@pytest.fixture
def cache_in(tmp_path, monkeypatch, capsys):
    """``cache_in(*flags)``: ``leantrain cache`` in tmp_path (its lines unwrapped) -> (exit code, lines);
    ``calls`` holds what each split was given to build with: (folder, data name, workers)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "machine-a"))  # where a URL's local copy goes
    real = cli.prepare_cache

    def recorded(dataset, folder, source, name, num_workers=0):
        cache_in.calls.append((str(folder), name, num_workers))
        # Without the bound (the bug a test below makes), 100,000 worker processes would start here.
        assert isinstance(num_workers, int) and 0 <= num_workers <= 8, f"asked for {num_workers} workers"
        return real(dataset, folder, source, name, num_workers)

    monkeypatch.setattr(cli, "prepare_cache", recorded)

    def cache_in(*flags: str) -> tuple[int, list[str]]:
        code = main(["cache", *flags])
        printed = capsys.readouterr()
        return code, (printed.out if code == 0 else printed.err).splitlines()

    cache_in.calls = []
    return cache_in


def test_each_split_is_built_with_the_workers_asked_for_then_found_complete(cache_in, monkeypatch):
    asked = []
    monkeypatch.setattr(cli, "auto_workers", lambda processes_per_node: asked.append(processes_per_node) or 0)
    task = ["--task", "tests.data.test_cache_command:ValidationOnly"]
    code, built = cache_in(*task, "--out", "c")  # --num-workers auto: a share of the CPUs for one process
    assert code == 0 and asked == [1]
    assert len(built) == 1 and re.fullmatch(rf"c/val: 1,024 items, 1\.0 MiB, {BUILT.format(0)}", built[0])
    assert cache_in.calls == [("c/val", "val_data", 0)]  # no training data: nothing else is cached
    assert cache_in(*task, "--out", "c", "--num-workers", "1") == (
        0,
        ["c/val: 1,024 items, 1.0 MiB, already complete"],
    )

    # A task without validation data (RegressionTask has no val_data), on one worker process.
    code, built = cache_in("--task", "tests.conftest:RegressionTask", "--out", "d", "--num-workers", "1")
    assert code == 0 and len(built) == 1
    assert re.fullmatch(rf"d/train: 160 items, 0\.0 MiB, {BUILT.format(1)}", built[0])
    assert cache_in.calls[-1] == ("d/train", "train_data", 1)


def test_a_complete_cache_on_storage_that_takes_no_new_file_is_read(cache_in, monkeypatch):
    """A finished cache is only read: a folder that refuses new entries (read-only storage) is not refused."""
    task = ["--task", "tests.conftest:RegressionTask", "--num-workers", "0"]
    assert cache_in(*task, "--out", "c")[0] == 0

    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("leantrain.files.tempfile.TemporaryDirectory", refused)
    assert cache_in(*task, "--out", "c") == (0, ["c/train: 160 items, 0.0 MiB, already complete"])
    refusal = "invalid out='new': cannot be written (Read-only file system); give a folder you can write"
    assert cache_in(*task, "--out", "new") == (2, [f"leantrain: error: {refusal}"])


def test_a_cache_at_a_url_is_uploaded_by_one_machine_and_copied_down_by_another(
    cache_in, tmp_path, monkeypatch
):
    url = f"memory://{tmp_path.name}/cache"  # fsspec's in-memory storage, a real file system in this process
    try:
        task = ["--task", "tests.conftest:RegressionTask", "--num-workers", "0", "--out", url]
        code, built = cache_in(*task)
        local = cache_root(url) / "train"
        assert code == 0 and re.fullmatch(
            rf"{url}/train \(local copy {re.escape(str(local))}\): 160 items, 0\.0 MiB, {BUILT.format(0)}",
            built[0],
        )
        uploaded = fsspec.filesystem("memory").find(f"/{tmp_path.name}/cache/train")
        assert f"/{tmp_path.name}/cache/train/cache.json" in uploaded and len(uploaded) > 1  # with its arrays
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "machine-b"))
        copied = cache_root(url) / "train"
        assert copied != local
        expected = (
            f"{url}/train (local copy {copied}): 160 items, 0.0 MiB, already complete, copied to this machine"
        )
        assert cache_in(*task) == (0, [expected])
        assert cache_in.calls[-1] == (str(copied), "train_data", 0)
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--num-workers", "-1"], "invalid num_workers='-1': must be 0 or more, or auto"),
        (["--num-workers", "many"], "invalid num_workers='many': must be 0 or more, or auto"),
        (["--num-workers", "100000"], "invalid num_workers=100000: at most "),
        (["--out", "a_file"], "invalid out='a_file': is a file; give a folder"),
        (["--out", "s3://"], "invalid out='s3://': names no bucket or folder"),
        (["--out", "nosuch://bucket"], "invalid out='nosuch://bucket': is not a storage fsspec knows here"),
    ],
)
def test_a_bad_worker_count_or_folder_is_one_line_naming_it_and_nothing_is_built(
    cache_in, tmp_path, flags, error
):
    (tmp_path / "a_file").write_text("kept")
    code, said = cache_in("--task", "tests.conftest:RegressionTask", "--out", "c", *flags)
    assert code == 2 and len(said) == 1 and said[0].startswith(f"leantrain: error: {error}")
    assert cache_in.calls == [] and not (tmp_path / "c").exists()
    assert (tmp_path / "a_file").read_text() == "kept"
