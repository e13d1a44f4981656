"""Run under torchrun with 2 processes: counts gradient all-reduces per optimizer step.

Prints one JSON line (rank 0): the DDP communication-hook calls and LossSum count
all-reduces for 3 optimizer steps of 4 micro-batches, with the Accumulator's no_sync and,
as the control, with no_sync replaced by a do-nothing context.
"""

from __future__ import annotations

import gc
import json
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leantrain as lt
from leantrain.batching import Accumulator, BatchPlan
from leantrain.log.metrics import LossTracker
from leantrain.parallel.apply import init_process_group, parallelize
from leantrain.parallel.dims import ParallelDims
from leantrain.parallel.env import detect
from leantrain.precision import Fp32

STEPS, MICRO, PER_RANK = 3, 2, 8


def count_communication(use_no_sync: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    plan = parallelize(model, ParallelDims(dp=2), lt.TrainConfig(), "ddp", torch.device("cpu"))
    counts = {"gradient_all_reduces": 0, "count_all_reduces": 0}

    def counting_hook(state, bucket):
        counts["gradient_all_reduces"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    def counting_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        counts["count_all_reduces"] += 1
        return plan.all_reduce_sum(tensor)

    plan.module.register_comm_hook(dist.group.WORLD, counting_hook)
    accumulator = Accumulator(
        BatchPlan(global_batch_size=2 * PER_RANK, micro_batch_size=MICRO, world_size=2),
        Fp32(),
        model.parameters(),
        no_sync=plan.no_sync if use_no_sync else nullcontext,
        all_reduce_sum=counting_all_reduce,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter([(torch.randn(MICRO, 4), torch.randn(MICRO, 1))] * (STEPS * PER_RANK // MICRO))

    def loss(module: nn.Module, batch) -> lt.LossSum:
        x, y = batch
        return lt.LossSum(((module(x) - y) ** 2).sum(), y.numel())

    for step in range(STEPS):
        accumulator.step(plan.module, optimizer, loss, batches, step, LossTracker())
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
