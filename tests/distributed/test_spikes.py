"""Rollback on two processes: every rank decides the same (the judged losses are reduced over the ranks),
ddp and fsdp heal as one process does, and a sharded run killed mid-recovery resumes bit-identical."""

from __future__ import annotations

import json
import shutil

import torch

from tests.distributed.conftest import trained_weights

FIT = ["fit", "--task", "tests.distributed.tasks:planted_spikes", "--global-batch-size", "16",
       "--max-steps", "46", "--log-every-n-steps", "5", "--on-spike", "rollback", "--snapshot-every", "10",
       "--checkpoint-every", "4", "--keep-checkpoints", "12", "--val-every-n-steps", "1000",
       "--progress", "plain", "--logger", "none"]  # fmt: skip


def rollbacks(out) -> list[tuple[int, int, list[int]]]:
    summary = json.loads((out / "summary.json").read_text())
    return [(r["step"], r["restored_step"], r["skipped_steps"]) for r in summary["rollbacks"]]


def test_ddp_and_fsdp_roll_back_as_one_process_and_fsdp_resumes_mid_recovery_exactly(tmp_path):
    one = trained_weights(tmp_path / "one", FIT)
    assert rollbacks(tmp_path / "one") == [(27, 20, [21, 30]), (44, 40, [41, 45])]
    two = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / strategy
        two[strategy] = trained_weights(out, [*FIT, "--strategy", strategy], processes=2)
        assert rollbacks(out) == rollbacks(tmp_path / "one"), strategy
        for name, value in one.items():  # a rank that did not roll back would leave the weights apart
            assert (two[strategy][name] - value).abs().max().item() <= 1e-10, (strategy, name)

    # The fsdp run killed after step 29: its checkpoint of step 28 holds each rank's snapshot of step 20.
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "fsdp", killed)
    for late in (killed / "checkpoints").iterdir():
        if int(late.name.split("-")[1].split(".")[0]) > 28:
            shutil.rmtree(late) if late.is_dir() else late.unlink()
    (killed / "model.safetensors").unlink()
    assert max(p.name for p in (killed / "checkpoints").iterdir()).startswith("step-00000028")
    resumed = trained_weights(killed, [*FIT, "--strategy", "fsdp", "--resume", "auto"], processes=2)
    assert rollbacks(killed) == rollbacks(tmp_path / "one")
    for name, value in two["fsdp"].items():
        assert torch.equal(resumed[name], value), name
