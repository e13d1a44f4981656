"""Iterable (streams): read in order, epoch after epoch, from a position a checkpoint can hold.

The stream's order is the sample order. Global step ``s`` takes the next
``global_batch_size`` items; rank ``r`` takes the ``r``-th contiguous share of them, cut
into micro-batches in order, exactly as :class:`~leantrain.data.sampler.GlobalBatchSampler`
does for map-style data (``shard.py`` cuts them). So the math does not depend on the number
of ranks or workers.

Every rank and every worker reads the whole stream and keeps only its own items. Reading
is repeated (``W x world`` times), the expensive per-item work should not be: do it after
the cache, in ``Task.augment``, or use a map-style dataset. Since every process reads the
same items, the stream's position after a step (its epoch, the items read in it, and the
stream's own ``state_dict()`` where it has one) is the same in every one of them, whatever
the world size: that position is what a checkpoint holds.

An epoch is one pass over the stream; for plain train data a last partial global batch is
dropped (as for map-style data), and the dataset's ``set_epoch(epoch)`` is called first when
it has one, so it can reshuffle. Resuming continues from the saved position: a stream with
``state_dict()``/``load_state_dict()`` (the torchdata Stateful protocol; a ``datasets``
stream has them) is restored from its state without re-reading; any other stream re-reads its
current epoch up to the position (whole epochs are skipped without reading).
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from leantrain.data.hf import is_hf_stream, resumes_exactly, stream_rows
from leantrain.errors import DataError, TaskError


def stream_length(dataset: IterableDataset) -> int | None:
    """The stream's length per epoch, when it has ``__len__``."""
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def worker_slot() -> tuple[int, int]:
    """(this DataLoader worker's id, the number of workers); (0, 1) in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def resumable(dataset: Any) -> bool:
    """Whether a stream restores its position from a saved ``state_dict()`` (see the module doc)."""
    if is_hf_stream(dataset):
        return resumes_exactly(dataset)
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


class _EpochItems:
    """A user's stream for one epoch; ``snapshot()``: its ``state_dict()`` after the last item given."""

    def __init__(self, dataset: Any, epoch: int, state: Any = None) -> None:
        self.dataset = dataset
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if state is not None:
            dataset.load_state_dict(state)
        self._iterator = iter(dataset)

    def __next__(self) -> Any:
        return next(self._iterator)

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.dataset.state_dict(), "skip": 0}


def _open(dataset: Any, name: str, epoch: int, state: Any = None) -> Any:
    if is_hf_stream(dataset):
        return stream_rows(dataset, name, epoch, state)
    return _EpochItems(dataset, epoch, state)


class StreamReader:
    """One stream read in its order across epochs. ``whole``: an epoch's last group of fewer than
    this many items is dropped (plain train data: a partial global batch); None: reading goes on
    into the next epoch (a mixture's source)."""

    def __init__(self, dataset: Any, name: str, whole: int | None = None) -> None:
        self.dataset, self.name, self.whole = dataset, name, whole
        self.stateful = resumable(dataset)
        self.epoch, self.read = 0, 0  # the epoch, and the items read in it
        self._items: Any = None  # the epoch's iterator, opened when first read

    def per_epoch(self) -> int | None:
        """Items used per epoch, when the stream has a length."""
        length = stream_length(self.dataset)
        if length is None or not self.whole:
            return length
        return length // self.whole * self.whole

    def rereads(self, draws: int, saved: dict[str, Any] | None) -> int:
        """The items that ``seek(draws, saved)`` reads again (0: restored from the stream's state)."""
        if saved is not None:
            return 0 if saved.get("snapshot") is not None and self.stateful else saved["read"]
        per_epoch = self.per_epoch()
        return draws % per_epoch if per_epoch else draws

    def seek(self, draws: int, saved: dict[str, Any] | None) -> None:
        """Be where ``draws`` items have been taken: at ``saved`` (a ``position()`` taken there) when
        given, else by reading (whole epochs of a stream with a length are skipped unread)."""
        if saved is not None:
            self.epoch, self.read = saved["epoch"], saved["read"]
            snapshot = saved.get("snapshot") if self.stateful else None
            if snapshot is not None:
                self._items = _open(self.dataset, self.name, self.epoch, snapshot["state"])
                self._skip(snapshot["skip"])
            else:
                self._items = _open(self.dataset, self.name, self.epoch)
                self._skip(self.read)
            return
        per_epoch = self.per_epoch()
        if per_epoch:
            self.epoch, draws = divmod(draws, per_epoch)
        group = self.whole or max(draws, 1)  # whole groups, as they were taken
        for _ in range(draws // group):
            self.take(group, ())

    def _skip(self, count: int) -> None:
        for _ in range(count):
            self.next_item()

    def next_item(self) -> Any:
        """The next item of this epoch; StopIteration at its end; an error names the item."""
        if self._items is None:
            self._items = _open(self.dataset, self.name, self.epoch)
        try:
            item = next(self._items)
        except StopIteration:
            raise
        except DataError:  # already names the items (a datasets stream reads blocks of rows)
            raise
        except Exception as error:
            raise DataError(
                f"{self.name} item {self.read} of epoch {self.epoch} failed: {type(error).__name__}: {error}"
            ) from error
        return item

    def take(self, count: int, keep: Container[int]) -> dict[int, tuple[Any, Any]]:
        """The next ``count`` items; those whose offset among them is in ``keep``, by offset, as
        (their place in the epoch, the item)."""
        kept: dict[int, tuple[Any, Any]] = {}
        got = 0
        while got < count:
            try:
                item = self.next_item()
            except StopIteration:
                self._next_epoch(got)
                if self.whole:  # the partial group is dropped: the take starts again
                    kept, got = {}, 0
                continue
            if got in keep:
                kept[got] = (self.read, item)
            self.read += 1
            got += 1
        return kept

    def _next_epoch(self, got: int) -> None:
        empty = self.read == 0 or (self.whole and self.read == got)  # nothing used in the whole epoch
        if empty and self.whole:
            raise DataError(
                f"{self.name} yielded fewer items than one global batch ({self.whole}) in epoch {self.epoch}"
            )
        if empty:
            raise DataError(f"{self.name} yielded no item in epoch {self.epoch}")
        self.epoch, self.read, self._items = self.epoch + 1, 0, None

    def position(self) -> dict[str, Any]:
        """Where the next item is: what ``seek`` takes back."""
        snapshot = self._items.snapshot() if self.stateful and self._items is not None else None
        return {"epoch": self.epoch, "read": self.read, "snapshot": snapshot}


def check_stream_steps(dataset: IterableDataset, name: str, max_steps: int | None) -> None:
    """A stream without ``__len__`` has no known epoch length: the run needs max_steps."""
    if stream_length(dataset) is None and max_steps is None:
        raise TaskError(
            f"{name} is an IterableDataset without __len__: set max_steps (epochs have no known length)"
        )


class RankShard(IterableDataset):
    """Items ``rank, rank + world, ...`` of a stream, split over workers: for validation."""

    def __init__(self, dataset: IterableDataset, name: str, rank: int = 0, world_size: int = 1) -> None:
        self.dataset = dataset
        self.name = name
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[Any]:
        worker, workers = worker_slot()
        reader = StreamReader(self.dataset, self.name)
        position = 0
        while True:
            try:
                item = reader.next_item()
            except StopIteration:
                return
            if position % self.world_size == self.rank and (position // self.world_size) % workers == worker:
                yield item
            reader.read = position = position + 1
