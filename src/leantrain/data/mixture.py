"""Weighted mixtures of data sets: ``lt.Mixture({"web": a, "code": b}, weights={"web": 0.7, "code": 0.3})``.

A mixture is a task's ``train_data()``. Every global batch of ``B`` samples is split across the
sources by weight: source ``k`` gets ``floor(B * w_k)`` samples, and the ``r`` slots left over go
to the sources by their fractional parts ``B * w_k - floor(B * w_k)``, through the points
``u_s, u_s + 1, ..., u_s + r - 1`` laid on those parts end to end, with ``u_s`` the fractional part
of ``(s + 1)`` times the golden ratio (plus a phase from the seed). So each global batch holds
its share within one sample per source, and the counts over any run of steps keep the weights
to a few samples in all (the points fill [0, 1) evenly). Step ``s``'s counts depend on ``s``
alone, so the samples a source gave before step ``s`` are a sum, and a resume needs only ``s``
(and, for a stream source, its position: ``stream.py``).

Within the global batch the sources' samples are shuffled together (from ``(seed, s)``); each
source gives its samples in its own order: a map-style source a permutation per epoch of that
source drawn from ``(seed, name, epoch)``, a stream its stream order. A source that runs out
starts its next epoch (``set_epoch`` for a stream), whatever the other sources do: the epochs
of the sources are their own, and a mixture has none (the run needs ``max_steps``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Container, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from leantrain.data.hf import torch_rows
from leantrain.data.loader import NamedItemErrors
from leantrain.data.stream import StreamReader
from leantrain.errors import TaskError

GOLDEN = (math.sqrt(5) - 1) / 2
STEPS_PER_SUM = 1 << 20  # the draws before a far step are summed this many steps at a time


class Mixture(IterableDataset):
    """Sources (map-style datasets or streams) by name, drawn by weight (positive; need not sum to 1)."""

    def __init__(self, sources: Mapping[str, Any], weights: Mapping[str, float]) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise TaskError(
                "Mixture needs at least one source: Mixture({'name': dataset, ...}, weights={...})"
            )
        for name in weights:
            if name not in sources:
                raise TaskError(f"Mixture weight {name!r} names no source (sources: {', '.join(sources)})")
        self.sources: dict[str, Any] = {}
        for name, source in sources.items():
            label = f"Mixture source {name!r}"
            weight = weights.get(name)
            if weight is None:
                raise TaskError(f"{label} has no weight: give weights[{name!r}]")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
                raise TaskError(f"{label} has weight {weight!r}: a weight must be a positive number")
            source = torch_rows(source, label)
            is_map = hasattr(source, "__getitem__") and hasattr(source, "__len__")
            if not (isinstance(source, IterableDataset) or is_map):
                raise TaskError(f"{label} is a {type(source).__name__}, not a Dataset or an IterableDataset")
            if is_map and not isinstance(source, IterableDataset) and len(source) == 0:
                raise TaskError(f"{label} is empty")
            self.sources[str(name)] = source
        total = sum(float(weights[name]) for name in sources)
        self.weights = {str(name): float(weights[name]) / total for name in sources}

    @property
    def names(self) -> list[str]:
        return list(self.sources)

    def mapped(self, change: Callable[[str, Any], Any]) -> Mixture:
        """The same mixture of ``change(name, source)`` for each source (packing rows within each)."""
        return Mixture({name: change(name, source) for name, source in self.sources.items()}, self.weights)

    def __iter__(self) -> Iterator[Any]:
        """The sources' first items in turn: a look at the items (fit reads the run's order)."""
        iterators = [iter(s) if isinstance(s, IterableDataset) else map(s.__getitem__, range(len(s)))
                     for s in self.sources.values()]  # fmt: skip
        while iterators:
            for iterator in list(iterators):
                try:
                    yield next(iterator)
                except StopIteration:
                    iterators.remove(iterator)

    def plan(self, name: str, global_batch_size: int, seed: int, shuffle: bool) -> MixturePlan:
        return MixturePlan(self, name, global_batch_size, seed, shuffle)


class MixturePlan:
    """A mixture's counts and layout per global step (see the module doc), and its sources' readers."""

    def __init__(self, mixture: Mixture, name: str, global_batch_size: int, seed: int, shuffle: bool) -> None:
        self.mixture, self.label, self.seed, self.shuffle = mixture, name, seed, shuffle
        self.names = mixture.names
        self.loads = any(not isinstance(s, IterableDataset) for s in mixture.sources.values())
        shares = np.array([mixture.weights[n] for n in self.names]) * global_batch_size
        self.base = np.floor(shares).astype(np.int64)
        left = global_batch_size - int(self.base.sum())  # the slots the fractional parts share
        fractions = np.cumsum(shares - self.base)
        self.ends = fractions * (left / fractions[-1]) if left else np.zeros_like(fractions)
        self.ends[-1] = left  # exactly: the points of every step fall inside
        self.phase = np.random.default_rng(np.random.SeedSequence([seed, 0x4D49])).random()

    def _extras(self, steps: np.ndarray) -> np.ndarray:
        """[steps, sources]: 1 where a source gets one of the step's left-over slots."""
        u = np.mod((steps + 1) * GOLDEN + self.phase, 1.0)[:, None]
        above = np.ceil(self.ends[None, :] - u)
        return np.diff(np.concatenate([np.ceil(-u), above], axis=1), axis=1).astype(np.int64)

    def counts(self, step: int) -> list[int]:
        return (self.base + self._extras(np.array([step]))[0]).tolist()

    def draws_before(self, step: int) -> list[int]:
        """The samples each source gave in steps ``0..step-1``."""
        total = self.base * step
        for start in range(0, step, STEPS_PER_SUM):
            total = total + self._extras(np.arange(start, min(step, start + STEPS_PER_SUM))).sum(axis=0)
        return total.tolist()

    def layout(self, step: int, counts: list[int]) -> list[tuple[int, int]]:
        slots = [(source, offset) for source, count in enumerate(counts) for offset in range(count)]
        if not self.shuffle:
            return slots
        order = np.random.default_rng(np.random.SeedSequence([self.seed, step, 0x4D49])).permutation(
            len(slots)
        )
        return [slots[i] for i in order]

    def readers(self) -> list[Any]:
        label = self.label
        return [StreamReader(s, f"{label}[{n!r}]") if isinstance(s, IterableDataset)
                else MapReader(s, f"{label}[{n!r}]", n, self.seed, self.shuffle)
                for n, s in self.mixture.sources.items()]  # fmt: skip


