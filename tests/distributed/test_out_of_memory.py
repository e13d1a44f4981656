"""Out of memory on one rank only: every rank halves its micro-batch at the same step, none hangs."""

from __future__ import annotations

from safetensors.torch import load_file

import leantrain as lt
from leantrain.memory.estimate import estimate_memory
from tests.conftest import HeavyFromStep
from tests.distributed.conftest import fit_here, launch_here


def test_one_rank_out_of_memory_makes_both_halve_and_the_run_matches_one_process(tmp_path, quiet_fit_flags):
    rows = {
        r.micro_batch_size: r
        for r in estimate_memory(HeavyFromStep(), lt.TrainConfig(global_batch_size=16)).rows
    }
    budget = (rows[4].memory.total_bytes + rows[8].memory.total_bytes) // 2  # heavy: 4 fits, 8 does not
    fit = ["fit", "--global-batch-size", "16", "--max-steps", "8", *quiet_fit_flags]
    task = "tests.distributed.tasks:heavy_on_rank1_later"
    two = launch_here("--nproc-per-node", "2", *fit, "--task", task, "--micro-batch-size", "8",
                    "--memory-budget", str(budget), "--out", str(tmp_path / "two"))  # fmt: skip
    assert "micro-batch 8 -> 4" in two.stdout + two.stderr
    fit_here(*fit, "--task", "tests.distributed.tasks:mean_task", "--out", str(tmp_path / "one"))
    one, both = (
        load_file(tmp_path / "one" / "model.safetensors"),
        load_file(tmp_path / "two" / "model.safetensors"),
    )
    for name, tensor in one.items():
        assert float((both[name] - tensor).abs().max()) <= 1e-10, name


def test_auto_agrees_on_the_smallest_size_over_the_ranks(tmp_path, quiet_fit_flags):
    """Rank 1's micro-batches are heavy: its search finds 2 where rank 0's finds 8; both use 2."""
    rows = {
        r.micro_batch_size: r
        for r in estimate_memory(HeavyFromStep(), lt.TrainConfig(global_batch_size=16)).rows
    }
    budget = (rows[2].memory.total_bytes + rows[4].memory.total_bytes) // 2
    task = "tests.distributed.tasks:heavy_on_rank1"
    flags = ["--global-batch-size", "16", "--max-steps", "3", "--micro-batch-size", "auto",
             "--memory-budget", str(budget), *quiet_fit_flags, "--out", str(tmp_path / "run")]  # fmt: skip
    done = launch_here("--nproc-per-node", "2", "fit", "--task", task, *flags)
    assert "micro-batch 2 x 4 accumulation" in done.stdout
    assert "out of memory" not in done.stdout + done.stderr
