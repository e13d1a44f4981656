"""SPEC invariants 1-3 across processes: the global batch defines the math, whatever the split."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import fit_here, launch_here

GLOBAL = 16
STEPS = 20
# (processes, micro-batch): 1 x (4 x 4 accumulation), 2 x (4 x 2), 4 x (4 x 1), 1 x 16
SPLITS = [(1, 4), (2, 4), (4, 4), (1, 16)]


def train(out, task: str, processes: int, micro: int, flags: list[str]) -> dict[str, torch.Tensor]:
    fit = ["fit", "--task", f"tests.distributed.tasks:{task}", "--global-batch-size", str(GLOBAL),
           "--micro-batch-size", str(micro), "--max-steps", str(STEPS), "--out", str(out)]  # fmt: skip
    fit += flags
    if processes == 1:
        fit_here(*fit)
    else:
        launch_here("--nproc-per-node", str(processes), *fit)
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("task", ["mean_task", "sum_task"])
def test_one_two_and_four_processes_give_the_same_parameters(tmp_path, task, quiet_fit_flags):
    results = {
        split: train(tmp_path / f"{split[0]}x{split[1]}", task, *split, quiet_fit_flags) for split in SPLITS
    }
    reference = results[(1, 16)]
    for split, weights in results.items():
        for name, tensor in reference.items():
            assert tensor.dtype == torch.float64
            difference = float((weights[name] - tensor).abs().max())
            assert difference <= 1e-10, (
                f"{split[0]} process(es) x micro {split[1]}: {name} differs by {difference}"
            )
    initial_run = train(tmp_path / "one-step", task, 1, 16, [*quiet_fit_flags, "--max-steps", "1"])
    assert any(float((initial_run[n] - reference[n]).abs().max()) > 1e-3 for n in reference)  # it trained


def test_a_stream_split_over_two_processes_and_their_workers_trains_as_one_process(tmp_path, quiet_fit_flags):
    """Each process reads the whole stream and keeps its share; --num-workers auto: 1 worker each here."""
    one = train(tmp_path / "one", "mean_task", 1, 8, [*quiet_fit_flags, "--shuffle", "false"])
    two = train(tmp_path / "two", "unsized_stream_task", 2, 4, [*quiet_fit_flags, "--num-workers", "auto"])
    for name, tensor in one.items():
        assert float((two[name] - tensor).abs().max()) <= 1e-10, name


def test_activation_checkpointing_under_ddp_trains_as_one_process_without_it(tmp_path, quiet_fit_flags):
    one = train(tmp_path / "one", "mean_task", 1, 16, quiet_fit_flags)
    two = train(
        tmp_path / "two", "mean_task", 2, 4, [*quiet_fit_flags, "--activation-checkpointing", "Linear"]
    )
    for name, tensor in one.items():
        assert float((two[name] - tensor).abs().max()) <= 1e-10, name
