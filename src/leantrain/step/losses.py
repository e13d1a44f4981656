"""Training loss kept on the device and read only at log points.

Adding a micro-batch's loss is a list append of a detached tensor: no kernel, no host
sync and no autograd graph kept alive. :meth:`LossTracker.read` is the one sync point,
called every ``log_every_n_steps`` steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossWindow:
    """The losses of the optimizer steps since the previous read."""

    mean_loss: float  # over every sample (or element, for LossSum) in the window
    last_step_loss: float  # over the last optimizer step's batch (the global batch when reduced)


class LossTracker:
    def __init__(self) -> None:
        self._steps: list[int] = []
        self._totals: list[torch.Tensor] = []  # a mean loss, or a LossSum's sum
        self._weights: list[torch.Tensor | int] = []  # samples of a mean, or the LossSum's count
        self._is_mean: list[bool] = []

    def add(self, step: int, total: torch.Tensor, weight: torch.Tensor | int, is_mean: bool) -> None:
        """A mean loss over ``weight`` samples, or (``is_mean=False``) a LossSum's sum and count."""
        self._steps.append(step)
        self._totals.append(total)
        self._weights.append(weight)
        self._is_mean.append(is_mean)

    def extend(self, other: LossTracker) -> None:
        """Append ``other``'s entries after this tracker's."""
        for column, more in zip(
            (self._steps, self._totals, self._weights, self._is_mean),
            (other._steps, other._totals, other._weights, other._is_mean),
            strict=True,
        ):
            column.extend(more)

    def discard_step(self, step: int) -> None:
        """Forget the losses of ``step`` (the newest), e.g. a step dropped for a non-finite loss."""
        while self._steps and self._steps[-1] == step:
            for column in (self._steps, self._totals, self._weights, self._is_mean):
                column.pop()

    def __len__(self) -> int:
        return len(self._steps)

    def state_dict(self) -> dict[str, list]:
        """The losses not yet logged (a checkpoint between log points keeps them)."""
        return {
            "steps": list(self._steps),
            "totals": [t.detach() for t in self._totals],
            "weights": [w.detach() if isinstance(w, torch.Tensor) else w for w in self._weights],
            "is_mean": list(self._is_mean),
        }

    def load_state_dict(self, state: dict[str, list], device: torch.device) -> None:
        self._steps = list(state["steps"])
        self._totals = [t.to(device) for t in state["totals"]]
        self._weights = [w.to(device) if isinstance(w, torch.Tensor) else w for w in state["weights"]]
        self._is_mean = list(state["is_mean"])

    def read(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> LossWindow | None:
        """Reduce and clear the window (a host sync); None when nothing was added.

        With ``all_reduce_sum``, every rank's losses are summed first, so the window is the
        loss of the whole global batch. Every rank adds the same number of entries.
        """
        if not self._steps:
            return None
        device = self._totals[0].device
        is_mean = torch.tensor(self._is_mean, device=device)
        totals = _stack_float64(self._totals)
        if all(isinstance(w, int) for w in self._weights):
            weights = torch.tensor(self._weights, dtype=torch.float64, device=device)
        else:
            weights = _stack_float64([torch.as_tensor(w, device=device) for w in self._weights])
        both = torch.stack([torch.where(is_mean, totals * weights, totals), weights])
        if all_reduce_sum is not None:
            both = all_reduce_sum(both)
        sums, weights = both.cpu()  # the one host sync
        steps = torch.tensor(self._steps)
        last = steps == steps[-1]
        window = LossWindow(
            mean_loss=float(sums.sum() / weights.sum().clamp(min=1)),
            last_step_loss=float(sums[last].sum() / weights[last].sum().clamp(min=1)),
        )
        self._steps, self._totals, self._weights, self._is_mean = [], [], [], []
        return window


def _stack_float64(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One stack then one cast when the dtypes agree (the usual case): two kernels, not 2n."""
    if len({t.dtype for t in tensors}) == 1:
        return torch.stack(tensors).to(torch.float64)
    return torch.stack([t.to(torch.float64) for t in tensors])
