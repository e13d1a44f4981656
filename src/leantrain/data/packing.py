"""``--pack-length N``: token documents packed into rows of exactly N tokens, in the sampler's order.

The design (issue 39). Each epoch's documents, in that epoch's order (the permutation of
``(seed, epoch)`` that :class:`GlobalBatchSampler` draws; the index order without shuffling), are
laid end to end and cut every N tokens: row ``r`` of epoch ``e`` holds tokens ``[rN, (r+1)N)`` of that
stream, and the last partial row is dropped. Every epoch holds the same tokens, so the number of
rows (``tokens // N``) is known before the first epoch starts and is the same in every epoch: steps
per epoch stay computable (``Schedule`` in ``run/data.py``), and the rows are dealt by global batch
exactly as samples are (:class:`PackedRowSampler`: index ``e * rows + r``, in order, since the
shuffle is already in the documents' order). The rows depend on the seed, the epoch and N only,
never on the world size, the workers or the micro-batch split, and a resume needs only the step.
First-fit bin packing was not chosen: it keeps short documents whole but pads rows, and its row
count changes from epoch to epoch.

A document that crosses a row's end goes on at the start of the next row: each piece is a
segment of its row, and a row's item is a dict of ``[N]`` int64 tensors: ``input_ids``,
``labels``, ``position_ids`` (0 at the start of every segment) and ``document_ids`` (the segment's
number in its row, from 0). The model must keep each segment's attention inside it
(``data/document_attention.py``). Labels are per position, as in the item: a document given as a
1-D tensor, or as a dict without ``labels``, is labelled with its own next tokens and ``-100``
(ignored) at its last one, so no label ever names another document's token; a dict's own
``labels`` are kept. A token-level loss (``lt.LossSum`` over the labels that are not -100) is then
the same sum over the same tokens as the documents' pieces run one by one.

Document lengths are read once, when the run starts (every item is loaded once), and kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from leantrain.data.loader import reads_stored_values
from leantrain.data.sampler import GlobalBatchSampler
from leantrain.errors import DataError, TaskError
from leantrain.task import describe_batch

IGNORE_INDEX = -100  # the label of a position that predicts nothing (torch's cross_entropy default)

PACKED_FIELDS = ("input_ids", "labels", "position_ids", "document_ids")


def token_document(item: Any, index: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of one document, both int64 ``[length]``; TaskError for anything that is
    not a 1-D integer tensor or a dict with a 1-D integer ``input_ids`` (and same-shaped ``labels``)."""
    ids, labels = (item.get("input_ids"), item.get("labels")) if isinstance(item, Mapping) else (item, None)
    if isinstance(ids, np.ndarray):
        ids = torch.from_numpy(ids)
    if isinstance(labels, np.ndarray):
        labels = torch.from_numpy(labels)
    fine = isinstance(ids, torch.Tensor) and ids.dim() == 1 and not ids.is_floating_point()
    fine = fine and not ids.is_complex() and ids.dtype != torch.bool
    if labels is not None and not (isinstance(labels, torch.Tensor) and labels.shape == ids.shape):
        fine = False
    if not fine:
        raise TaskError(
            f"pack_length packs token sequences: {name} item {index} is {describe_batch(item)}; return a "
            "1-D integer tensor, or a dict with a 1-D integer input_ids and optional labels of its shape"
        )
    ids = ids.long()
    if labels is None:
        labels = torch.cat([ids[1:], ids.new_full((min(len(ids), 1),), IGNORE_INDEX)])
    return ids, labels.long()


def document_lengths(documents: Dataset, name: str) -> np.ndarray:
    """The token count of every document (each item loaded once, and checked)."""
    lengths = np.empty(len(documents), np.int64)  # type: ignore[arg-type]
    for index in range(len(lengths)):
        try:
            item = documents[index]
        except Exception as error:
            raise DataError(f"{name} item {index} failed: {type(error).__name__}: {error}") from error
        lengths[index] = len(token_document(item, index, name)[0])
    return lengths


