"""Hugging Face ``datasets`` as ``train_data``/``val_data``: rows in torch format, streams read whole.

A ``datasets.Dataset`` (map-style) and a ``datasets.IterableDataset`` (a stream) are used as they
are, with two adjustments that the rest of the data code relies on:

- **Rows in torch format.** Rows in datasets' default (Python) format hold lists and Python
  numbers: ``default_collate`` would transpose a ``[6 ints]`` field into 6 tensors of the batch
  size, and a ``float32`` column would arrive as float64. leantrain reads such data in torch
  format (``with_format("torch")``, the same columns): each column is a tensor of its feature's
  type. Formats that collate as they are (``torch``, ``numpy``, and ``custom`` transforms set
  by ``with_transform``) are kept.
- **Streams read whole, in order, in every process.** leantrain gives each DataLoader worker its
  own micro-batches of one stream order (see ``stream.py``), so every worker must read every row.
  A ``datasets.IterableDataset`` iterated inside a worker gives it only some of its shards (and
  nothing when it has fewer shards than workers); its batched reader ``iter(batch_size)`` does
  not, and formats a block of rows at once (20x faster than row by row, in torch format). Each
  epoch is read from a fresh view with its own epoch number: ``set_epoch`` writes to memory that
  the dataset shares with every worker, and workers may be in different epochs.

Nothing here imports ``datasets``: a dataset is recognised through ``sys.modules``, so leantrain
works without it installed.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from leantrain.errors import DataError, TaskError

# Rows a stream's reader formats at a time. A failing read names this block of rows.
ROWS_PER_READ = 64
# The example iterables of a stream looked at for a shuffle buffer: a stream of many sources and steps
# has dozens.
MAX_STREAM_CHAIN = 1000
# Map-style formats whose rows ``default_collate`` batches as they are (``custom``: with_transform).
KEPT_FORMATS = ("torch", "numpy", "custom")


def _datasets_class(name: str) -> type | None:
    """``datasets.<name>`` when datasets has been imported (a dataset of it cannot exist otherwise)."""
    module = sys.modules.get("datasets")
    found = getattr(module, name, None)
    return found if isinstance(found, type) else None


def _is_instance(value: Any, name: str) -> bool:
    kind = _datasets_class(name)
    return kind is not None and isinstance(value, kind)


def is_hf_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.IterableDataset``."""
    return _is_instance(dataset, "IterableDataset")


def is_stored_table(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets`` table whose rows are read as stored (no transform)."""
    return _is_instance(dataset, "Dataset") and dataset.format["type"] in ("torch", "numpy")


def torch_rows(dataset: Any, name: str) -> Any:
    """``dataset`` as leantrain reads it: a ``datasets`` table or stream in torch format (see above);
    anything else unchanged. TaskError for a dict of splits, or a stream already split by process."""
    for kind in ("DatasetDict", "IterableDatasetDict"):
        if _is_instance(dataset, kind):
            raise TaskError(
                f"{name} is a datasets.{kind} (splits: {', '.join(map(str, dataset))}): return one "
                "split, e.g. load_dataset(..., split='train') or dataset['train']"
            )
    if is_hf_stream(dataset):
        # Private, read only to refuse: a stream that datasets.distributed.split_dataset_by_node
        # cut would lose the other processes' rows, since leantrain splits the stream itself.
        split = getattr(dataset, "_distributed", None)
        if split is not None and getattr(split, "world_size", 1) > 1:
            raise TaskError(
                f"{name} is a datasets.IterableDataset split by split_dataset_by_node (rank {split.rank} "
                f"of {split.world_size}): return the whole stream; leantrain gives each process its share"
            )
        return dataset.with_format("torch")
    if _is_instance(dataset, "Dataset"):
        layout = dataset.format
        if layout["type"] in KEPT_FORMATS:
            return dataset
        return dataset.with_format(
            "torch", columns=layout["columns"], output_all_columns=layout["output_all_columns"]
        )
    return dataset


def stream_rows(dataset: Any, name: str, epoch: int, state: dict[str, Any] | None = None) -> StreamRows:
    """Every row of epoch ``epoch`` of a ``datasets.IterableDataset``, in order, in torch format,
    whichever process reads it (a DataLoader worker included); from ``state`` (a ``snapshot()``'s)
    when given."""
    return StreamRows(dataset, name, epoch, state)


def resumes_exactly(dataset: Any) -> bool:
    """Whether a ``datasets`` stream's ``state_dict()`` restores its order exactly: not after
    ``shuffle(buffer_size=...)`` anywhere in it (a source of an interleaved stream too), whose buffer
    the state leaves out (datasets refills it on load). Read from datasets' private chain of example
    iterables (a ``BufferShuffledExamplesIterable``; earlier versions also set ``_shuffling``), only here."""
    if getattr(dataset, "_shuffling", None) is not None:
        return False
    pending = [getattr(dataset, "_ex_iterable", None)]
    for _ in range(MAX_STREAM_CHAIN):
        if not pending:
            return True
        node = pending.pop()
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return False
        pending += [getattr(node, "ex_iterable", None), *(getattr(node, "ex_iterables", None) or [])]
    return False  # a chain longer than any datasets builds: read again rather than trust the state


class StreamRows:
    """The rows of one epoch, read a block at a time; ``snapshot()`` is where the next row is: the
    stream's ``state_dict()`` at the start of its block, and the rows of the block already given."""

    def __init__(self, dataset: Any, name: str, epoch: int, state: dict[str, Any] | None = None) -> None:
        self.name, self.epoch = name, epoch
        self._view = dataset.with_format("torch")  # a new dataset: its epoch is this process's alone
        self._view.set_epoch(epoch)
        if state is not None:
            self._view.load_state_dict(state)
        self._blocks = self._view.iter(batch_size=ROWS_PER_READ)
        # The view's state_dict() is its own again only once reading began: until then, the loaded one.
        self._block_state = state if state is not None else self._view.state_dict()
        self._started = False
        self._rows: list[dict[str, Any]] = []
        self._given = 0  # of the block's rows
        self._first = 0  # the block's first row in the epoch

    def __iter__(self) -> StreamRows:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._given == len(self._rows):
            self._read_block()
        self._given += 1
        return self._rows[self._given - 1]

    def snapshot(self) -> dict[str, Any]:
        return {"state": self._block_state, "skip": self._given}

    def _read_block(self) -> None:
        self._first += len(self._rows)
        if self._started:
            self._block_state = self._view.state_dict()
        self._started = True
        try:
            with warnings.catch_warnings():
                # Rows made by a Python .map() are tensorized twice by this reader: harmless, but
                # torch warns about it (a datasets quirk, not the user's code).
                warnings.filterwarnings("ignore", "To copy construct from a tensor", UserWarning)
                block = next(self._blocks)  # StopIteration ends the epoch
        except StopIteration:
            raise
        except Exception as error:  # datasets formats (and runs .map on) a block at a time: name it
            raise DataError(
                f"{self.name} items {self._first}-{self._first + ROWS_PER_READ - 1} of epoch {self.epoch}: "
                f"reading them failed: {type(error).__name__}: {error}"
            ) from error
        columns = list(block.items())
        count = len(columns[0][1]) if columns else 0
        self._rows = [{key: values[row] for key, values in columns} for row in range(count)]
        self._given = 0
        if not self._rows:
            raise StopIteration
