"""Run under torchrun with 2 processes: counts gradient all-reduces per optimizer step.

Prints one JSON line (rank 0): the DDP communication-hook calls and LossSum count
all-reduces for 3 optimizer steps of 4 micro-batches, with the Accumulator's no_sync and,
as the control, with no_sync replaced by a do-nothing context.
"""

from __future__ import annotations

import gc
import json
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leantrain as lt
from leantrain.cluster import detect
from leantrain.step.accumulator import Accumulator
from leantrain.step.batching import BatchSplit
from leantrain.step.losses import LossTracker
from leantrain.step.precision import Fp32
from leantrain.strategies.ddp import Distributed
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.process_group import init_process_group

STEPS, MICRO, PER_RANK = 3, 2, 8


class Counted(Distributed):
    """DDP counting the accumulator's all-reduces; ``use_no_sync=False`` turns ``no_sync`` off."""

    def __init__(self, use_no_sync: bool, counts: dict[str, int]) -> None:
        super().__init__(lt.TrainConfig(), torch.device("cpu"), ParallelDims(dp=2))
        self.use_no_sync, self.counts = use_no_sync, counts

    def no_sync(self) -> AbstractContextManager[Any]:
        return super().no_sync() if self.use_no_sync else nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.counts["count_all_reduces"] += 1
        return super().all_reduce_sum(tensor)


def count_communication(use_no_sync: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    counts = {"gradient_all_reduces": 0, "count_all_reduces": 0}
    strategy = Counted(use_no_sync, counts)
    strategy.wrap(model, None)

    def counting_hook(state, bucket):
        counts["gradient_all_reduces"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    strategy.register_comm_hook(counting_hook)
    split = BatchSplit(global_batch_size=2 * PER_RANK, micro_batch_size=MICRO, world_size=2)
    accumulator = Accumulator(split, Fp32(), strategy, list(model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter([(torch.randn(MICRO, 4), torch.randn(MICRO, 1))] * (STEPS * PER_RANK // MICRO))

    def loss(module: nn.Module, batch) -> lt.LossSum:
        x, y = batch
        return lt.LossSum(((module(x) - y) ** 2).sum(), y.numel())

    for step in range(STEPS):
        accumulator.step(optimizer, loss, batches, step, LossTracker())
    return counts


def main() -> None:
    env = detect()
    init_process_group(env, torch.device("cpu"))
    result = {"with_no_sync": count_communication(True), "without_no_sync": count_communication(False)}
    if env.is_main:
        print(json.dumps(result))
    # DDP objects sit in reference cycles: collect them while the process group still exists.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
