"""A run folder at a URL (``remote.RemoteFolder``, ``run/mirror.py``) on fsspec's ``memory://`` storage: a
real fsspec file system in this process, so each test runs in milliseconds. A store that refuses is one
of its methods made to raise. (The same against an S3 API over HTTP: tests/test_object_storage.py.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import fsspec
import pytest
import torch

from leantrain.errors import ConfigError, StorageError
from leantrain.remote import RemoteFolder
from leantrain.run.mirror import STAGING_MARKER, MirroredCheckpoints, RunMirror


@pytest.fixture
def url(tmp_path):
    """A URL of its own for each test, emptied after it."""
    location = f"memory://{tmp_path.name}/run"
    yield location
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{tmp_path.name}"):
        fs.rm(f"/{tmp_path.name}", recursive=True)


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def state(step: int, **more) -> dict:
    return {"step": step, "weights": torch.full((4,), float(step)), **more}


def refuse_listing_after(fs, monkeypatch, calls: int) -> None:
    """``fs.find`` answers ``calls`` times, then refuses (permission)."""
    real = fs.find
    answered = []

    def find(path, *args, **kwargs):
        if len(answered) >= calls:
            raise PermissionError("denied")
        answered.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fs, "find", find)


# RemoteFolder


def test_a_read_at_its_limit_is_allowed(url):
    """Bug: `size >= limit` refused a manifest of exactly the bound."""
    folder = RemoteFolder(url)
    folder.put_bytes(b"0123456789", "x.json")
    assert folder.read_bytes("x.json", 10) == b"0123456789"


def test_a_read_over_its_limit_is_refused_naming_the_url_the_size_and_the_limit(url, monkeypatch):
    """Bug: an object larger than the limit read whole (the size not asked, or asked of the folder)."""
    folder = RemoteFolder(url)
    folder.put_bytes(b"0123456789X", "x.json")
    read = []
    monkeypatch.setattr(folder.fs, "cat_file", lambda *a, **k: read.append(a) or b"")
    with pytest.raises(StorageError) as refused:
        folder.read_bytes("x.json", 10)
    assert str(refused.value) == f"{url}/x.json holds 11 bytes, more than the 10 expected"
    assert read == []  # refused before a byte is read


def test_a_read_of_a_missing_object_is_one_line_naming_its_url(url):
    folder = RemoteFolder(url)
    with pytest.raises(StorageError) as refused:
        folder.read_bytes("missing.json", 10)
    message = str(refused.value)
    assert message.startswith(f"{url}/missing.json: could not read: not found (")


def test_a_read_the_store_refuses_is_one_line_naming_its_url_and_the_action(url, monkeypatch):
    folder = RemoteFolder(url)
    folder.put_bytes(b"{}", "x.json")

    def refuse(*args, **kwargs):
        raise TimeoutError("no answer")

    monkeypatch.setattr(folder.fs, "cat_file", refuse)
    with pytest.raises(StorageError) as refused:
        folder.read_bytes("x.json", 10)
    assert str(refused.value) == f"{url}/x.json: could not read (TimeoutError: no answer)"


def test_a_removal_the_store_refuses_names_the_first_file_and_the_action(url, monkeypatch):
    folder = RemoteFolder(url)
    folder.put_bytes(b"a", "a.txt")
    folder.put_bytes(b"b", "b.txt")

    def refuse(*args, **kwargs):
        raise PermissionError("denied")

    monkeypatch.setattr(folder.fs, "rm", refuse)
    with pytest.raises(StorageError) as refused:
        folder.remove(["a.txt", "b.txt"])
    assert str(refused.value) == f"{url}/a.txt: the storage refused to remove (permission: denied)"
    folder.remove([])  # nothing to remove: the store is not asked


def test_removed_files_are_gone_and_the_others_stay(url):
    folder = RemoteFolder(url)
    for name in ("a.txt", "b.txt", "c/d.txt"):
        folder.put_bytes(b"x", name)
    folder.remove(["a.txt", "c/d.txt"])
    assert folder.sizes() == {"b.txt": 1}


# RunMirror


def test_the_run_files_of_a_url_are_those_outside_its_checkpoints(url):
    """Bug: checkpoints listed (and downloaded by pull) as run files."""
    mirror = RunMirror(url, Path("unused"))
    mirror.remote.put_bytes(b"step\n", "metrics.csv")
    mirror.remote.put_bytes(b"123", "tb/events")
    mirror.remote.put_bytes(b"12345", "checkpoints/step-00000001.pt")
    mirror.remote.put_bytes(b"{}", "checkpoints/step-00000001.manifest.json")
    assert mirror.run_files() == {"metrics.csv": 5, "tb/events": 3}


def test_the_complete_steps_are_those_with_a_manifest_oldest_first(url):
    mirror = RunMirror(url, Path("unused"))
    for name in ("step-00000010.manifest.json", "step-00000002.manifest.json", "step-00000011.pt", "x.json"):
        mirror.remote.put_bytes(b"{}", f"checkpoints/{name}")
    mirror.remote.put_bytes(b"{}", "step-00000003.manifest.json")  # not in checkpoints/
    assert mirror.complete_steps() == [2, 10]
    assert mirror.held_markers() == ["checkpoints"]


def test_a_refused_listing_of_the_checkpoints_names_the_checkpoints_folder(url, monkeypatch):
    """Bug: the whole run folder listed to find the checkpoints (its URL named when refused)."""
    mirror = RunMirror(url, Path("unused"))
    mirror.remote.put_bytes(b"{}", "checkpoints/step-00000001.manifest.json")
    refuse_listing_after(mirror.remote.fs, monkeypatch, 0)
    with pytest.raises(StorageError) as refused:
        mirror.complete_steps()
    assert str(refused.value) == f"{url}/checkpoints: the storage refused to list (permission: denied)"


def make_staging(staging: Path, url: str) -> None:
    staging.mkdir(parents=True)
    (staging / STAGING_MARKER).write_text(url + "\n")


def test_pull_makes_the_staging_folder_a_copy_of_the_urls_run_files(tmp_path, url):
    """Bugs: stale files or empty folders of an earlier attempt left (folders removed before what they
    hold, the walk stopped at a hidden file), a folder holding a hidden file removed, weights downloaded."""
    staging = tmp_path / "staging"
    make_staging(staging, url)
    (staging / "a-stale.txt").write_text("old")
    (staging / "metrics.csv").write_text("old rows")
    (staging / "old" / "deep").mkdir(parents=True)
    (staging / "old" / "deep" / "stale.txt").write_text("old")
    (staging / "z").mkdir()
    (staging / "z" / ".partial").write_text("a temporary file: kept")
    mirror = RunMirror(url, staging)
    mirror.remote.put_bytes(b"step,loss\n", "metrics.csv")
    mirror.remote.put_bytes(b"events", "tb/run/events")
    mirror.remote.put_bytes(b"weights", "model.safetensors")
    mirror.remote.put_bytes(b"12345", "checkpoints/step-00000001.pt")
    mirror.remote.put_bytes(b"{}", "checkpoints/step-00000001.manifest.json")
    mirror.pull()
    assert files_under(staging) == {STAGING_MARKER, "metrics.csv", "tb/run/events", "z/.partial"}
    assert not (staging / "old").exists()
    assert (staging / "metrics.csv").read_text() == "step,loss\n"
    assert (staging / STAGING_MARKER).read_text() == url + "\n"


def test_files_pulled_are_not_uploaded_back(tmp_path, url, monkeypatch):
    """Bug: what pull downloaded not recorded as at the URL (every run file uploaded again)."""
    mirror = RunMirror(url, tmp_path / "staging")
    mirror.remote.put_bytes(b"step,loss\n", "metrics.csv")
    mirror.remote.put_bytes(b"events", "tb/events")
    mirror.pull()
    uploaded = []
    monkeypatch.setattr(mirror.remote, "put", lambda local, name: uploaded.append(name))
    mirror.push_run_files()
    assert uploaded == []


def test_pull_makes_a_staging_folder_whose_parents_do_not_exist(tmp_path, url):
    staging = tmp_path / "a" / "b" / "staging"
    mirror = RunMirror(url, staging)
    mirror.remote.put_bytes(b"rows", "metrics.csv")
    mirror.pull()
    assert files_under(staging) == {STAGING_MARKER, "metrics.csv"}


def test_a_staging_folder_of_another_url_is_refused_naming_that_url(tmp_path, url):
    staging = tmp_path / "staging"
    make_staging(staging, "memory://elsewhere/run")
    (staging / "metrics.csv").write_text("theirs")
    with pytest.raises(ConfigError) as refused:
        RunMirror(url, staging).pull()
    assert "holds the staging folder of memory://elsewhere/run; give an empty folder" in str(refused.value)
    assert (staging / "metrics.csv").read_text() == "theirs"


def test_a_folder_that_is_no_staging_folder_is_refused_and_left_alone(tmp_path, url):
    staging = tmp_path / "mine"
    staging.mkdir()
    (staging / "thesis.tex").write_text("mine")
    with pytest.raises(ConfigError) as refused:
        RunMirror(url, staging).pull()
    assert "holds files that are not a staging folder; give an empty folder" in str(refused.value)
    assert files_under(staging) == {"thesis.tex"}


def test_push_uploads_run_files_once_each_then_only_the_changed_ones(tmp_path, url, monkeypatch):
    """Bugs: hidden files (temporary files, the marker) or checkpoints uploaded, folders passed as files,
    unchanged files uploaded again."""
    staging = tmp_path / "staging"
    mirror = RunMirror(url, staging)
    mirror.pull()
    (staging / "metrics.csv").write_text("step\n1\n")
    (staging / ".metrics.csv.tmp-1").write_text("partial")
    (staging / "tb").mkdir()
    (staging / "tb" / "events").write_text("e")
    (staging / "tb" / ".hidden").mkdir()
    (staging / "tb" / ".hidden" / "x").write_text("h")
    (staging / "checkpoints").mkdir()
    (staging / "checkpoints" / "step-00000001.pt").write_text("weights")
    uploaded = []
    real = mirror.remote.put
    monkeypatch.setattr(mirror.remote, "put", lambda local, name: uploaded.append(name) or real(local, name))
    mirror.push_run_files()
    assert uploaded == ["metrics.csv", "tb/events"]
    assert mirror.remote.sizes() == {"metrics.csv": 7, "tb/events": 1}
    mirror.push_run_files()
    assert uploaded == ["metrics.csv", "tb/events"]  # nothing changed: nothing uploaded
    (staging / "metrics.csv").write_text("step\n1\n2\n")
    mirror.push_run_files()
    assert uploaded == ["metrics.csv", "tb/events", "metrics.csv"]
    assert mirror.remote.sizes()["metrics.csv"] == 9


# MirroredCheckpoints


def checkpoints_at(url: str, staging: Path, keep: int = 2) -> MirroredCheckpoints:
    return MirroredCheckpoints(RunMirror(url, staging), keep)


def test_a_saves_manifest_lists_its_file_and_size_and_comes_last(tmp_path, url, monkeypatch):
    """Bug: the manifest's keys renamed, or written on one line (indent)."""
    saved = checkpoints_at(url, tmp_path / "staging")
    written = []
    real = saved.mirror.remote.put_bytes
    monkeypatch.setattr(
        saved.mirror.remote, "put_bytes", lambda data, name: written.append(name) or real(data, name)
    )
    path = saved.save(3, state(3))
    size = path.stat().st_size
    assert size > 0
    manifest = saved.mirror.remote.read_bytes("checkpoints/step-00000003.manifest.json", 1 << 20)
    expected = f'{{\n "step": 3,\n "objects": {{\n  "checkpoints/step-00000003.pt": {size}\n }}\n}}'
    assert manifest.decode() == expected
    assert written == ["checkpoints/step-00000003.manifest.json"]
    assert saved.mirror.remote.sizes("checkpoints")["checkpoints/step-00000003.pt"] == size


