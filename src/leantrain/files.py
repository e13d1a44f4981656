"""Writing files so that a crash never leaves a half-written one behind, and checking before a run
that the places it will write to can be written."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from leantrain.errors import ConfigError, StorageError
from leantrain.units import format_bytes

# The errors of a storage that refuses a write, whoever writes (Python, or torch's C++ writer).
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})


# How Rust libraries (safetensors) end the message of an I/O error: "... (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)\s*$")


def storage_cause(error: BaseException) -> OSError | None:
    """The refused write behind ``error``: torch.save reports a full disk as RuntimeErrors
    ("unexpected pos") with the OSError further down the chain; safetensors as a message."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
            return current
        rust = _RUST_OS_ERROR.search(str(current))
        if rust and int(rust.group(1)) in STORAGE_ERRNOS:
            return OSError(int(rust.group(1)), os.strerror(int(rust.group(1))))
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system of ``path`` (its nearest existing ancestor); None if unknown."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def storage_message(what: str, path: Path, reason: str, needed: int | None = None) -> str:
    """``could not write checkpoint P: No space left on device (needs 1.2 GiB, 3.0 MiB free)``."""
    sizes = ""
    if needed is not None:
        free = free_bytes(path)
        room = "" if free is None else f", {format_bytes(free)} free"
        sizes = f" (needs {format_bytes(needed)}{room})"
    return f"could not write {what} {path}: {reason}{sizes}"


def check_room(what: str, path: Path, needed: int) -> None:
    """StorageError, before anything is written, when ``needed`` bytes exceed the free space at ``path``."""
    free = free_bytes(path)
    if free is not None and needed > free:
        raise StorageError(storage_message(what, path, "not enough free space, nothing written", needed))


@contextmanager
def writing(what: str, path: Path, needed: int | None = None) -> Iterator[None]:
    """Turn a write that the storage refuses into a one-line :class:`StorageError`; others pass."""
    try:
        yield
    except StorageError:
        raise
    except Exception as error:
        cause = storage_cause(error)
        if cause is None:
            raise
        reason = cause.strerror or os.strerror(cause.errno or 0)
        raise StorageError(storage_message(what, path, reason, needed)) from error


def umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it: a file another thread
    creates meanwhile would get the wrong mode). Linux shows it in /proc; elsewhere, the one at import."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _UMASK_AT_IMPORT


_UMASK_AT_IMPORT = os.umask(0o022)
os.umask(_UMASK_AT_IMPORT)


def as_the_umask_says(path: Path) -> None:
    """``path`` readable as any new file of this process would be: some writers (safetensors')
    create files readable by their owner only, whatever the umask. Best effort: a file system
    without modes (some network mounts) refuses it, and the file is written all the same."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~umask())


def atomic_write(
    path: Path, write: Callable[[Path], None], what: str = "file", needed: int | None = None
) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    The rename is atomic within one file system: readers see the old file or the new
    one, never a torn one. The folder is fsynced so that the rename itself survives a
    power loss. ``needed`` (bytes, when known in advance) is checked against the free space
    first, so that nothing is written when it cannot fit; a refused write is a StorageError. The
    file's mode follows the umask, whoever wrote it (teammates read the weights on a shared cluster).
    """
    path = Path(path)
    if needed is not None:
        check_room(what, path, needed)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(what, path, needed):
        try:
            write(tmp)
            as_the_umask_says(tmp)
            with tmp.open("rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n"))


def check_folder(path: Path | str, field: str, writable: bool = True) -> None:
    """ConfigError naming ``field`` unless ``path`` is a folder that takes new files, or can be made one.

    ``writable=False``: an existing folder is enough (it is only read, like a finished cache). The
    check is tried for real (a temporary folder made and removed in the nearest existing ancestor):
    file systems such as /proc refuse a new entry that permission bits would allow.
    """
    if "\0" in str(path):
        raise ConfigError(field, str(path), "contains a NUL character, which no path may hold")
    path = Path(path)
    try:
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            where = "is a file" if existing == path else f"is inside {existing}, which is a file"
            raise ConfigError(field, str(path), f"{where}; give a folder")
        if writable or existing != path:
            tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(
            field, str(path), f"cannot be written ({reason}); give a folder you can write"
        ) from error
