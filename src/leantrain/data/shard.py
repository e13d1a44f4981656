"""A run's micro-batches drawn from sources read in order (a stream, or a mixture's sources).

A *plan* says, for every global step, how many items each source gives (``counts``) and
where each lands in the global batch (``layout``: (source, offset among the source's items of
the step) per slot). Rank ``r`` takes the ``r``-th contiguous share of the global batch, cut into
micro-batches in order, as for map-style data; worker ``w`` of ``W`` builds this rank's
micro-batches number ``w, w + W, ...``, the order in which the DataLoader collects them. Every
process advances every source through every step, so the sources' positions after a step are
the same in all of them.

The main process learns those positions, and the tokens of each source, from the micro-batches
themselves: each comes as ``(batch, mark)`` and :class:`MarkedLoader` hands the batch on and
keeps the mark in a :class:`DataPosition`. A checkpoint then holds the positions after its step,
and a resume starts each stream there (``stream.py``), never re-reading what was trained on.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

from leantrain.data.loader import collate
from leantrain.data.stream import StreamReader, worker_slot
from leantrain.runtime import derived_seed, host_rng_seeded
from leantrain.step.batching import BatchSplit

# Steps of positions the main process keeps: the loader reads at most a few steps ahead of training.
KEPT_STEPS = 64
# In the seed of a step's reading (`_read_step`): a micro-batch's seed has a rank there, never negative.
READING = -1


class Reader(Protocol):
    """A source read in order (``stream.StreamReader``, ``mixture.MapReader``)."""

    def seek(self, draws: int, saved: dict[str, Any] | None) -> None: ...
    def take(self, count: int, keep: Any) -> dict[int, tuple[Any, Any]]: ...
    def position(self) -> dict[str, Any] | None: ...


class Plan(Protocol):
    names: list[str]  # the sources
    loads: bool  # whether items are loaded in the micro-batch (map-style sources): seeded per micro-batch

    def readers(self) -> list[Reader]: ...
    def counts(self, step: int) -> list[int]: ...
    def draws_before(self, step: int) -> list[int]: ...
    def layout(self, step: int, counts: list[int]) -> list[tuple[int, int]]: ...


class StreamPlan:
    """A plain stream: all of every global batch from it, in its order."""

    loads = False

    def __init__(self, dataset: IterableDataset, name: str, global_batch_size: int) -> None:
        self.dataset, self.names, self.size = dataset, [name], global_batch_size

    def readers(self) -> list[Reader]:
        return [StreamReader(self.dataset, self.names[0], whole=self.size)]

    def counts(self, step: int) -> list[int]:
        return [self.size]

    def draws_before(self, step: int) -> list[int]:
        return [step * self.size]

    def layout(self, step: int, counts: list[int]) -> list[tuple[int, int]]:
        return [(0, offset) for offset in range(self.size)]


def item_tokens(item: Any) -> int:
    """The tokens of a token item (a 1-D integer tensor, or a dict with ``input_ids``); 0 otherwise."""
    if isinstance(item, Mapping):
        item = item.get("input_ids")
    if isinstance(item, torch.Tensor) and item.dim() == 1 and not item.is_floating_point():
        return item.numel()
    return 0


class GlobalBatchShard(IterableDataset):
    """This rank's micro-batches (collated) of steps ``start_step..total_steps-1``, split over workers;
    with ``marks``, each as ``(batch, mark)`` for a :class:`MarkedLoader`."""

    def __init__(self, plan: Plan, name: str, batch_split: BatchSplit, total_steps: int, rank: int = 0,
                 start_step: int = 0, saved: list[dict[str, Any] | None] | None = None, seed: int = 0,
                 marks: bool = False) -> None:  # fmt: skip
        self.plan, self.name, self.batch_split = plan, name, batch_split
        self.total_steps, self.rank, self.start_step = total_steps, rank, start_step
        self.saved = saved or [None] * len(plan.names)  # each source's position at start_step, if known
        self.seed, self.marks = seed, marks

    def __iter__(self) -> Iterator[Any]:
        worker, workers = worker_slot()
        split, plan = self.batch_split, self.plan
        readers = plan.readers()
        for reader, draws, saved in zip(readers, plan.draws_before(self.start_step), self.saved, strict=True):
            reader.seek(draws, saved)
        micro, accumulation = split.micro_batch_size, split.accumulation_steps
        first = self.rank * split.per_rank_batch_size
        for step in range(self.start_step, self.total_steps):
            counts = plan.counts(step)
            layout = plan.layout(step, counts)
            number = (step - self.start_step) * accumulation
            mine = [m for m in range(accumulation) if (number + m) % workers == worker]
            slots = {m: layout[first + m * micro : first + (m + 1) * micro] for m in mine}
            wanted: list[set[int]] = [set() for _ in readers]
            for source, offset in (slot for cut in slots.values() for slot in cut):
                wanted[source].add(offset)
            taken = self._read_step(step, readers, counts, wanted)
            for m in mine:
                yield self._micro_batch(step, m, slots[m], taken, readers, m == accumulation - 1)

    def _read_step(self, step: int, readers: list[Reader], counts: list[int], wanted: list[set[int]]) -> list:
        """Each source's items of ``step``, the random generators seeded from the step and the source
        for the reading. A stream draws while it is read (noise in its ``__iter__``, a random ``map`` of
        a ``datasets`` stream), and every worker of every rank reads it whole: so they all draw the same
        numbers for the same items, whatever the number of workers and processes, and a resumed run
        draws for a step what the uninterrupted one drew."""
        taken = []
        for source, (reader, count, keep) in enumerate(zip(readers, counts, wanted, strict=True)):
            with host_rng_seeded(derived_seed(self.seed, step, READING, source)):
                taken.append(reader.take(count, keep))
        return taken

    def _micro_batch(self, step: int, micro: int, slots: list[tuple[int, int]], taken: list[dict[int, Any]],
                     readers: list[Reader], last: bool) -> Any:  # fmt: skip
        seeded = host_rng_seeded(derived_seed(self.seed, step, self.rank, micro))
        with seeded if self.plan.loads else nullcontext():
            labelled = [(source, *taken[source][offset]) for source, offset in slots]
            items = [getattr(readers[s], "load", _as_is)(value) for s, _, value in labelled]
        batch = collate(items, [label for _, label, _ in labelled], self.name)
        if not self.marks:
            return batch
        tokens = [0] * len(readers)
        for (source, _, _), item in zip(labelled, items, strict=True):
            tokens[source] += item_tokens(item)
        mark: dict[str, Any] = {"step": step, "tokens": tokens}
        if last:  # this rank's last micro-batch of the step: every source is read through it
            mark["after"] = [reader.position() for reader in readers]
        return batch, mark


def _as_is(value: Any) -> Any:
    return value


class DataPosition:
    """What the main process knows of the sources: their positions after each recent step, and the
    tokens each gave this process (from ``start_tokens``, at ``start_step``)."""

    def __init__(self, names: list[str], start_step: int, start: list[dict[str, Any] | None],
                 start_tokens: list[int]) -> None:  # fmt: skip
        self.names, self.start_step = names, start_step
        self._after: dict[int, list[dict[str, Any] | None]] = {start_step: start}
        self._tokens = list(start_tokens)  # through the steps folded in so far
        self._pending: dict[int, list[int]] = {}  # a later step's tokens, by step

    def record(self, mark: dict[str, Any]) -> None:
        step = mark["step"]
        counted = self._pending.setdefault(step, [0] * len(self._tokens))
        self._pending[step] = [a + b for a, b in zip(counted, mark["tokens"], strict=True)]
        if "after" in mark:
            self._after[step + 1] = mark["after"]
            self._after.pop(step + 1 - KEPT_STEPS, None)

    def after(self, done: int) -> list[dict[str, Any] | None] | None:
        """Each source's position after step ``done`` (None: not known here)."""
        return self._after.get(done)

    def tokens(self, done: int) -> list[int]:
        """The tokens of each source in this process's micro-batches of the steps before ``done``."""
        for step in sorted(s for s in self._pending if s < done):
            self._tokens = [a + b for a, b in zip(self._tokens, self._pending.pop(step), strict=True)]
        return list(self._tokens)


class MarkedLoader(DataLoader):
    """A DataLoader over a marked :class:`GlobalBatchShard`: yields the batches, keeps the marks."""

    def __init__(self, shard: GlobalBatchShard, position: DataPosition, **options: Any) -> None:
        super().__init__(shard, batch_size=None, **options)
        self.position = position

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for batch, mark in super().__iter__():
            self.position.record(mark)
            yield batch
