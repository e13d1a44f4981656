"""Writes the storage refuses (a full disk, a read-only file system, no permission): one line that says
what was being written, where, how much it needed and what is safe; exit code 74; nothing lost.

The disk is a small tmpfs where one can be mounted (root, as on CI); elsewhere ENOSPC is injected at
the write, so the same checks run everywhere.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import leantrain as lt
from leantrain import files
from leantrain.checkpoint import export_checkpoint, load_checkpoint
from leantrain.cli import EXIT_STORAGE, main
from leantrain.data.cache import prepare_cache
from leantrain.errors import StorageError
from leantrain.files import atomic_write, check_folder
from leantrain.log.sinks import CSVSink
from tests.conftest import TinyClassifier
from tests.test_resume import assert_same_parameters, train


class SmallDisk:
    """A folder on a 4 MiB tmpfs (``mounted``), else a plain folder whose free space is made up."""

    def __init__(self, folder: Path, mounted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder, self.mounted, self.monkeypatch = folder, mounted, monkeypatch
        self.filler = folder / "filler"

    def fill(self, free_left: int = 2048) -> None:
        """Leave ``free_left`` bytes: a checkpoint no longer fits."""
        if self.mounted:
            stats = os.statvfs(self.folder)
            self.filler.write_bytes(b"\0" * (stats.f_bavail * stats.f_frsize - free_left))
        else:
            self.monkeypatch.setattr(files, "free_bytes", lambda path: free_left)

    def blind_free_space_check(self) -> None:
        """The free space is unknown: the write itself then fails, inside torch's or safetensors' writer."""
        self.monkeypatch.setattr(files, "free_bytes", lambda path: None)

    def free(self) -> None:
        self.monkeypatch.undo()
        self.filler.unlink(missing_ok=True)

    def needs_a_real_one(self) -> None:
        if not self.mounted:
            pytest.skip("a write that fails mid-file needs a tmpfs mount (root)")


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "disk"
    folder.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)]
    mounted = subprocess.run(command, capture_output=True).returncode == 0
    yield SmallDisk(folder, mounted, monkeypatch)
    if mounted:
        subprocess.run(["umount", "-l", str(folder)], check=True)


class FillDiskAfter:
    def __init__(self, disk: SmallDisk, step: int, blind: bool, saved: Path | None = None) -> None:
        self.disk, self.step, self.blind, self.saved = disk, step, blind, saved

    def on_step(self, stats: lt.StepStats) -> None:
        if stats.step == self.step:
            deadline = time.monotonic() + 30
            while self.saved is not None and not self.saved.exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # a save on its thread must not race the filler for the space
            self.disk.fill()
            if self.blind:
                self.disk.blind_free_space_check()


@pytest.mark.parametrize(
    ("blind", "background"),
    [(False, False), (True, False), (False, True)],
    ids=["checked-before-writing", "failed-while-writing", "written-on-a-thread"],
)
def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_run_resumes_exactly(
    tmp_path, small_disk, blind, background
):
    if blind:
        small_disk.needs_a_real_one()
    reference = train(tmp_path / "reference", checkpoint_every=4, log_every_n_steps=100)
    run_dir = small_disk.folder / "run"
    with pytest.raises(StorageError) as caught:  # a background write's failure: at the next save or the end
        filler = FillDiskAfter(small_disk, 5, blind, saved=run_dir / "checkpoints" / "step-00000004.pt")
        train(run_dir, [filler], checkpoint_every=4, log_every_n_steps=100, async_checkpoint=background)
    message = str(caught.value)
    assert "\n" not in message
    assert f"could not write checkpoint {run_dir / 'checkpoints' / 'step-00000008.pt'}" in message
    assert "needs" in message  # the checkpoint's size, known before writing
    if not blind:
        assert "not enough free space, nothing written" in message
    else:
        assert "No space left on device" in message
    good = run_dir / "checkpoints" / "step-00000004.pt"
    remedy = "free space or restore write access, then continue with --resume auto"
    assert message.endswith(f"; the last good checkpoint is {good}: {remedy}")
    assert load_checkpoint(good)["step"] == 4  # intact
    assert sorted(p.name for p in good.parent.iterdir()) == ["step-00000004.pt"]  # no torn file left
    small_disk.free()
    resumed = train(run_dir, checkpoint_every=4, log_every_n_steps=100, resume="auto")
    assert_same_parameters(reference.model, resumed.model)


def test_the_cli_says_it_in_one_line_with_its_own_exit_code(small_disk, capsys):
    small_disk.fill(free_left=8192)  # the run folder and its metrics fit, a checkpoint does not
    out = small_disk.folder / "run"
    code = main(["fit", "--task", "tests.conftest:TinyClassifier", "--max-steps", "2", "--global-batch-size",
                 "8", "--out", str(out), "--progress", "none", "--logger", "none"])  # fmt: skip
    error = capsys.readouterr().err.strip()
    assert code == EXIT_STORAGE == 74
    assert len(error.splitlines()) == 1, error
    assert error.startswith(f"leantrain: error: could not write checkpoint {out / 'checkpoints'}")
    assert error.endswith(
        "; no checkpoint was written yet: free space or restore write access, then start again"
    )


def test_a_refused_write_is_named_whoever_writes_it(tmp_path):
    def torch_like_write(tmp: Path) -> None:  # torch.save reports ENOSPC as RuntimeErrors around it
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 768576 vs 768468")  # noqa: B904 - as torch does

    with pytest.raises(StorageError, match=r"could not write weights .*w\.bin: No space left on device"):
        atomic_write(tmp_path / "w.bin", torch_like_write, "weights")
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone

    def forbidden(tmp: Path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    with pytest.raises(StorageError, match="Permission denied"):
        atomic_write(tmp_path / "w.bin", forbidden)

    def a_bug(tmp: Path) -> None:
        raise RuntimeError("not a storage problem")

    with pytest.raises(RuntimeError, match="not a storage problem"):  # other errors keep their type
        atomic_write(tmp_path / "w.bin", a_bug)


def test_the_refused_write_is_found_in_a_rust_message_and_a_chain_that_loops_ends():
    """safetensors words a full disk as a message ending "(os error 28)"; an exception chain can loop
    (an error raised as its own cause's context), and the search must still end."""
    found = files.storage_cause(RuntimeError("failed to write the file (os error 28)"))
    assert (type(found), found.errno, found.strerror) == (OSError, errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert files.storage_cause(RuntimeError("(os error 2)")) is None  # not found: no storage error
    first, second = RuntimeError("first"), RuntimeError("second")
    first.__cause__, second.__context__ = second, first
    answered = []
    searching = threading.Thread(target=lambda: answered.append(files.storage_cause(first)), daemon=True)
    searching.start()
    searching.join(timeout=10)  # the bug: around the loop forever
    assert answered == [None]


def test_the_storage_line_gives_the_size_needed_and_what_is_free_when_known(tmp_path, monkeypatch):
    from leantrain import files
    from leantrain.units import format_bytes

    target = tmp_path / "c.pt"
    assert files.storage_message("checkpoint", target, "Permission denied") == (
        f"could not write checkpoint {target}: Permission denied"
    )
    monkeypatch.setattr(files, "free_bytes", lambda path: 3 * 2**20)
    assert files.storage_message("checkpoint", target, "No space left on device", 5 * 2**30) == (
        f"could not write checkpoint {target}: No space left on device (needs {format_bytes(5 * 2**30)}, "
        "3.0 MiB free)"
    )
    monkeypatch.setattr(files, "free_bytes", lambda path: None)  # a file system that does not say
    assert files.storage_message("checkpoint", target, "No space", 2**30).endswith(
        ": No space (needs 1.0 GiB)"
    )


def test_a_read_only_file_system_is_refused_before_the_run(small_disk):
    small_disk.needs_a_real_one()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk.folder)], check=True)
    with pytest.raises(lt.ConfigError, match=r"out_dir=.*cannot be written \(Read-only file system\)"):
        check_folder(small_disk.folder / "run", "out_dir")


