"""``--compile`` under the strategies that wrap or cut the model, on 2 real processes: the same
parameters as one eager process (float64).

- fsdp: each compiled block is sharded as a unit (compiled first, then ``fully_shard``);
- ddp: DDP around the whole compiled model;
- pipeline: charlm's model is traced into stages, and each stage is compiled as one module.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import trained_weights

FIT = "fit --global-batch-size 16 --micro-batch-size 4 --max-steps 5 --progress plain --logger none"
FIT = [*FIT.split(), "--checkpoint-every", "never"]


@pytest.mark.parametrize(
    ("task", "flags"),
    [
        ("block_regression", ["--strategy", "fsdp", "--compile", "blocks"]),
        ("block_regression", ["--strategy", "ddp", "--compile", "model"]),
        ("tiny_charlm", ["--strategy", "pipeline", "--pipeline-stages", "2", "--compile", "blocks"]),
    ],
    ids=["fsdp-blocks", "ddp-model", "pipeline-blocks"],
)
def test_a_compiled_run_on_two_processes_trains_as_one_eager_process(tmp_path, task, flags):
    fit = [*FIT, "--task", f"tests.distributed.tasks:{task}"]
    one = trained_weights(tmp_path / "one", [*fit, "--micro-batch-size", "16"])
    two = trained_weights(tmp_path / "two", [*fit, *flags], processes=2)
    assert sorted(two) == sorted(one)
    assert max(float((two[name] - one[name]).abs().max()) for name in one) <= 1e-9
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["strategy"] == flags[1] and summary["compile_seconds"] > 0