class MapReader:
    """A map-style source in its order: epoch ``e`` a permutation drawn from ``(seed, name, e)``."""

    def __init__(self, dataset: Dataset, label: str, name: str, seed: int, shuffle: bool) -> None:
        self.dataset = NamedItemErrors(dataset, label)
        self.size = len(dataset)  # type: ignore[arg-type]
        self.key = [seed, zlib.crc32(name.encode())]
        self.shuffle = shuffle
        self.drawn = 0
        self._epoch: int | None = None
        self._order: np.ndarray | None = None

    def seek(self, draws: int, saved: dict[str, Any] | None) -> None:
        self.drawn = draws  # random access: the count is the position

    def _index(self, draw: int) -> int:
        epoch, place = divmod(draw, self.size)
        if not self.shuffle:
            return place
        if epoch != self._epoch:
            rng = np.random.default_rng(np.random.SeedSequence([*self.key, epoch]))
            self._epoch, self._order = epoch, rng.permutation(self.size)
        return int(self._order[place])  # type: ignore[index]

    def take(self, count: int, keep: Container[int]) -> dict[int, tuple[Any, Any]]:
        """The indices of the next ``count`` draws kept (loaded by ``load`` in their micro-batch)."""
        kept = {offset: self._index(self.drawn + offset) for offset in range(count) if offset in keep}
        self.drawn += count
        return {offset: (index, index) for offset, index in kept.items()}

    def load(self, index: int) -> Any:
        return self.dataset[index]

    def position(self) -> None:
        return None  # the step alone gives it
