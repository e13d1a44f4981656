"""Early stopping and the best checkpoints on 2 processes: every rank decides alike and saves together."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tests.distributed.conftest import launch_here


def test_two_processes_stop_early_together_and_keep_the_best_checkpoints(tmp_path):
    out = tmp_path / "run"
    fit = ["fit", "--task", "tests.distributed.tasks:stalled_validation", "--global-batch-size", "64",
           "--max-steps", "40", "--val-every-n-steps", "2", "--log-every-n-steps", "2", "--progress", "plain",
           "--logger", "none", "--early-stop-metric", "val_loss", "--early-stop-patience", "3",
           "--keep-best", "2", "--best-metric", "val_loss", "--keep-checkpoints", "1",
           "--checkpoint-every", "3", "--out", str(out)]  # fmt: skip
    stdout = launch_here("--nproc-per-node", "2", *fit).stdout
    summary = json.loads((out / "summary.json").read_text())
    # Validations at 2, 4, ..., 10 score 1.0, 0.9, 0.95, 0.93, 0.91: the 5th is the 3rd without a new best.
    assert (summary["steps"], summary["stopped_early"], summary["world_size"]) == (10, True, 2)
    assert "early stop at step 10" in stdout
    # The two best (0.9 at step 4, 0.91 at step 10) and the newest (10): the ranks agreed on each save.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004.pt", "step-00000010.pt"]
    best = load_file(out / "best.safetensors")
    saved = torch.load(out / "checkpoints" / "step-00000004.pt", weights_only=True)["model"]
    assert all(torch.equal(best[name], saved[name]) for name in best)
