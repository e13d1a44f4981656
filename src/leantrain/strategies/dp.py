"""``--strategy dp``: ``nn.DataParallel`` over the visible GPUs of one process (kept for comparison)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from leantrain.strategies.base import Caveat, Example, Strategy

DP_WARNING = (
    "strategy dp (DataParallel) drives every GPU from one process: each step it scatters the "
    "inputs, copies the model to every GPU and gathers the outputs, and the Python thread is "
    "shared. DDP runs one process per GPU and communicates only gradients, overlapped with "
    "backward: `leantrain launch --nproc-per-node N fit --strategy ddp` is faster."
)


class DataParallel(Strategy):
    name = "dp"
    summary = "DataParallel: one process drives every visible GPU (slower than ddp)"
    caveat = Caveat(
        "use DistributedDataParallel instead of DataParallel",
        "strategy dp replicates the model and scatters the inputs from one process every step",
        "leantrain launch --nproc-per-node N fit --strategy ddp ...",
        "one process per GPU, only gradients communicated, overlapped with backward",
    )

    def wrap(self, model: nn.Module, example: Example | None) -> None:
        warnings.warn(DP_WARNING, stacklevel=2)
        self.model = model
        self.module = nn.DataParallel(model) if torch.cuda.device_count() > 1 else model
