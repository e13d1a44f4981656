"""The training DataLoader and the device prefetcher.

The DataLoader is built once for the whole run around :class:`GlobalBatchSampler`,
which spans every epoch, so worker processes never restart between epochs. Without worker
processes, :class:`MainProcessLoader` loads the micro-batches in place of a DataLoader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    SequentialSampler,
    Subset,
    TensorDataset,
    default_collate,
)

from leantrain.data.hf import is_stored_table
from leantrain.errors import CollateError, DataError, TaskError, one_line
from leantrain.runtime import derived_seed, host_rng_seeded


class NamedItemErrors(Dataset):
    """Wraps a map-style dataset: a failing item names its index, and workers seed per micro-batch."""

    def __init__(self, dataset: Dataset, name: str, seed: int = 0) -> None:
        self.dataset = dataset
        self.name = name
        self.seed = seed
        # Seeding the host generators costs 16-29 µs per micro-batch, about half of the loop's own
        # cost beside a hand-written one: skipped where loading draws no random number.
        self.reads_stored_values = reads_stored_values(dataset)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as error:
            raise DataError(f"{self.name} item {index} failed: {type(error).__name__}: {error}") from error

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # Load under host generators seeded from the micro-batch's place in the run: augmentation
        # is then the same whichever process loads it (a worker, or the main process with
        # num_workers=0), however far ahead a prefetcher reads, and after a resume. The stream
        # the training step draws from (CPU dropout, `augment`) is put back untouched.
        position = getattr(indices, "position", None)
        if position is None or self.reads_stored_values:
            return self._load(indices)
        with host_rng_seeded(derived_seed(self.seed, *position)):
            return self._load(indices)

    def _load(self, indices: list[int]) -> list[Any]:
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is not None:
            try:
                return batched(list(indices))
            except Exception as error:
                raise DataError(
                    f"{self.name} items {list(indices)} failed: {type(error).__name__}: {error}"
                ) from error
        getitem = self.dataset.__getitem__
        try:
            return [getitem(index) for index in indices]  # no extra Python call per item
        except Exception as error:
            raise self._name_the_failing_item(indices, error) from error

    def _name_the_failing_item(self, indices: list[int], error: Exception) -> DataError:
        """Load the items one by one again to find which one fails (the error path only)."""
        for index in indices:
            try:
                self.dataset[index]
            except Exception as item_error:
                return DataError(
                    f"{self.name} item {index} failed: {type(item_error).__name__}: {item_error}"
                )
        return DataError(f"{self.name} items {list(indices)} failed: {type(error).__name__}: {error}")


def reads_stored_values(dataset: Any) -> bool:
    """Whether loading an item only reads stored values (draws no random number): torch's
    ``TensorDataset``, leantrain's cache, a ``datasets`` table without a transform, and subsets of those."""
    if isinstance(dataset, Subset):
        return reads_stored_values(dataset.dataset)
    stored = isinstance(dataset, TensorDataset) or getattr(dataset, "reads_stored_values", False)
    return stored or is_stored_table(dataset)


def stored_columns(dataset: Any) -> tuple[tuple[torch.Tensor, ...], Sequence[int] | None] | None:
    """A ``TensorDataset``'s tensors and, for a (nested) ``Subset`` of one, the rows it keeps;
    None for every other dataset (its items are loaded one by one)."""
    rows: Sequence[int] | None = None
    while isinstance(dataset, Subset):
        rows = dataset.indices if rows is None else [dataset.indices[i] for i in rows]
        dataset = dataset.dataset
    if type(dataset) is not TensorDataset:  # a subclass may override __getitem__
        return None
    return dataset.tensors, rows


class NamedBatches(NamedItemErrors):
    """NamedItemErrors that also collates each batch, where the items' indices are known, so that
    a batch that cannot be collated names the items at fault. The DataLoader's own collate step
    (``_collated_already``) then only hands the batch on."""

    def __init__(self, dataset: Dataset, name: str, seed: int = 0) -> None:
        super().__init__(dataset, name, seed)
        self.columns = stored_columns(dataset)

    def _load(self, indices: list[int]) -> Any:
        if self.columns is not None:
            return self._read_columns(indices)
        return collate(super()._load(indices), indices, self.name)

    def _read_columns(self, indices: list[int]) -> list[torch.Tensor]:
        """The micro-batch as one indexed read per tensor: what ``default_collate`` makes of the
        items (a list of stacked tensors, the same values), without building and stacking
        ``len(indices)`` tuples of views (64 Python calls per micro-batch of 32)."""
        tensors, rows = self.columns  # type: ignore[misc]
        try:
            # Through NumPy: torch.as_tensor of a list of 32 ints takes 15 µs, this 2 µs; and
            # index_select is 2-3x faster than tensor[picked] for the same rows.
            wanted = indices if rows is None else [rows[i] for i in indices]
            picked = torch.from_numpy(np.array(wanted, np.int64))
            return [tensor.index_select(0, picked) for tensor in tensors]
        except IndexError as error:
            size = len(self.dataset)  # type: ignore[arg-type]
            index = next((i for i in indices if not 0 <= i < size), None)
            if index is not None:
                why = f"index {index} is out of range for {size} items"
                raise DataError(f"{self.name} item {index} failed: IndexError: {why}") from None
            raise DataError(
                f"{self.name} items {list(indices)} failed: IndexError: a Subset names rows its dataset "
                f"lacks ({error})"
            ) from error


