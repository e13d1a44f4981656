"""The order of samples: defined by the global batch, never by the split.

Epoch ``e``'s order is a permutation drawn from ``(seed, e)``. Global step ``s`` of the
run takes the next ``global_batch_size`` indices of that order (a last partial global
batch is dropped, so every step has the same size and ``s`` alone fixes the epoch and
the position in it). Rank ``r`` takes the ``r``-th contiguous share of the global
batch, and that share is cut into micro-batches in order. So the set of samples in
each optimizer step depends only on the seed and the global batch size, and resuming
at step ``s`` needs nothing but ``s``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from leantrain.errors import LeantrainError
from leantrain.step.batching import BatchSplit


def steps_per_epoch(dataset_size: int, batch_split: BatchSplit) -> int:
    """Whole global batches in one pass over the data (a last partial one is dropped)."""
    if dataset_size < batch_split.global_batch_size:
        raise LeantrainError(
            f"the training data has {dataset_size} samples, fewer than one global batch "
            f"(global_batch_size={batch_split.global_batch_size})"
        )
    return dataset_size // batch_split.global_batch_size


class MicroBatch(list):
    """The indices of one micro-batch, and where it sits in the run: ``(step, rank, micro)``.

    The process that loads it (a worker, or the main process) seeds its host RNGs from
    ``(seed, *position)`` first (see ``data/loader.py``), so random augmentation depends on the
    sample's place in the run, not on which process loads it, how far ahead a prefetcher
    reads, or whether the run was resumed.
    """

    def __init__(self, indices: list[int], position: tuple[int, int, int]) -> None:
        super().__init__(indices)
        self.position = position


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of indices) for steps ``start_step..total_steps-1``."""

    def __init__(
        self,
        dataset_size: int,
        batch_split: BatchSplit,
        total_steps: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        start_step: int = 0,
    ) -> None:
        self._steps_per_epoch = steps_per_epoch(dataset_size, batch_split)
        self.dataset_size = dataset_size
        self.batch_split = batch_split
        self.total_steps = total_steps
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.start_step = start_step
        self._cached_epoch: int | None = None
        self._cached_order: list[int] = []

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of all indices for one epoch (a list: slicing it per step is cheap)."""
        if epoch != self._cached_epoch:
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
                self._cached_order = rng.permutation(self.dataset_size).tolist()
            else:
                self._cached_order = list(range(self.dataset_size))
            self._cached_epoch = epoch
        return self._cached_order

    def global_batch(self, step: int) -> list[int]:
        """All indices of global step ``step`` (every rank's share)."""
        epoch, position = divmod(step, self._steps_per_epoch)
        size = self.batch_split.global_batch_size
        return self.epoch_order(epoch)[position * size : (position + 1) * size]

    def __iter__(self) -> Iterator[list[int]]:
        share = self.batch_split.per_rank_batch_size
        micro = self.batch_split.micro_batch_size
        for step in range(self.start_step, self.total_steps):
            mine = self.global_batch(step)[self.rank * share : (self.rank + 1) * share]
            for number, start in enumerate(range(0, share, micro)):
                yield MicroBatch(mine[start : start + micro], (step, self.rank, number))

    def __len__(self) -> int:
        return max(self.total_steps - self.start_step, 0) * self.batch_split.accumulation_steps
