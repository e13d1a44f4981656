"""The NaN policy across processes: every rank takes the same decision, so none waits or diverges."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.distributed.conftest import fit_here, launch_here

FIT = ["--global-batch-size", "16", "--max-steps", "6"]


def test_a_nan_on_one_rank_stops_every_rank_after_saving_the_last_good_state(tmp_path, quiet_fit_flags):
    out = tmp_path / "run"
    fit = ["fit", "--task", "tests.distributed.tasks:nan_on_rank1_at_step3", *FIT, *quiet_fit_flags]
    done = launch_here("--nproc-per-node", "2", *fit, "--out", str(out), check=False)
    assert done.returncode != 0
    assert "not finite at step 3" in done.stdout
    assert (out / "checkpoints" / "step-00000002.pt").is_file()


def test_skip_on_one_rank_is_skip_on_all_and_matches_one_process(tmp_path, quiet_fit_flags):
    two = tmp_path / "two"
    task = "tests.distributed.tasks:nan_on_rank1_at_step3"
    launch_here("--nproc-per-node", "2", "fit", "--task", task,
              *FIT, *quiet_fit_flags, "--on-nan", "skip", "--out", str(two))  # fmt: skip
    one = tmp_path / "one"
    task = "tests.distributed.tasks:nan_in_second_half_of_step3"
    fit_here("fit", "--task", task, "--micro-batch-size", "8",
             *FIT, *quiet_fit_flags, "--on-nan", "skip", "--out", str(one))  # fmt: skip
    reference, weights = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for name, tensor in reference.items():
        assert bool(torch.isfinite(weights[name]).all()), name
        assert float((weights[name] - tensor).abs().max()) <= 1e-10, name


def test_true_bf16_and_loss_scaled_fp16_run_under_ddp(tmp_path, quiet_fit_flags):
    """The float64 task's masters are fp32 in bf16-true; 16-mixed keeps the model's float64."""
    for precision, dtype in (("bf16-true", torch.float32), ("16-mixed", torch.float64)):
        out = tmp_path / precision
        launch_here("--nproc-per-node", "2", "fit", "--task", "tests.distributed.tasks:mean_task",
                  "--precision", precision, "--max-grad-norm", "1.0", *FIT, *quiet_fit_flags,
                  "--out", str(out))  # fmt: skip
        weights = load_file(out / "model.safetensors")
        assert all(bool(torch.isfinite(t).all()) and t.dtype == dtype for t in weights.values())
