"""Iterable (streaming) datasets: the same global-batch order as map-style data, split over ranks and workers.

The stream's order is the sample order. Global step ``s`` takes the next
``global_batch_size`` items; rank ``r`` takes the ``r``-th contiguous share of them, cut
into micro-batches in order, exactly as :class:`~leantrain.data.sampler.GlobalBatchSampler`
does for map-style data. So the math does not depend on the number of ranks or workers.

Every rank and every worker reads the whole stream and keeps only its own items: worker
``w`` of ``W`` builds this rank's micro-batches number ``w, w + W, ...`` of the run, which
is the order in which the DataLoader collects them from its workers (round robin). Reading
is repeated (``W x world`` times), the expensive per-item work should not be: do it after
the cache, in ``Task.augment``, or use a map-style dataset.

An epoch is one pass over the stream; a last partial global batch is dropped (as for
map-style data), and the dataset's ``set_epoch(epoch)`` is called first when it has one,
so it can reshuffle. Resuming at step ``s`` re-reads the stream and skips to ``s`` (whole
epochs are skipped without reading when the dataset has ``__len__``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from leantrain.data.hf import is_hf_stream, stream_rows
from leantrain.data.loader import collate
from leantrain.errors import DataError, TaskError
from leantrain.step.batching import BatchSplit


def stream_length(dataset: IterableDataset) -> int | None:
    """The stream's length per epoch, when it has ``__len__``."""
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _epoch_items(dataset: IterableDataset, name: str, epoch: int) -> Iterator[Any]:
    """The items of one epoch, the whole stream in every process (a ``datasets`` stream: ``hf.py``)."""
    if is_hf_stream(dataset):
        return stream_rows(dataset, name, epoch)
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    return iter(dataset)


def _items(dataset: IterableDataset, name: str, epoch: int) -> Iterator[tuple[int, Any]]:
    """(position in the epoch, item); a failing iterator names the position and the epoch."""
    iterator = _epoch_items(dataset, name, epoch)
    position = 0
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except DataError:  # already names the items (a datasets stream reads blocks of rows)
            raise
        except Exception as error:
            raise DataError(
                f"{name} item {position} of epoch {epoch} failed: {type(error).__name__}: {error}"
            ) from error
        yield position, item
        position += 1


class StreamShard(IterableDataset):
    """This rank's micro-batches (collated) of steps ``start_step..total_steps-1``, split over workers."""

    def __init__(
        self,
        dataset: IterableDataset,
        name: str,
        batch_split: BatchSplit,
        total_steps: int,
        rank: int = 0,
        start_step: int = 0,
    ) -> None:
        self.dataset = dataset
        self.name = name
        self.batch_split = batch_split
        self.total_steps = total_steps
        self.rank = rank
        self.start_step = start_step
        self.length = stream_length(dataset)

    def __iter__(self) -> Iterator[Any]:
        worker, workers = _worker()
        batch_split = self.batch_split
        first = self.rank * batch_split.per_rank_batch_size
        mine = range(first, first + batch_split.per_rank_batch_size)
        step, epoch = 0, 0
        epoch_steps = None if self.length is None else self.length // batch_split.global_batch_size
        if epoch_steps:  # skip whole epochs without reading them
            epoch = self.start_step // epoch_steps
            step = epoch * epoch_steps
        while step < self.total_steps:
            steps_before = step
            pending: dict[int, list[Any]] = {}  # micro-batch number in this step -> (position, item)
            for position, item in _items(self.dataset, self.name, epoch):
                offset = position % batch_split.global_batch_size
                if step >= self.start_step and offset in mine:
                    micro = (offset - first) // batch_split.micro_batch_size
                    number = (step - self.start_step) * batch_split.accumulation_steps + micro
                    if number % workers == worker:
                        pending.setdefault(micro, []).append((position, item))
                if offset == batch_split.global_batch_size - 1:  # the global batch is complete
                    for micro in sorted(pending):
                        positions, items = zip(*pending[micro], strict=True)
                        yield collate(list(items), positions, self.name)
                    pending = {}
                    step += 1
                    if step == self.total_steps:
                        return
            if step == steps_before:
                raise DataError(
                    f"{self.name} yielded fewer items than one global batch "
                    f"({batch_split.global_batch_size}) "
                    f"in epoch {epoch}"
                )
            epoch += 1


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
        worker, workers = _worker()
        for position, item in _items(self.dataset, self.name, 0):
            if position % self.world_size == self.rank and (position // self.world_size) % workers == worker:
                yield item