def test_a_save_makes_the_staging_folder_when_its_parents_do_not_exist(tmp_path, url):
    saved = checkpoints_at(url, tmp_path / "new" / "staging")
    path = saved.save(1, state(1))
    assert path == tmp_path / "new" / "staging" / "checkpoints" / "step-00000001.pt"
    assert saved.mirror.complete_steps() == [1]


def test_staging_keeps_only_the_newest_checkpoint_file(tmp_path, url):
    """Bugs: older files kept (the pattern missed them), or the one just saved removed."""
    saved = checkpoints_at(url, tmp_path / "staging", keep=3)
    (tmp_path / "staging" / "checkpoints").mkdir(parents=True)
    (tmp_path / "staging" / "checkpoints" / "notes.txt").write_text("not a checkpoint")
    saved.save(1, state(1))
    saved.save(2, state(2))
    assert files_under(tmp_path / "staging" / "checkpoints") == {"step-00000002.pt", "notes.txt"}
    assert saved.mirror.complete_steps() == [1, 2]


def test_a_stale_checkpoint_file_removed_meanwhile_does_not_fail_the_save(tmp_path, url, monkeypatch):
    """Bug: `unlink(missing_ok=False)`: a file listed, then removed by another process, ends the run."""
    saved = checkpoints_at(url, tmp_path / "staging", keep=3)
    saved.save(1, state(1))
    real = Path.glob

    def glob_then_lose_the_old_ones(self, pattern):
        for found in list(real(self, pattern)):
            if pattern == "step-*.pt" and found.name != "step-00000002.pt":
                found.unlink()  # another process removed it after it was listed
            yield found

    monkeypatch.setattr(Path, "glob", glob_then_lose_the_old_ones)
    path = saved.save(2, state(2))
    assert path.is_file()
    assert saved.mirror.complete_steps() == [1, 2]


