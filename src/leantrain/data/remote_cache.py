"""A data cache in object storage (``--cache s3://bucket/cache``): built once, read on every machine.

A cache is read through ``mmap``, so each machine reads a local copy (``~/.cache/leantrain/
data-cache/<name>-<hash of the URL>``). When the URL holds a complete cache of a split, the copy
is downloaded from it (files already there in full are kept); when it does not, rank 0 builds
the cache locally as for a local folder and uploads it: the arrays first, ``cache.json`` last, so a
build or an upload killed half way is never taken for a cache (the same rule as a local build,
whose ``cache.json`` is written last). The fingerprint check is the local one: a cache of other
data is refused whichever machine built it.
"""

from __future__ import annotations

from pathlib import Path

from leantrain.data.cache import MANIFEST
from leantrain.remote import RemoteFolder, is_url, local_copy_folder


def cache_root(cache: str) -> Path:
    """The local folder that ``--cache`` names: itself, or this machine's copy of a URL's cache."""
    return local_copy_folder(cache, "data-cache") if is_url(cache) else Path(cache)


def fetch_split(url: str, split: str) -> bool:
    """Copy ``url/split`` to this machine when the URL holds it complete; whether it did. ``cache.json``
    comes last here too: a copy interrupted half way is rebuilt or fetched again, never read."""
    remote, local = RemoteFolder(url), cache_root(url) / split
    held = remote.sizes(split)
    manifest = f"{split}/{MANIFEST}"
    if manifest not in held:
        return False
    for name in sorted(held, key=lambda name: name == manifest):
        path = cache_root(url) / name
        if name == manifest or not path.is_file() or path.stat().st_size != held[name]:
            remote.get(name, path)
    return (local / MANIFEST).is_file()


def publish_split(url: str, split: str) -> None:
    """Upload the local copy of ``url/split`` (just built): the arrays first, ``cache.json`` last."""
    remote, local = RemoteFolder(url), cache_root(url) / split
    files = sorted((p for p in local.iterdir() if p.is_file()), key=lambda path: path.name == MANIFEST)
    for path in files:
        remote.put(path, f"{split}/{path.name}")
