"""Invariant 3: no gradient all-reduce on non-final micro-batches."""

from __future__ import annotations

import json

from tests.distributed.conftest import REPO, torchrun_here


def test_gradients_are_all_reduced_once_per_optimizer_step():
    probe = str(REPO / "tests" / "distributed" / "nosync_probe.py")
    output = torchrun_here("--standalone", "--nproc-per-node", "2", probe)
    (result,) = [json.loads(line) for line in output.splitlines() if line.startswith('{"with_no_sync"')]
    steps, micro_batches = 3, 4
    # the model fits in one DDP bucket: one all-reduce per optimizer step, in the final backward
    assert result["with_no_sync"]["gradient_all_reduces"] == steps
    # the control: without no_sync every micro-batch's backward all-reduces
    assert result["without_no_sync"]["gradient_all_reduces"] == steps * micro_batches
    # the LossSum count: one all-reduce per optimizer step, after the micro-batches
    assert result["with_no_sync"]["count_all_reduces"] == steps