def put_shards(remote: RemoteFolder, step: int, metadata: bool = True) -> None:
    folder = f"checkpoints/step-{step:08d}.dcp"
    remote.put_bytes(b"shard-0", f"{folder}/__0_0.distcp")
    remote.put_bytes(b"shard-1!", f"{folder}/__1_0.distcp")
    if metadata:
        remote.put_bytes(b"meta!", f"{folder}/.metadata")


def test_a_sharded_checkpoints_manifest_lists_its_shards_and_its_file(tmp_path, url):
    """Bugs: the shards left out of the manifest (the state's key misread), or only they listed."""
    saved = checkpoints_at(url, tmp_path / "staging")
    put_shards(saved.mirror.remote, 2)
    path = saved.save(2, state(2, sharded="step-00000002.dcp"))
    manifest = json.loads(saved.mirror.remote.read_bytes("checkpoints/step-00000002.manifest.json", 1 << 20))
    assert manifest == {
        "step": 2,
        "objects": {
            "checkpoints/step-00000002.pt": path.stat().st_size,
            "checkpoints/step-00000002.dcp/__0_0.distcp": 7,
            "checkpoints/step-00000002.dcp/__1_0.distcp": 8,
            "checkpoints/step-00000002.dcp/.metadata": 5,
        },
    }


