"""A run folder in object storage (``--out s3://bucket/run``): a local staging folder, mirrored.

Everything a run writes goes to a local staging folder first, as for any run (the log, metrics.csv,
TensorBoard events and trackers' files need a file system); the URL is the durable copy:

- A checkpoint's file is written locally, then uploaded; a sharded checkpoint's shards go straight
  to the URL (every process writes its own, DCP's ``.metadata`` last). A small manifest,
  ``checkpoints/step-N.manifest.json`` (every object of the checkpoint and its size), is uploaded
  after all of them: a checkpoint without its manifest does not exist for ``--resume auto``, so a
  process killed mid-upload leaves the previous checkpoint the one resumed. Rotation removes a
  manifest before its objects, and never the newest complete checkpoint. Uploads run where saves
  run: on the background save thread with ``--async-checkpoint`` (the default).
- The run's other files are uploaded after each checkpoint and at the end, so the URL's metrics.csv
  covers its newest checkpoint. A run started on another machine first copies them from the URL.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leantrain.checkpoint import (
    SHARDS_SUFFIX,
    CheckpointFolder,
    checkpoint_name,
    load_checkpoint,
    save_checkpoint,
)
from leantrain.errors import CheckpointError, ConfigError, StorageError
from leantrain.files import check_folder
from leantrain.remote import RemoteFolder, is_url, local_copy_folder

CHECKPOINTS = "checkpoints"
_MANIFEST = re.compile(r"checkpoints/step-(\d+)\.manifest\.json")
MANIFEST_LIMIT = 4 << 20  # bytes: a manifest lists a few thousand objects at most
STAGING_MARKER = ".leantrain-staging"  # in a staging folder: the URL it stages
MARKERS = ("metrics.csv", "summary.json")  # the files that say the folder holds a run (see preflight)


def default_staging(url: str) -> Path:
    """Where a run at ``url`` is staged unless ``--staging-dir`` says: one folder per URL, so a run
    resumed on the same machine finds its files."""
    return local_copy_folder(url, "staging")


def manifest_name(step: int) -> str:
    return f"{CHECKPOINTS}/{checkpoint_name(step).replace('.pt', '.manifest.json')}"


class RunMirror:
    """The run folder's durable copy at ``url``, and its local staging folder."""

    def __init__(self, url: str, staging: Path) -> None:
        self.remote = RemoteFolder(url)
        self.url = self.remote.url
        self.staging = staging
        self._pushed: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) last uploaded

    def run_files(self) -> dict[str, int]:
        """The URL's files other than checkpoints -> their sizes."""
        return {n: s for n, s in self.remote.sizes().items() if not n.startswith(CHECKPOINTS + "/")}

    def complete_steps(self) -> list[int]:
        """The steps of the checkpoints whose manifest was uploaded, oldest first."""
        names = self.remote.sizes(CHECKPOINTS)
        return sorted(int(m.group(1)) for name in names if (m := _MANIFEST.fullmatch(name)))

    def held_markers(self) -> list[str]:
        """What at the URL says it holds a run (the names preflight reports)."""
        held = [name for name in MARKERS if name in self.run_files()]
        return held + ([CHECKPOINTS] if self.complete_steps() else [])

    def pull(self) -> None:
        """Make the staging folder a copy of the URL's run files (the remote is the truth: files of an
        earlier attempt that never reached it are removed). Weights (``*.safetensors``) are outputs the
        run writes again: their copies at the URL stay until it does, and none is downloaded (nor could
        a stale one be uploaded back). Checkpoints are fetched when resumed."""
        self._claim_staging()
        for path in sorted(self.staging.rglob("*"), reverse=True):
            if _hidden(path.relative_to(self.staging).as_posix()):
                continue
            if path.is_file():
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        for name in self.run_files():
            if not name.endswith(".safetensors"):
                local = self.staging / name
                self.remote.get(name, local)
                self._pushed[name] = _stamp(local)

    def _claim_staging(self) -> None:
        """The staging folder, made or found marked as this URL's: files are removed from it, so a
        folder holding anything else (a mistyped ``--staging-dir``) is refused before one is touched."""
        marker = self.staging / STAGING_MARKER
        if self.staging.is_dir() and any(self.staging.iterdir()):
            owner = marker.read_text().strip() if marker.is_file() else None
            if owner != self.url:
                whose = f"the staging folder of {owner}" if owner else "files that are not a staging folder"
                raise ConfigError(
                    "staging_dir", str(self.staging), f"holds {whose}; give an empty folder or this "
                    f"run's (nothing in it was changed)",
                )  # fmt: skip
        self.staging.mkdir(parents=True, exist_ok=True)
        marker.write_text(self.url + "\n")

    def push_run_files(self) -> None:
        """Upload the staging folder's files that changed since their last upload (not checkpoints,
        not temporary files)."""
        for path in sorted(self.staging.rglob("*")):
            name = path.relative_to(self.staging).as_posix()
            if not path.is_file() or _hidden(name) or name.startswith(CHECKPOINTS + "/"):
                continue
            stamp = _stamp(path)
            if self._pushed.get(name) != stamp:
                self.remote.put(path, name)
                self._pushed[name] = stamp


