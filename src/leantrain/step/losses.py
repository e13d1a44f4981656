"""Training loss kept on the device and read only at log points.

The window since the last read lives in a few fixed buffers, not in one tensor per
micro-batch: adding a loss copies it into a preallocated float64 slot (one small kernel,
no host sync, no autograd graph kept), and the loss tensor itself is freed with its step.
Many small tensors kept alive until the log point would fragment the host heap around
the step's freed activations: the process's memory would climb between log points
(measured in benchmarks/results/memory.md). :meth:`LossTracker.read` is the one sync
point, called every ``log_every_n_steps`` steps.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch

# Entries a new window has room for; the buffers double when a window holds more
# (a long log interval or many micro-batches): a handful of allocations in a whole run.
_INITIAL_CAPACITY = 64


@dataclass(frozen=True)
class LossWindow:
    """The losses of the optimizer steps since the previous read."""

    mean_loss: float  # over every sample (or element, for LossSum) in the window
    last_step_loss: float  # over the last optimizer step's batch (the global batch when reduced)
    # (step index, loss over its batch) for each step of the window, in order: what spikes are judged on.
    step_losses: tuple[tuple[int, float], ...] = ()


class LossTracker:
    """The micro-batch losses of the steps since the last read, in fixed device buffers.

    Entry ``i`` is a mean loss over ``weight`` samples, or (``is_mean`` false) a LossSum's sum
    and element count. Totals are kept as float64 (the cast is exact), in a device buffer;
    weights given as Python ints stay on the host (no kernel), counts given as tensors go to
    a second device buffer.
    """

    def __init__(self) -> None:
        self._size = 0  # entries in the window
        self._totals: _Column | None = None  # on the loss's device
        self._counts: _Column | None = None  # counts given as tensors; made at the first one
        self._weights = array("d")  # per entry: an int weight, or NaN where the count is a tensor
        self._is_mean: list[bool] = []
        self._step_starts: list[tuple[int, int]] = []  # (step, its first entry), one per step

    def add(self, step: int, total: torch.Tensor, weight: torch.Tensor | int, is_mean: bool) -> None:
        """A mean loss over ``weight`` samples, or (``is_mean=False``) a LossSum's sum and count."""
        if not self._step_starts or self._step_starts[-1][0] != step:
            self._step_starts.append((step, self._size))
        index = self._size
        if self._totals is None:
            self._totals = _Column(_INITIAL_CAPACITY, total.device)
        elif index == len(self._totals):
            self._totals = self._totals.doubled()
            if self._counts is not None:
                self._counts = self._counts.doubled()
        # Detached in case a caller hands over a loss with its graph: the buffer must not join it.
        self._totals.data[index] = total.detach() if total.requires_grad else total
        if isinstance(weight, torch.Tensor):
            if self._counts is None:
                self._counts = _Column(len(self._totals), self._totals.data.device)
            self._counts.data[index] = weight
            self._weights.append(math.nan)
        else:
            self._weights.append(weight)
        self._is_mean.append(is_mean)
        self._size = index + 1

    def discard_step(self, step: int) -> None:
        """Forget the losses of ``step`` (the newest), e.g. a step dropped for a non-finite loss."""
        if self._step_starts and self._step_starts[-1][0] == step:
            _, start = self._step_starts.pop()
            self._truncate(start)

    def _truncate(self, size: int) -> None:
        self._size = size
        del self._weights[size:]
        del self._is_mean[size:]

    def state_dict(self) -> dict[str, Any]:
        """The losses not yet logged (a checkpoint between log points keeps them)."""
        steps: list[int] = []
        for (step, start), (_, end) in pairwise([*self._step_starts, (-1, self._size)]):
            steps.extend([step] * (end - start))
        totals, weights = self._entries()
        is_mean = list(self._is_mean)
        return {"steps": steps, "totals": totals.cpu(), "weights": weights.cpu(), "is_mean": is_mean}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore a saved window (also the per-entry lists that earlier versions saved)."""
        self.clear()
        totals, weights = state["totals"], state["weights"]
        for i, (step, is_mean) in enumerate(zip(state["steps"], state["is_mean"], strict=True)):
            weight = weights[i]
            if isinstance(weight, torch.Tensor):
                weight = weight.to(device)  # a float64 tensor: the same value as the int it was
            self.add(step, torch.as_tensor(totals[i]).to(device), weight, is_mean)

    def _entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's totals and weights, float64 on the device (weights: the host ints, and
        the device counts where the host column holds NaN)."""
        if self._totals is None:
            return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
        totals = self._totals.data[: self._size]
        weights = torch.tensor(self._weights, dtype=torch.float64, device=totals.device)
        if self._counts is not None:
            weights = torch.where(weights.isnan(), self._counts.data[: self._size], weights)
        return totals, weights

    def read(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LossWindow | None:
        """Reduce and clear the window (a host sync); None when nothing was added.

        With ``all_reduce_sum``, every rank's losses are summed first, so the window is the
        loss of the whole global batch. Every rank adds the same number of entries.
        """
        if not self._size:
            return None
        totals, weights = self._entries()
        is_mean = torch.tensor(self._is_mean, device=totals.device)
        both = torch.stack([torch.where(is_mean, totals * weights, totals), weights])
        if all_reduce_sum is not None:
            both = all_reduce_sum(both)
        sums, weights = both.cpu()  # the one host sync
        last = torch.arange(self._size) >= self._step_starts[-1][1]
        starts = [start for _, start in self._step_starts]
        per_step = np.add.reduceat(sums.numpy(), starts) / np.add.reduceat(weights.numpy(), starts).clip(1)
        window = LossWindow(
            mean_loss=float(sums.sum() / weights.sum().clamp(min=1)),
            last_step_loss=float(sums[last].sum() / weights[last].sum().clamp(min=1)),
            step_losses=tuple(zip((step for step, _ in self._step_starts), per_step.tolist(), strict=True)),
        )
        self.clear()
        return window

    def clear(self) -> None:
        """An empty window; the buffers stay for the next one."""
        self._step_starts.clear()
        self._truncate(0)


class _Column:
    """A float64 buffer on the device, written one entry at a time; grown by doubling."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.data = torch.empty(capacity, dtype=torch.float64, device=device)

    def __len__(self) -> int:
        return len(self.data)

    def doubled(self) -> _Column:
        grown = _Column(2 * len(self), self.data.device)
        grown.data[: len(self)] = self.data
        return grown
