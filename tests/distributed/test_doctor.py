"""The doctor on real 2-process runs: DDP's exposed all-reduce, and tensor parallelism's collectives, are
measured as communication."""

from __future__ import annotations

import json

from leantrain.diagnose.advice import VERDICTS
from tests.distributed.conftest import launch_here


def test_doctor_under_launch_measures_communication(tmp_path):
    done = launch_here(
        "--nproc-per-node", "2", "doctor", "--example", "charlm", "--steps", "3",
        "--warmup-steps", "2", "--global-batch-size", "16", "--micro-batch-size", "4", "--json",
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1  # rank 0 speaks for both
    [report] = reports
    assert report["verdict"] in VERDICTS
    assert report["run"]["world_size"] == 2 and report["run"]["strategy"] == "ddp"
    assert report["run"]["accumulation_steps"] == 2
    # One all-reduce per optimizer step: only the last of the 2 micro-batches communicates.
    assert report["phases"]["communication"] > 0
    titles = [advice["title"] for advice in report["advice"]]
    assert "all-reduce gradients once per optimizer step, not per micro-batch" not in titles


def test_doctor_under_tensor_parallelism_counts_its_collectives_and_each_ranks_flops(tmp_path):
    """Bugs: TP's collectives left inside forward and backward (communication 0), the FLOPs of the
    split layers counted whole on each rank (DTensor ops carry the whole layer's shapes), advice
    meant for a gradient all-reduce (16-bit gradients, more samples) given for activations."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from leantrain.diagnose.advice import BOTTLENECK_SHARE
    from leantrain.examples.charlm import CharLMTask

    done = launch_here(
        "--nproc-per-node", "2", "doctor", "--example", "charlm", "--tp", "2", "--steps", "3",
        "--warmup-steps", "1", "--global-batch-size", "8", "--json", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    [report] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert report["run"]["tensor_parallel"] == 2
    assert report["phases"]["communication"] > 0
    # One process's FLOPs for the same micro-batch of 8: each rank computes about half (the blocks'
    # matrices split, the embedding and head whole).
    task = CharLMTask()
    counter = FlopCounterMode(display=False)
    with counter:
        task.loss(task.model(), next(iter(torch.utils.data.DataLoader(task.train_data(), batch_size=8))))[
            0
        ].backward()
    whole = counter.get_total_flops()
    assert 0.5 * whole < report["flops_per_step"] < 0.6 * whole
    titles = [advice["title"] for advice in report["advice"]]
    assert "all-reduce 16-bit gradients" not in titles
    assert "give each process more samples per all-reduce" not in titles
    share = report["phases"]["communication"] / report["step_seconds"]
    assert ("fewer ranks per tensor-parallel group" in titles) == (share >= BOTTLENECK_SHARE)