def epoch_order(count: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The documents' order in ``epoch``: the sampler's permutation of (seed, epoch)."""
    if not shuffle:
        return np.arange(count)
    return np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(count)


class PackedDocuments(Dataset):
    """Rows of ``pack_length`` tokens from token documents; index ``e * len(self) + r`` is row ``r``
    of epoch ``e`` (``len``: the rows of one epoch)."""

    def __init__(self, documents: Dataset, pack_length: int, seed: int, shuffle: bool, name: str) -> None:
        self.documents, self.pack_length, self.name = documents, pack_length, name
        self.seed, self.shuffle = seed, shuffle
        self.lengths = document_lengths(documents, name)
        self.tokens = int(self.lengths.sum())
        self.rows = self.tokens // pack_length
        if self.rows == 0:
            raise TaskError(
                f"{name} holds {self.tokens} tokens, fewer than one row of pack_length={pack_length}"
            )
        self.reads_stored_values = reads_stored_values(documents)  # NamedItemErrors skips seeding then
        self._epoch: int | None = None
        self._order = np.empty(0, np.int64)
        # Where each document of the epoch's order begins and ends in the epoch's stream of tokens.
        self._begins = self._ends = np.empty(0, np.int64)

    def __len__(self) -> int:
        return self.rows

    def note(self) -> str:
        """The run log's line."""
        dropped = self.tokens - self.rows * self.pack_length
        return (
            f"pack_length {self.pack_length}: {len(self.lengths):,} {self.name} documents, "
            f"{self.tokens:,} tokens -> {self.rows:,} rows per epoch ({dropped:,} tokens of the last "
            f"partial row left out)"
        )

    def _layout(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._order = epoch_order(len(self.lengths), self.seed, epoch, self.shuffle)
            self._ends = np.cumsum(self.lengths[self._order])
            self._begins = self._ends - self.lengths[self._order]
            self._epoch = epoch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        epoch, row = divmod(int(index), self.rows)
        self._layout(epoch)
        start, stop = row * self.pack_length, (row + 1) * self.pack_length
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        position = int(np.searchsorted(self._ends, start, side="right"))  # the first to end after start
        while position < len(self._ends) and self._begins[position] < stop:
            document, begins = int(self._order[position]), int(self._begins[position])
            low, high = max(start, begins) - begins, min(stop, int(self._ends[position])) - begins
            if high > low:  # an empty document holds no tokens
                ids, labels = self._document(document, row, epoch)
                pieces.append((ids[low:high], labels[low:high]))
            position += 1
        return {
            "input_ids": torch.cat([ids for ids, _ in pieces]),
            "labels": torch.cat([labels for _, labels in pieces]),
            "position_ids": torch.cat([torch.arange(len(ids)) for ids, _ in pieces]),
            "document_ids": torch.cat([torch.full((len(ids),), n) for n, (ids, _) in enumerate(pieces)]),
        }

    def _document(self, document: int, row: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            item = self.documents[document]
        except Exception as error:
            raise DataError(
                f"{self.name} item {document} (packed into row {row} of epoch {epoch}) failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        return token_document(item, document, self.name)


class PackedRowSampler(GlobalBatchSampler):
    """Deals the packed rows of each epoch in order, by global batch (see the module's docstring)."""

    def epoch_order(self, epoch: int) -> range:  # type: ignore[override]
        return range(epoch * self.dataset_size, (epoch + 1) * self.dataset_size)


def padding_share(items: list[Any]) -> float | None:
    """The share of a sample of token items' positions that train nothing: ``attention_mask`` 0 where the
    items have one, else a label of -100; None when the items are not token data (dicts with
    ``input_ids``)."""
    computed = wasted = 0
    for item in items:
        if not (isinstance(item, Mapping) and isinstance(item.get("input_ids"), torch.Tensor)):
            return None
        mask, labels = item.get("attention_mask"), item.get("labels")
        computed += item["input_ids"].numel()
        if isinstance(mask, torch.Tensor):
            wasted += int((mask == 0).sum())
        elif isinstance(labels, torch.Tensor):
            wasted += int((labels == IGNORE_INDEX).sum())
    return wasted / computed if computed else None