def test_shards_without_their_metadata_are_refused_naming_their_folder(tmp_path, url):
    """Bug: a sharded checkpoint whose .metadata never arrived made complete (unloadable when resumed)."""
    saved = checkpoints_at(url, tmp_path / "staging")
    put_shards(saved.mirror.remote, 4, metadata=False)
    with pytest.raises(StorageError) as refused:
        saved.save(4, state(4, sharded="step-00000004.dcp"))
    assert str(refused.value) == f"{url}/checkpoints/step-00000004.dcp: the shards' .metadata was not written"
    assert saved.mirror.complete_steps() == []


def test_rotation_keeps_the_newest_complete_and_the_protected_checkpoints(tmp_path, url):
    """Bug: a protected checkpoint (the best by a metric) removed with the old ones."""
    saved = checkpoints_at(url, tmp_path / "staging", keep=1)
    saved.protected = {1}
    saved.save(1, state(1))
    saved.save(2, state(2))
    saved.mirror.remote.put_bytes(b"half", "checkpoints/step-00000003.pt")  # killed mid-upload: incomplete
    saved.mirror.remote.put_bytes(b"later", "checkpoints/step-00000009.pt")  # another writer's, newer: kept
    saved.save(4, state(4))
    assert saved.mirror.complete_steps() == [1, 4]
    assert sorted(saved.mirror.remote.sizes("checkpoints")) == [
        "checkpoints/step-00000001.manifest.json",
        "checkpoints/step-00000001.pt",
        "checkpoints/step-00000004.manifest.json",
        "checkpoints/step-00000004.pt",
        "checkpoints/step-00000009.pt",
    ]


def test_rotation_removes_a_manifest_before_its_objects(tmp_path, url, monkeypatch):
    """Bug: a manifest removed in the same call as its objects (a removal cut short between them leaves
    a manifest naming objects that are gone)."""
    saved = checkpoints_at(url, tmp_path / "staging", keep=1)
    saved.save(1, state(1))
    fs = saved.mirror.remote.fs
    removed = []
    real = fs.rm
    monkeypatch.setattr(fs, "rm", lambda paths, *a, **k: removed.append(list(paths)) or real(paths, *a, **k))
    saved.save(2, state(2))
    root = f"/{tmp_path.name}/run/checkpoints"
    assert removed == [[f"{root}/step-00000001.manifest.json"], [f"{root}/step-00000001.pt"]]
    assert saved.mirror.complete_steps() == [2]


def test_a_refused_listing_during_rotation_names_the_checkpoints_folder(tmp_path, url, monkeypatch):
    """Bug: rotation listed the whole run folder for stale checkpoint objects."""
    saved = checkpoints_at(url, tmp_path / "staging")
    refuse_listing_after(saved.mirror.remote.fs, monkeypatch, 1)  # complete_steps' listing answers
    with pytest.raises(StorageError) as refused:
        saved.save(1, state(1))
    assert str(refused.value) == f"{url}/checkpoints: the storage refused to list (permission: denied)"


