"""A checkpoint resumed on another number of processes: ddp 2 -> 1 and 1 -> 2, fsdp 2 -> 1 and 2 -> 4.

Float64 LossSum, no dropout: stopped at step 10 of 20 and resumed on the other split, the run ends
within 1e-10 of an uninterrupted one-process run: weights, their moving average, and the loss
logged at the first log point after the resume (which counts losses saved by the other split).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.distributed.conftest import fit_here, launch_here

FIT = ["fit", "--task", "tests.distributed.tasks:sum_task", "--global-batch-size", "16",
       "--micro-batch-size", "4", "--max-steps", "20", "--progress", "plain", "--logger", "none",
       "--log-every-n-steps", "3", "--checkpoint-every", "5", "--keep-checkpoints", "4",
       "--ema-decay", "0.8"]  # fmt: skip


def run(out: Path, processes: int, *flags: str) -> str:
    """Train into ``out``; the workers' output with several processes."""
    arguments = [*FIT, "--out", str(out), *flags]
    if processes == 1:
        fit_here(*arguments)
        return ""
    return launch_here("--nproc-per-node", str(processes), *arguments).stdout


def logged_losses(out: Path) -> dict[int, float]:
    with (out / "metrics.csv").open() as rows:
        return {
            int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(rows) if row["train_loss"]
        }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world-change") / "uninterrupted"
    run(out, 1)
    return out


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, uninterrupted):
    """``stopped(processes, flags)``: the run whose step 10 is resumed, trained once per split and
    strategy (ddp 2 -> 1 and 2 -> 2 resume the same one, and fsdp's 2 -> 1 and 2 -> 4; one process's
    is the uninterrupted run)."""
    runs: dict[tuple[int, tuple[str, ...]], Path] = {(1, ()): uninterrupted}

    def first(processes: int, flags: list[str]) -> Path:
        key = (processes, tuple(flags))
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("first")
            run(runs[key], processes, *flags)
        return runs[key]

    return first


FSDP = ["--strategy", "fsdp"]


@pytest.mark.parametrize(
    ("before", "after", "flags", "resumed_flags"),
    [(2, 1, [], []), (1, 2, [], []), (2, 1, FSDP, []), (2, 4, FSDP, FSDP), (2, 2, [], [])],
    ids=["ddp-2-to-1", "ddp-1-to-2", "fsdp-2-to-1", "fsdp-2-to-4", "ddp-2-to-2"],
)
def test_a_run_resumes_on_another_number_of_processes_as_if_uninterrupted(
    tmp_path, uninterrupted, stopped, before, after, flags, resumed_flags
):
    # Step 10's checkpoint holds step 10's loss, logged at step 12. fsdp's shards are gathered into
    # one process, or resharded over 4 by DCP.
    out = tmp_path / "resumed"
    checkpoint = stopped(before, flags) / "checkpoints" / "step-00000010.pt"
    resumed = run(out, after, "--resume", str(checkpoint), *resumed_flags)
    if after > 1:  # (the same number: each rank takes its own losses back, not rank 0's)
        note = f"resumed on {after} process(es) a checkpoint saved by {before}"
        assert (note in resumed) == (after != before)
    for weights in ("model.safetensors", "ema.safetensors"):
        actual, expected = load_file(out / weights), load_file(uninterrupted / weights)
        assert sorted(actual) == sorted(expected)
        for name, tensor in expected.items():
            assert float((actual[name] - tensor).abs().max()) <= 1e-10, (weights, name)
    losses, expected_losses = logged_losses(out), logged_losses(uninterrupted)
    assert sorted(losses) == [12, 15, 18, 20]
    for step, loss in losses.items():
        assert loss == pytest.approx(expected_losses[step], rel=1e-12, abs=0), step


def test_a_whole_checkpoint_does_not_resume_under_fsdp_and_says_what_does(tmp_path):
    out = tmp_path / "run"
    run(out, 1, "--max-steps", "2")
    arguments = [*FIT, "--max-steps", "4", "--out", str(out), "--resume", "auto", "--strategy", "fsdp"]
    done = launch_here("--nproc-per-node", "2", *arguments, check=False)
    assert done.returncode != 0
    message = (
        f"leantrain: error: checkpoint {out / 'checkpoints' / 'step-00000002.pt'} holds its model whole "
        "(strategy auto), and strategy fsdp resumes only from shards: resume it with a strategy that "
        "holds the whole model (single, ddp)"
    )
    # Both ranks say it; torchrun's own log lines may land between a line's parts, so not per line.
    assert message in done.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002.pt"]  # nothing lost