def _hidden(name: str) -> bool:
    """Temporary files of atomic writes, the staging marker, a downloaded ``--resume`` checkpoint."""
    return any(part.startswith(".") for part in Path(name).parts)


def _stamp(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns


class MirroredCheckpoints(CheckpointFolder):
    """The checkpoints of a run at a URL: saved locally, uploaded with a manifest last, resumed from
    the newest complete manifest. ``protected`` and ``keep`` apply to the URL's copies."""

    def __init__(self, mirror: RunMirror, keep: int) -> None:
        super().__init__(mirror.staging / CHECKPOINTS, keep)
        self.mirror = mirror

    def shard_folder(self, step: int) -> Any:
        """The shards go straight to the URL (a str: ``Path`` would fold ``s3://`` into ``s3:/``)."""
        return self.mirror.remote.url_of(_shards_name(step))

    def shards_of(self, checkpoint: Path, name: str) -> Any:
        """At the URL for a checkpoint of this run (fetched by ``newest_valid``); beside the file for
        another (``--resume PATH``, or a URL's checkpoint downloaded with its shards)."""
        if checkpoint.parent != self.folder:
            return super().shards_of(checkpoint, name)
        return self.mirror.remote.url_of(f"{CHECKPOINTS}/{name}")

    def files(self) -> list[Path]:
        """The complete checkpoints at the URL, oldest first (as the staging paths they load from)."""
        return [self.folder / checkpoint_name(step) for step in self.mirror.complete_steps()]

    def describe(self, path: Path) -> str:
        return self.mirror.remote.url_of(f"{CHECKPOINTS}/{path.name}")

    def save(self, step: int, state: dict[str, Any]) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / checkpoint_name(step)
        save_checkpoint(path, state)
        remote = self.mirror.remote
        name = f"{CHECKPOINTS}/{path.name}"
        remote.put(path, name)
        objects = {name: path.stat().st_size}
        if state.get("sharded"):
            objects |= remote.sizes(f"{CHECKPOINTS}/{state['sharded']}")
            if f"{CHECKPOINTS}/{state['sharded']}/.metadata" not in objects:
                raise StorageError(
                    f"{remote.url_of(_shards_name(step))}: the shards' .metadata was not written"
                )
        manifest = {"step": step, "objects": objects}
        remote.put_bytes(json.dumps(manifest, indent=1).encode(), manifest_name(step))
        for old in self.folder.glob("step-*.pt"):  # the URL holds them: staging keeps the newest only
            if old != path:
                old.unlink(missing_ok=True)
        self._rotate(step)
        return path

    def _rotate(self, newest: int) -> None:
        """The newest ``keep`` complete checkpoints and the protected ones stay; a manifest goes before
        its objects. Objects of older saves that never completed (killed mid-upload) go too."""
        steps = self.mirror.complete_steps()
        keep = set(steps[-self.keep :]) | (self.protected & set(steps)) | {newest}
        remote = self.mirror.remote
        remote.remove([manifest_name(step) for step in steps if step not in keep])
        stale = []
        for name in remote.sizes(CHECKPOINTS):
            found = re.match(r"checkpoints/step-(\d+)", name)
            if found and int(found.group(1)) < newest and int(found.group(1)) not in keep:
                stale.append(name)
        remote.remove(stale)

    def newest_valid(self, warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete checkpoint at the URL that loads, fetched into the staging folder."""
        for step in reversed(self.mirror.complete_steps()):
            try:
                return self._fetch(step)
            except (CheckpointError, StorageError) as error:
                warn(f"skipping {error}")
        return None

    def _fetch(self, step: int) -> tuple[Path, dict[str, Any]]:
        remote = self.mirror.remote
        try:
            manifest = json.loads(remote.read_bytes(manifest_name(step), MANIFEST_LIMIT))
            objects = {str(name): int(size) for name, size in manifest["objects"].items()}
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as error:
            where = remote.url_of(manifest_name(step))
            reason = type(error).__name__
            raise CheckpointError(f"checkpoint manifest {where} is unreadable ({reason})") from None
        present = remote.sizes(CHECKPOINTS)
        for name, size in objects.items():
            if present.get(name) != size:
                raise CheckpointError(f"checkpoint {remote.url_of(name)} is missing or incomplete")
        path = self.folder / checkpoint_name(step)
        remote.get(f"{CHECKPOINTS}/{path.name}", path)
        return path, load_checkpoint(path)


def fetch_checkpoint(url: str, into: Path) -> Path:
    """A checkpoint named by URL (``--resume``, ``export``) downloaded into the folder ``into``, with its
    shards when it has them (read here whole: ``--resume auto`` of a run at a URL reads them in place)."""
    parent, name = url.rstrip("/").rsplit("/", 1)
    remote = RemoteFolder(parent)
    path = into / name
    remote.get(name, path)
    shards = load_checkpoint(path).get("sharded")
    if shards:
        for shard in remote.sizes(shards):
            remote.get(shard, into / shard)
    return path


def exported(checkpoint: str, out: str, export: Callable[[Path, Path], Path]) -> str:
    """``export(checkpoint, out)`` where either may be a URL: a checkpoint at a URL is read from a
    local copy, an ``out`` at a URL written locally first, then uploaded (a file: ``out`` ending in
    .safetensors; otherwise a folder). Returns what was written."""
    with tempfile.TemporaryDirectory(prefix="leantrain-export-") as scratch:
        source = Path(checkpoint)
        if is_url(checkpoint):
            source = fetch_checkpoint(checkpoint, Path(scratch) / "in")
        if not is_url(out):
            return str(export(source, Path(out)))
        if out.endswith(".safetensors"):
            parent, name = out.rsplit("/", 1)
            RemoteFolder(parent).put(export(source, Path(scratch) / name), name)
            return out
        folder = Path(scratch) / "out"
        folder.mkdir()
        written = export(source, folder)
        target = RemoteFolder(out)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            target.put(path, path.relative_to(folder).as_posix())
        return target.url_of(written.name) if written.is_file() else target.url


def _shards_name(step: int) -> str:
    return f"{CHECKPOINTS}/{checkpoint_name(step).replace('.pt', SHARDS_SUFFIX)}"


def open_mirror(out_dir: str | None, staging_dir: str | None, is_main: bool) -> RunMirror | None:
    """The mirror of a run whose ``out_dir`` is a URL (None for a local folder); the main process
    copies the URL's run files into the staging folder first."""
    if not is_url(out_dir):
        return None
    assert out_dir is not None
    staging = Path(staging_dir) if staging_dir else default_staging(out_dir)
    check_folder(staging, "staging_dir")
    mirror = RunMirror(out_dir, staging)
    if is_main:
        mirror.remote.check_writable()
        mirror.pull()
    return mirror
