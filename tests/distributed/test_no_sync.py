"""Invariant 3: no gradient all-reduce on non-final micro-batches."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.distributed.conftest import REPO, worker_env


def test_gradients_are_all_reduced_once_per_optimizer_step():
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "distributed" / "nosync_probe.py")],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    steps, micro_batches = 3, 4
    # the model fits in one DDP bucket: one all-reduce per optimizer step, in the final backward
    assert result["with_no_sync"]["gradient_all_reduces"] == steps
    # the control: without no_sync every micro-batch's backward all-reduces
    assert result["without_no_sync"]["gradient_all_reduces"] == steps * micro_batches
    # the LossSum count: one all-reduce per optimizer step, after the micro-batches
    assert result["with_no_sync"]["count_all_reduces"] == steps
