"""The doctor on a real 2-process DDP run: the exposed all-reduce is measured as communication."""

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