def _collated_already(batch: Any) -> Any:
    return batch


def collate(items: list[Any], indices: Sequence[int], name: str) -> Any:
    """``default_collate(items)``; a CollateError naming the items at fault when they cannot be batched.

    The items are only inspected once collation failed: a batch that collates costs nothing more.
    """
    try:
        return default_collate(items)
    except Exception as error:
        raise CollateError(_why_not_batched(items, indices, name, error)) from error


def _why_not_batched(items: list[Any], indices: Sequence[int], name: str, error: Exception) -> str:
    # Not strict: a dataset's own __getitems__ may have returned fewer items than asked for.
    for index, item in zip(indices, items, strict=False):
        field = _none_field(item, "")
        if field is not None:
            what = f"has None at field {field}" if field else "is None"
            return (
                f"{name} item {index} {what}: __getitem__ must return a tensor, a number, or a "
                "tuple/list/dict of them, never None; fix that item or leave it out of the dataset"
            )
    for index, item in zip(indices[1:], items[1:], strict=False):
        found = _difference(items[0], item, "")
        if found is not None:
            field, first, other = found
            where = f" at field {field}" if field else ""
            return (
                f"{name} items {indices[0]} and {index} differ{where}: {first} vs {other}; the items "
                "of a batch must have the same shapes: pad them in __getitem__ to one length (and "
                "have task.loss return an lt.LossSum over the real elements, so the padding is not counted)"
            )
    reason = f"{type(error).__name__}: {one_line(error)}"
    return f"{name} items {list(indices)} cannot be put into one batch: {reason}"


def _none_field(value: Any, field: str) -> str | None:
    """Where ``value`` holds None: ``""`` for itself, ``"[1]"`` for its second field; None if nowhere."""
    if value is None:
        return field
    for key, inner in _fields(value):
        found = _none_field(inner, f"{field}[{key!r}]")
        if found is not None:
            return found
    return None


def _difference(first: Any, other: Any, field: str) -> tuple[str, str, str] | None:
    """The first field where two items differ in a way that stops them being stacked:
    (field, what the first has, what the other has); None when nothing does."""
    shapes = getattr(first, "shape", None), getattr(other, "shape", None)  # tensors and NumPy arrays
    if shapes[0] is not None and shapes[1] is not None:
        same = tuple(shapes[0]) == tuple(shapes[1])
        return None if same else (field, f"shape {list(shapes[0])}", f"shape {list(shapes[1])}")
    kinds = _kind(first), _kind(other)
    if kinds[0] != kinds[1]:
        return field, type(first).__name__, type(other).__name__
    if kinds[0] == "mapping" and first.keys() != other.keys():
        return field, f"keys {sorted(map(str, first))}", f"keys {sorted(map(str, other))}"
    if kinds[0] == "sequence" and len(first) != len(other):
        return field, f"length {len(first)}", f"length {len(other)}"
    for key, inner in _fields(first):
        found = _difference(inner, other[key], f"{field}[{key!r}]")
        if found is not None:
            return found
    return None


def _kind(value: Any) -> str:
    """What collation treats alike: arrays, mappings, sequences, and single values (numbers, strings)."""
    if getattr(value, "shape", None) is not None:
        return "array"
    if isinstance(value, Mapping):
        return "mapping"
    return "sequence" if _is_sequence(value) else "value"