def test_the_newest_complete_checkpoint_is_fetched_and_loaded(tmp_path, url):
    saved = checkpoints_at(url, tmp_path / "staging")
    saved.save(1, state(1))
    saved.save(2, state(2))
    elsewhere = checkpoints_at(url, tmp_path / "other-machine")
    warned = []
    path, loaded = elsewhere.newest_valid(warned.append)
    assert path == tmp_path / "other-machine" / "checkpoints" / "step-00000002.pt"
    assert loaded["step"] == 2 and torch.equal(loaded["weights"], torch.full((4,), 2.0))
    assert warned == []


@pytest.mark.parametrize(
    ("manifest", "reason"),
    [(b"{not json", "JSONDecodeError"), (b'{"step": 2}', "KeyError"), (b'{"objects": []}', "AttributeError")],
)
def test_an_unreadable_manifest_is_skipped_naming_it_and_why(tmp_path, url, manifest, reason):
    """Bug: the reason in the warning lost (None, or the type of None)."""
    saved = checkpoints_at(url, tmp_path / "staging")
    saved.save(1, state(1))
    saved.save(2, state(2))
    saved.mirror.remote.put_bytes(manifest, "checkpoints/step-00000002.manifest.json")
    warned = []
    path, loaded = checkpoints_at(url, tmp_path / "other").newest_valid(warned.append)
    assert loaded["step"] == 1 and path.name == "step-00000001.pt"
    assert warned == [
        f"skipping checkpoint manifest {url}/checkpoints/step-00000002.manifest.json is unreadable ({reason})"
    ]


def test_a_checkpoint_whose_object_differs_from_its_manifest_is_skipped_naming_the_object(tmp_path, url):
    """Bug: the warning lost the object's URL (or its words)."""
    saved = checkpoints_at(url, tmp_path / "staging")
    saved.save(1, state(1))
    saved.save(2, state(2))
    saved.mirror.remote.put_bytes(b"truncated", "checkpoints/step-00000002.pt")
    warned = []
    _, loaded = checkpoints_at(url, tmp_path / "other").newest_valid(warned.append)
    assert loaded["step"] == 1
    assert warned == [f"skipping checkpoint {url}/checkpoints/step-00000002.pt is missing or incomplete"]
    saved.mirror.remote.remove(["checkpoints/step-00000001.pt"])
    assert checkpoints_at(url, tmp_path / "third").newest_valid(warned.append) is None
    assert warned[1:] == [
        f"skipping checkpoint {url}/checkpoints/step-00000002.pt is missing or incomplete",
        f"skipping checkpoint {url}/checkpoints/step-00000001.pt is missing or incomplete",
    ]


def test_a_refused_listing_while_fetching_names_the_checkpoints_folder(tmp_path, url, monkeypatch):
    """Bug: the whole run folder listed to check a checkpoint's objects."""
    saved = checkpoints_at(url, tmp_path / "staging")
    saved.save(1, state(1))
    elsewhere = checkpoints_at(url, tmp_path / "other")
    refuse_listing_after(elsewhere.mirror.remote.fs, monkeypatch, 1)  # complete_steps' listing answers
    warned = []
    assert elsewhere.newest_valid(warned.append) is None
    assert warned == [f"skipping {url}/checkpoints: the storage refused to list (permission: denied)"]


def test_a_download_of_a_missing_object_is_one_line_naming_its_url_and_leaves_no_file(tmp_path, url):
    folder = RemoteFolder(url)
    with pytest.raises(StorageError) as refused:
        folder.get("checkpoints/step-00000002.pt", tmp_path / "local" / "step.pt")
    assert str(refused.value).startswith(f"{url}/checkpoints/step-00000002.pt: could not read: not found (")
    assert list((tmp_path / "local").iterdir()) == []  # nor its partial download


def test_a_url_is_checked_for_its_package_its_scheme_and_a_bucket_before_anything_starts():
    """Bugs: the missing package or the field not named, the scheme read from past a second "://", a URL
    of slashes alone taken for a bucket."""
    from leantrain.remote import check_url

    if importlib.util.find_spec("gcsfs") is None:  # not among leantrain's test dependencies
        with pytest.raises(ConfigError) as refused:
            check_url("gs://bucket/run", "out_dir")
        assert str(refused.value) == (
            "invalid out_dir='gs://bucket/run': needs the gcsfs package: pip install 'leantrain[gcs]'"
        )
    check_url("memory://bucket/run://in-a-name", "out_dir")  # the scheme is before the first "://"
    check_url("MEMORY://bucket", "out_dir")
    with pytest.raises(ConfigError) as refused:
        check_url("memory:///", "cache")
    assert str(refused.value) == "invalid cache='memory:///': names no bucket or folder"
