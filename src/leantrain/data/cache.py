"""A memory-mapped cache of a dataset's items: preprocess once, then read at memory speed.

Every item must have the same structure (a tensor, a number, or tuples / lists / dicts of
them) and the same shape per field. Each field is stored as one NumPy ``.npy`` file of
shape ``(items, *field_shape)``, opened with ``mmap_mode="r"``: the operating system's
page cache serves reads, and worker processes share the pages instead of copying them.

A cache folder is complete when its ``cache.json`` exists: it is written last, atomically,
after every array has been flushed, so an interrupted build is never taken for a
complete one. ``cache.json`` records a fingerprint of the data (the task, the dataset's
type and length, and a hash of three items); a cache whose fingerprint differs from the
current data is refused with an error that names the folder.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from leantrain.bounded_read import load_json
from leantrain.checkpoint import capture_rng, restore_rng
from leantrain.data.hf import torch_rows
from leantrain.data.loader import NamedItemErrors
from leantrain.errors import ConfigError, DataError, LeantrainError
from leantrain.files import atomic_write_json, check_room, writing
from leantrain.runtime import seed_everything

FORMAT = 1
MANIFEST = "cache.json"


class CacheError(LeantrainError):
    """A cache folder that is incomplete, stale, foreign or unreadable; names the folder."""


@dataclass(frozen=True)
class Leaf:
    """One field of an item: where it sits in the structure, and its storage."""

    kind: str  # "tensor", "array", "int", "float" or "bool"
    dtype: str  # NumPy dtype name
    shape: tuple[int, ...]


def _flatten(value: Any, where: str = "item") -> tuple[Any, list[tuple[Leaf, np.ndarray]]]:
    """(structure, leaves): the structure holds leaf numbers in place of the values."""
    leaves: list[tuple[Leaf, np.ndarray]] = []

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            array = node.detach().cpu().numpy()
            leaves.append((Leaf("tensor", array.dtype.name, array.shape), array))
        elif isinstance(node, np.ndarray):
            leaves.append((Leaf("array", node.dtype.name, node.shape), node))
        elif isinstance(node, (bool, np.bool_)):
            leaves.append((Leaf("bool", "bool", ()), np.asarray(node, dtype=np.bool_)))
        elif isinstance(node, (int, np.integer)):
            leaves.append((Leaf("int", "int64", ()), np.asarray(node, dtype=np.int64)))
        elif isinstance(node, (float, np.floating)):
            leaves.append((Leaf("float", "float64", ()), np.asarray(node, dtype=np.float64)))
        elif isinstance(node, dict):
            return {"dict": {key: walk(value, f"{path}[{key!r}]") for key, value in node.items()}}
        elif isinstance(node, (tuple, list)):
            kind = "list" if isinstance(node, list) else "tuple"
            return {kind: [walk(value, f"{path}[{i}]") for i, value in enumerate(node)]}
        else:
            raise DataError(
                f"{path} is a {type(node).__name__}: a cache stores tensors, arrays and numbers; "
                "leave that field out of the data (a datasets table: remove_columns)"
            )
        return len(leaves) - 1

    return walk(value, where), leaves


def _build_item(structure: Any, values: list[Any]) -> Any:
    if isinstance(structure, int):
        return values[structure]
    if "dict" in structure:
        return {key: _build_item(node, values) for key, node in structure["dict"].items()}
    items = [_build_item(node, values) for node in structure.get("list", structure.get("tuple", []))]
    return items if "list" in structure else tuple(items)


def task_source(task: Any, split: str) -> str:
    """Names the data's origin in a fingerprint: the task's class and the split."""
    kind = type(task)
    return f"{kind.__module__}.{kind.__qualname__}:{split}"


def fingerprint(dataset: Dataset, source: str, name: str) -> dict[str, Any]:
    """What identifies the data: its source, type, length and a hash of three items.

    The items are loaded under a fixed seed (the caller's random state is restored after),
    so items drawn with randomness hash the same every time. ``name`` names the data in errors.
    """
    size = len(dataset)  # type: ignore[arg-type]
    if size == 0:
        raise DataError(f"{source} is empty: nothing to cache")
    digest = hashlib.sha256()
    saved = capture_rng()
    try:
        for index in sorted({0, size // 2, size - 1}):
            seed_everything(0)
            _, leaves = _flatten(dataset[index], f"{name} item {index}")
            for _, array in leaves:
                digest.update(np.ascontiguousarray(array).tobytes())
    finally:
        restore_rng(saved)
    kind = type(dataset)
    return {"source": source, "dataset": f"{kind.__module__}.{kind.__qualname__}", "size": size,
            "items_sha256": digest.hexdigest()}  # fmt: skip


def items_repeat(dataset: Dataset, index: int = 0) -> bool:
    """Whether loading item ``index`` twice gives the same values: a cache would keep the data as is.

    An item drawn with fresh randomness on every load (random augmentation in
    ``__getitem__``) would be frozen by a cache. The caller's random state is restored.
    """
    saved = capture_rng()
    try:
        first = _flatten(dataset[index])
        second = _flatten(dataset[index])
    finally:
        restore_rng(saved)
    if first[0] != second[0] or len(first[1]) != len(second[1]):
        return False
    return all(
        a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        for (_, a), (_, b) in zip(first[1], second[1], strict=True)
    )


class CachedDataset(Dataset):
    """The items of a complete cache folder, read from memory-mapped arrays."""

    reads_stored_values = True  # loading draws no random number: the loader need not seed for it

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        self.size = manifest["fingerprint"]["size"]
        self.structure = manifest["structure"]
        self.kinds = [leaf["kind"] for leaf in manifest["leaves"]]  # dtype and shape: the arrays' own
        self.arrays = [np.load(folder / f"leaf{i}.npy", mmap_mode="r") for i in range(len(self.kinds))]

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays)

    def _values(self, rows: list[np.ndarray]) -> list[Any]:
        values: list[Any] = []
        for kind, row in zip(self.kinds, rows, strict=True):
            if kind == "tensor":
                values.append(torch.from_numpy(np.array(row)))  # a copy: the map is read-only
            elif kind == "array":
                values.append(np.array(row))
            else:
                values.append(row.item())  # a Python number, as the dataset returned it
        return values

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} is out of range for a cache of {self.size} items")
        return _build_item(self.structure, self._values([array[index] for array in self.arrays]))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # One fancy-indexed read per field for the whole micro-batch, then cheap slices.
        blocks = [array[indices] for array in self.arrays]
        return [
            _build_item(self.structure, self._values([block[row] for block in blocks]))
            for row in range(len(indices))
        ]


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        # Bounded: a cache folder may be shared, and a huge or hostile cache.json is one line, not an OOM.
        manifest = load_json(path, "cache")
    except ConfigError as error:
        raise CacheError(
            f"cache {folder}: {MANIFEST} is unreadable ({error.allowed}); remove the folder"
        ) from None
    if not isinstance(manifest, dict):
        raise CacheError(f"cache {folder}: {MANIFEST} holds no leantrain cache manifest; remove the folder")
    if manifest.get("format") != FORMAT:
        raise CacheError(
            f"cache {folder} has format {manifest.get('format')!r}, this leantrain reads {FORMAT}; remove it"
        )
    return manifest


def open_cache(folder: Path, expected: dict[str, Any]) -> CachedDataset | None:
    """The cache in ``folder`` if complete; None if there is none or only an interrupted build."""
    manifest = _read_manifest(folder)
    if manifest is None:
        return None
    saved = manifest["fingerprint"]
    if saved != expected:
        differ = ", ".join(
            f"{k} {saved.get(k)!r} != {expected[k]!r}" for k in expected if saved.get(k) != expected[k]
        )
        raise CacheError(f"cache {folder} holds other data ({differ}); remove it or choose another folder")
    return CachedDataset(folder, manifest)


def prepare_cache(
    dataset: Dataset, folder: Path, source: str, name: str, num_workers: int = 0, build: bool = True
) -> tuple[CachedDataset, dict[str, Any] | None]:
    """The cache of ``dataset`` in ``folder``, built first when missing or interrupted.

    Returns the cache and, when it was built now, its manifest. With ``build=False`` a
    missing cache is an error (the processes that wait for rank 0 to build it).
    """
    if isinstance(dataset, IterableDataset):  # `leantrain cache` on a task whose data is a stream
        raise CacheError(f"cache {folder}: {name} is an IterableDataset; a cache needs a map-style dataset")
    dataset = torch_rows(dataset, name)  # a datasets table: the rows that fit will collate
    expected = fingerprint(dataset, source, name)
    cached = open_cache(folder, expected)
    if cached is not None:
        return cached, None
    if not build:
        raise CacheError(f"cache {folder} is not complete; it should have been built by rank 0")
    saved = capture_rng()  # building draws random numbers (loader seeds): the run's must not change
    try:
        manifest = build_cache(dataset, folder, expected, name, num_workers)
    finally:
        restore_rng(saved)
    return CachedDataset(folder, manifest), manifest


def build_cache(
    dataset: Dataset, folder: Path, expected: dict[str, Any], name: str, num_workers: int
) -> dict[str, Any]:
    """Load every item once (in worker processes) and store it in ``folder``; returns the manifest."""
    if folder.exists() and not folder.is_dir():
        raise CacheError(f"cache {folder} is a file, not a folder")
    if folder.is_dir() and any(
        p.name != MANIFEST and not p.name.startswith("leaf") for p in folder.iterdir()
    ):
        raise CacheError(f"cache {folder} holds files that are not a leantrain cache; choose an empty folder")
    if folder.is_dir():
        shutil.rmtree(folder)  # an interrupted build: start again
    folder.mkdir(parents=True)
    started = time.perf_counter()
    size = expected["size"]
    structure, first = _flatten(dataset[0], f"{name} item 0")
    leaves = [leaf for leaf, _ in first]
    needed = size * sum(np.dtype(leaf.dtype).itemsize * math.prod(leaf.shape) for leaf in leaves)
    check_room("cache", folder, needed)
    with writing("cache", folder, needed):
        arrays = [_allocated_array(folder / f"leaf{i}.npy", leaf, size) for i, leaf in enumerate(leaves)]
    loader = DataLoader(
        NamedItemErrors(dataset, name), batch_size=64, num_workers=num_workers, collate_fn=list, shuffle=False
    )
    index = 0
    for items in loader:
        for item in items:
            item_structure, item_leaves = _flatten(item, f"{name} item {index}")
            _check_same_layout(name, index, structure, leaves, item_structure, item_leaves)
            for array, (_, value) in zip(arrays, item_leaves, strict=True):
                array[index] = value
            index += 1
    for array in arrays:
        array.flush()
    nbytes = sum(array.nbytes for array in arrays)
    del arrays
    manifest = {
        "format": FORMAT,
        "fingerprint": expected,
        "structure": structure,
        "leaves": [{"kind": leaf.kind, "dtype": leaf.dtype, "shape": list(leaf.shape)} for leaf in leaves],
        "bytes": nbytes,  # what the arrays hold (benchmarks/data.py reads it)
        "build_seconds": round(time.perf_counter() - started, 3),
    }
    atomic_write_json(folder / MANIFEST, manifest)  # last: its presence marks a complete cache
    return manifest


def _allocated_array(path: Path, leaf: Leaf, size: int) -> np.memmap:
    """A memory-mapped array file with its disk space reserved: on a full disk, writing into a
    sparse mapping kills the process with SIGBUS; reserving first gives an OSError instead."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=leaf.dtype, shape=(size, *leaf.shape))
    if hasattr(os, "posix_fallocate"):  # Linux; elsewhere the sparse file stays
        with path.open("r+b") as handle:
            os.posix_fallocate(handle.fileno(), 0, path.stat().st_size)
    return array


def _check_same_layout(
    name: str, index: int, structure: Any, leaves: list[Leaf], item_structure: Any, item_leaves: list
) -> None:
    if item_structure != structure:  # the same structure numbers the same leaves
        raise DataError(
            f"{name} item {index} is structured differently from item 0; a cache needs one layout"
        )
    for number, (leaf, (item_leaf, _)) in enumerate(zip(leaves, item_leaves, strict=True)):
        if item_leaf != leaf:
            raise DataError(
                f"{name} item {index}, field {number}: {item_leaf.dtype} {item_leaf.shape} differs from "
                f"item 0's {leaf.dtype} {leaf.shape}; a cache needs the same dtype and shape for every item"
            )