def _fields(value: Any) -> Iterable[tuple[Any, Any]]:
    """(key, value) of each field of a dict, tuple or list; nothing for anything else."""
    if isinstance(value, Mapping):
        return value.items()
    if _is_sequence(value):
        return enumerate(value)
    return ()


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def check_map_style(dataset: Any, name: str) -> int:
    """The dataset's length; TaskError when it is not a sized map-style dataset."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TaskError(
            f"{name} must be a map-style Dataset (with __len__ and __getitem__) or an IterableDataset, "
            f"got {type(dataset).__name__}"
        )
    return len(dataset)


def build_loader(
    dataset: Dataset,
    name: str,
    *,
    batch_sampler: Iterable[list[int]] | None = None,
    batch_size: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    seed: int = 0,
) -> DataLoader | MainProcessLoader:
    """A loader over ``dataset`` with item errors named: a DataLoader whose workers stay alive
    across epochs, or without workers a :class:`MainProcessLoader`."""
    named = NamedBatches(dataset, name, seed)
    if num_workers == 0:
        if batch_sampler is None:
            assert batch_size is not None
            batch_sampler = BatchSampler(SequentialSampler(range(len(named))), batch_size, drop_last=False)
        return MainProcessLoader(named, batch_sampler, pin_memory)
    return DataLoader(
        named,
        batch_sampler=batch_sampler,  # type: ignore[arg-type]
        batch_size=batch_size if batch_sampler is None else 1,
        shuffle=False,
        collate_fn=_collated_already,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=True,
        # Worker seeds are drawn from this generator: augmentation is reproducible.
        generator=torch.Generator().manual_seed(seed),
    )


class MainProcessLoader:
    """Micro-batches loaded in the main process, one ``__getitems__`` call each.

    What a DataLoader with ``num_workers=0`` does, without its per-batch machinery (fetcher,
    profiler record, index bookkeeping): 26 µs less per micro-batch (46 -> 20 µs for 32 rows
    of a TensorDataset), which is most of the loop's cost beside a hand-written one.
    """

    num_workers = 0  # as a DataLoader says it (the doctor's loader_facts reads it)

    def __init__(self, dataset: NamedBatches, batch_sampler: Iterable[list[int]], pin_memory: bool) -> None:
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        # As a DataLoader: pinning needs an accelerator, and without one it is skipped.
        self.pin_memory = pin_memory and torch.cuda.is_available()

    def __iter__(self) -> Iterator[Any]:
        load = self.dataset.__getitems__
        for indices in self.batch_sampler:
            batch = load(indices)
            yield map_tensors(batch, torch.Tensor.pin_memory) if self.pin_memory else batch

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]


def stop_workers(loader: Any) -> None:
    """Stop the worker processes of ``loader`` (a persistent-worker DataLoader) now, if it has any.

    Workers stop when their iterator is freed. After an error, the iterator sits in a reference
    cycle (the traceback's frames hold it), and the garbage collector finalises its queues before
    the iterator itself: the workers never hear the stop, and each is waited for 5 s (torch's
    MP_STATUS_CHECK_INTERVAL) at whatever later moment the collector runs. Torch has no public
    close, so this calls the iterator's own shutdown.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is None:
        return
    loader._iterator = None  # a later iteration starts fresh workers
    shutdown = getattr(iterator, "_shutdown_workers", None)  # absent for num_workers=0
    if shutdown is not None:
        shutdown()


def move_to_device(
    batch: Any, device: torch.device, non_blocking: bool = False, dtype: torch.dtype | None = None
) -> Any:
    """Move every tensor in a (nested) batch of tuples, lists and dicts to ``device``.

    With ``dtype``, floating-point tensors are also cast to it (inputs of a 16-bit model);
    integer tensors such as labels and token ids keep theirs.
    """

    def move(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else None
        return tensor.to(device, dtype=cast, non_blocking=non_blocking)

    return map_tensors(batch, move)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (nested tuples, namedtuples, lists, dicts)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: map_tensors(value, fn) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(value, fn) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(value, fn) for value in batch)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


class CudaPrefetcher:
    """Copies the next batch to the GPU on a side stream while the current step computes.

    Host batches should come from pinned memory so that ``non_blocking`` copies are truly
    asynchronous. Before a batch is handed out, the compute stream waits for its copy,
    and each tensor is marked as used by the compute stream so that the caching
    allocator does not reuse its memory too early.
    """

    def __init__(
        self, batches: Iterable[Any], device: torch.device, dtype: torch.dtype | None = None
    ) -> None:
        self._source = iter(batches)
        self._device = device
        self._dtype = dtype
        self._stream = torch.cuda.Stream(device)
        self._next: Any = None
        self._done = False
        self._load_next()

    def _load_next(self) -> None:
        try:
            host_batch = next(self._source)
        except StopIteration:
            self._done = True
            return
        with torch.cuda.stream(self._stream):
            self._next = move_to_device(host_batch, self._device, non_blocking=True, dtype=self._dtype)

    def __iter__(self) -> CudaPrefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        compute = torch.cuda.current_stream(self._device)
        compute.wait_stream(self._stream)
        batch = self._next
        for tensor in _tensors(batch):
            tensor.record_stream(compute)
        self._load_next()
        return batch


def device_batches(
    batches: Iterable[Any], device: torch.device, dtype: torch.dtype | None = None
) -> Iterator[Any]:
    """Batches on ``device`` (floating tensors cast to ``dtype`` when given).

    Prefetched on CUDA, moved as they come elsewhere, and handed out as they are on the CPU
    when nothing needs casting.
    """
    if device.type == "cuda":
        return CudaPrefetcher(batches, device, dtype)
    if device.type == "cpu" and dtype is None:
        return iter(batches)  # already there: no copy, no per-batch overhead
    return (move_to_device(batch, device, dtype=dtype) for batch in batches)
