"""plan --cluster's peak against real processes: the same step on real tensors under torchrun (gloo),
measured by the same tracker (benchmarks/cluster_plan_real.py's worker).

The real peak moves a little between runs (FSDP's collectives finish, and free their buffers, when the
other rank gets to them: 1,110,492 and 1,111,708 bytes in two runs of this one), so the totals are held to
within 5 %: the bugs below moved it by a gradient or by 43 %."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.conftest import torchrun_here
from tests.simulate.planned import planned

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "benchmarks" / "cluster_plan_real.py"
TASK = "tests.distributed.tasks:tiny_charlm"


@pytest.mark.parametrize("flags", [["--strategy", "fsdp", "--precision", "bf16-mixed"]])
def test_the_simulated_peak_is_a_real_ranks(tmp_path, flags):
    """Bugs: DTensor's propagation of shapes counted as this rank's memory (1.4x under fsdp bf16-mixed),
    DDP's buckets left out; any difference between the fake step and the real one."""
    out = tmp_path / "rank0.json"
    torchrun_here("--standalone", "--nproc-per-node", "2", str(WORKER), "--worker", TASK, str(out), *flags)
    real = json.loads(out.read_text())
    batch = ["--global-batch-size", "8", "--micro-batch-size", "2", "--max-grad-norm", "0.5"]
    plan = planned(["fit", "--task", TASK, *batch, *flags], 2)
    assert plan["peak_bytes"] == pytest.approx(real["peak"]["Total"], rel=0.05)
