"""Object storage (S3, GCS, Azure Blob, any fsspec file system) behind a few bounded calls.

A run whose ``--out`` is a URL writes its files to a local staging folder as any run does, and
``run/mirror.py`` copies them to the URL; checkpoints are read back from it. This module is the only
place that talks to the store: every call has a connect and a read timeout (a store that accepts
and never answers is an error after the bound, not a hang), and a store that refuses (no such
bucket, no permission, a quota) is one :class:`StorageError` line naming the URL.

Credentials come from where each library looks for them (for S3: ``AWS_*`` environment variables,
``~/.aws``, an instance role; ``AWS_ENDPOINT_URL`` points at another S3 service such as MinIO); they
are never logged. The libraries are extras: ``pip install 'leantrain[s3]'`` (``gcs``, ``azure``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from leantrain.errors import ConfigError, StorageError, one_line

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# The package that serves each scheme, and the leantrain extra that installs it.
PACKAGES = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}
CONNECT_SECONDS = 10  # to open a connection to the store
READ_SECONDS = 30  # the longest wait for the next bytes of a response (not a total: uploads are long)
ATTEMPTS = 3  # a request that timed out or failed transiently, tried this many times in all
# So a store that accepts connections and never answers fails a request after about 90 s.


def is_url(location: str | Path | None) -> bool:
    """True for ``scheme://...`` other than ``file://`` (a local path is not a URL)."""
    found = _SCHEME.match(str(location)) if isinstance(location, str) else None
    return found is not None and found.group(1).lower() != "file"


def local_copy_folder(url: str, kind: str) -> Path:
    """Where this machine keeps its copy of what is at ``url``: one folder per URL under
    ``~/.cache/leantrain/<kind>`` (``$XDG_CACHE_HOME`` honoured), named so a person can tell which."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leantrain" / kind
    url = url.rstrip("/")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", url.rsplit("/", 1)[-1]) or "root"
    return base / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def _bounded_options(scheme: str) -> dict[str, Any]:
    """The timeouts each library takes (their defaults wait minutes, or forever, on a silent server)."""
    if scheme in ("s3", "s3a"):
        return {
            "config_kwargs": {
                "connect_timeout": CONNECT_SECONDS,
                "read_timeout": READ_SECONDS,
                "retries": {"max_attempts": 1, "mode": "standard"},  # s3fs retries (below)
            }
        }
    if scheme in ("gs", "gcs"):
        # gcsfs hands it to aiohttp per request; a bare number there would be a *total* per request,
        # which a large upload part on a slow link outlasts. Bounded like botocore's: connect, then
        # the wait for each read of the response.
        import aiohttp

        bound = aiohttp.ClientTimeout(sock_connect=CONNECT_SECONDS, sock_read=READ_SECONDS)
        return {"requests_timeout": bound}
    if scheme in ("az", "abfs", "abfss"):
        return {"connection_timeout": CONNECT_SECONDS, "read_timeout": READ_SECONDS}
    return {}


def check_url(url: str, field: str) -> None:
    """ConfigError naming ``field`` unless ``url``'s scheme is one fsspec serves here (its package
    installed): checked before anything starts."""
    scheme = url.split("://", 1)[0].lower()
    package, extra = PACKAGES.get(scheme, (None, None))
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(field, url, f"needs the {package} package: pip install 'leantrain[{extra}]'")
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as error:
        raise ConfigError(field, url, f"is not a storage fsspec knows here ({error})") from None
    if not url.split("://", 1)[1].strip("/"):
        raise ConfigError(field, url, "names no bucket or folder")


class RemoteFolder:
    """A folder at a URL: files put, got, listed and removed, each call bounded and its refusal one line."""

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        scheme = self.url.split("://", 1)[0].lower()
        with self._refused("open"):
            self.fs, self.root = url_to_fs(self.url, **_bounded_options(scheme))
        if hasattr(self.fs, "retries"):  # s3fs retries each request itself (5 times by default)
            self.fs.retries = ATTEMPTS
        self.root = self.root.rstrip("/")

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    @contextmanager
    def _refused(self, action: str, name: str = "") -> Iterator[None]:
        """A call the store refused or did not answer: one StorageError line naming the URL."""
        try:
            yield
        except StorageError:
            raise
        except PermissionError as error:
            raise StorageError(
                f"{self._where(name)}: the storage refused to {action} (permission: {one_line(error, 200)})"
            ) from None
        except FileNotFoundError as error:
            raise StorageError(
                f"{self._where(name)}: could not {action}: not found ({one_line(error, 200)})"
            ) from None
        except Exception as error:  # botocore's and aiohttp's timeouts and refusals are no OSError
            raise StorageError(
                f"{self._where(name)}: could not {action} ({type(error).__name__}: {one_line(error, 200)})"
            ) from None

    def _where(self, name: str) -> str:
        return self.url_of(name) if name else self.url

    def put(self, local: Path, name: str) -> None:
        """Upload the file ``local`` as ``name``: the object appears whole or not at all."""
        with self._refused("write", name):
            self.fs.put_file(str(local), self._path(name))

    def put_bytes(self, data: bytes, name: str) -> None:
        with self._refused("write", name):
            self.fs.pipe_file(self._path(name), data)

    def get(self, name: str, local: Path) -> None:
        """Download ``name`` to ``local``, atomically (another process may be reading the same file)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.download-{os.getpid()}")
        try:
            with self._refused("read", name):
                self.fs.get_file(self._path(name), str(tmp))
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def read_bytes(self, name: str, limit: int) -> bytes:
        """A small object's bytes; one larger than ``limit`` is refused before it is read."""
        with self._refused("read", name):
            size = self.fs.size(self._path(name))
            if size is not None and size > limit:
                raise StorageError(f"{self.url_of(name)} holds {size} bytes, more than the {limit} expected")
            return self.fs.cat_file(self._path(name))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Every file under ``prefix`` (names relative to the folder) -> its size; {} if none."""
        with self._refused("list", prefix):
            self.fs.invalidate_cache()  # another process (a rank, an earlier run) may have written since
            base = self._path(prefix)
            if not self.fs.exists(base):
                return {}
            found = self.fs.find(base, detail=True)
        start = len(self.root) + 1
        return {path[start:]: int(info.get("size") or 0) for path, info in found.items()}

    def check_writable(self) -> None:
        """StorageError unless an object can be written and removed here (before a run trains: a
        missing bucket or a read-only credential is found at the start, not at the first checkpoint)."""
        probe = f".leantrain-write-check-{os.getpid()}"
        self.put_bytes(b"", probe)
        self.remove([probe])

    def remove(self, names: list[str]) -> None:
        if names:
            with self._refused("remove", names[0]):
                self.fs.rm([self._path(name) for name in names])
            self.fs.invalidate_cache()


def dcp_storage(location: Path | str, writing: bool) -> dict[str, Any]:
    """The keyword that points ``torch.distributed.checkpoint.save``/``load`` at ``location``: a
    folder, or a URL through fsspec with this module's timeouts (DCP's own choice takes none)."""
    if not is_url(location):
        return {"checkpoint_id": str(location)}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    url = str(location)
    options = _bounded_options(url.split("://", 1)[0].lower())
    if writing:
        return {"storage_writer": FsspecWriter(url, **options)}
    return {"storage_reader": FsspecReader(url, **options)}