def test_a_full_disk_at_a_log_point_is_one_line_and_closing_the_log_does_not_hide_it(tmp_path, monkeypatch):
    written = []

    def write_then_fail(self, step, metrics):  # the metrics file's disk fills at step 3
        if step == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(step)

    def close_fails(self):  # flushing it when the run closes its log fails too (a second, other error)
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(CSVSink, "write", write_then_fail)
    monkeypatch.setattr(CSVSink, "close", close_fails)
    with pytest.raises(StorageError) as caught:
        train(tmp_path / "run", checkpoint_every=2, log_every_n_steps=1)
    assert written == [1, 2]
    message = str(caught.value)
    assert message.startswith(f"could not write metrics {tmp_path / 'run' / 'metrics.csv'}: No space left")
    assert f"the last good checkpoint is {tmp_path / 'run' / 'checkpoints' / 'step-00000002.pt'}" in message


def test_a_full_disk_when_the_weights_are_exported_at_the_end(small_disk):
    small_disk.needs_a_real_one()

    class FullAtTheEnd:
        def on_step(self, stats: lt.StepStats) -> None:
            if stats.step == 4:
                small_disk.fill(free_left=0)
                small_disk.blind_free_space_check()

    with pytest.raises(StorageError) as caught:
        train(small_disk.folder / "run", [FullAtTheEnd()], max_steps=4, checkpoint_every="never")
    assert "could not write weights" in str(caught.value)
    assert "No space left on device" in str(caught.value)
    assert str(caught.value).endswith(
        "; no checkpoint is kept (checkpoint_every never): the run must start again"
    )


@pytest.mark.parametrize("blind", [False, True], ids=["checked-before-writing", "failed-while-writing"])
def test_a_cache_that_does_not_fit_is_one_line_not_a_crash(small_disk, blind):
    # Writing into a memory-mapped file on a full disk kills the process (SIGBUS): the space is
    # reserved before any item is written, so a full disk is an error instead.
    if blind:  # room for the 10 KiB of items, not for the 4 pages of their two files: found mid-write
        small_disk.needs_a_real_one()
        small_disk.fill(free_left=3 * 4096)
        small_disk.blind_free_space_check()
    else:
        small_disk.fill(free_left=4096)  # TinyClassifier's cache needs 256 x 40 bytes
    folder = small_disk.folder / "cache" / "train"
    with pytest.raises(StorageError, match=rf"could not write cache {folder}: .*\(needs 10\.0 KiB"):
        prepare_cache(TinyClassifier().train_data(), folder, "tiny", "train_data")
    small_disk.free()
    cached, built = prepare_cache(TinyClassifier().train_data(), folder, "tiny", "train_data")
    assert built is not None and len(cached) == 256  # built once there is room


def test_an_export_into_a_file_path_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short relative path: the message cuts values at 80 characters
    train(tmp_path / "run", max_steps=2)
    Path("a_file").write_text("")
    with pytest.raises(lt.ConfigError, match=r"out='a_file': is a file; give a folder"):
        export_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000002.pt", Path("a_file") / "w.st")
