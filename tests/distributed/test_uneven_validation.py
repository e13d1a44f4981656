"""Every rank runs the same number of validation forwards, whatever the shares: a strategy whose
forward communicates (fsdp gathers parameters from every rank; a pipeline's stages pass activations)
must not leave a rank waiting in a collective, nor leave samples out."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed.conftest import trained_weights
from tests.distributed.tasks import UnevenValidation

# Watching a metric other than val_loss checks its name before training, on one validation batch
# through the strategy (a sharded forward; a pipeline's stages): the runs below do that too.
FIT = ["fit", "--task", "tests.distributed.tasks:UnevenValidation", "--global-batch-size", "8",
       "--micro-batch-size", "2", "--max-steps", "2", "--progress", "plain", "--logger", "none",
       "--early-stop-metric", "val_abs_error", "--early-stop-patience", "5",
       "--val-every-n-steps", "2"]  # fmt: skip


def validation(out) -> dict[str, float]:
    summary = json.loads((out / "summary.json").read_text())
    return {name: value for name, value in summary.items() if name.startswith("val_")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, float]:
    out = tmp_path_factory.mktemp("one")
    trained_weights(out, FIT)
    return validation(out)


@pytest.mark.parametrize("layout", [
    ["--strategy", "fsdp"],  # 26 and 25 batches: the second rank runs one spare forward
    ["--strategy", "pipeline", "--pipeline-stages", "2"],  # 51 batches, the last of 1 sample: padded
])  # fmt: skip
def test_uneven_validation_shares_validate_as_one_process(tmp_path, one_process, layout):
    trained_weights(tmp_path, [*FIT, *layout], processes=2)
    two = validation(tmp_path)
    assert sorted(two) == sorted(one_process) == ["val_abs_error", "val_loss"]
    for name, value in one_process.items():
        assert abs(two[name] - value) <= 1e-12, (name, two[name], value)


class OneValidationSample(UnevenValidation):
    """UnevenValidation with 1 validation sample: on 2 processes, the second has no validation batch."""

    def val_data(self):
        return torch.utils.data.TensorDataset(self.x[:1], self.y[:1], self.mask[:1])


def test_a_process_with_no_validation_batch_still_checks_the_watched_metrics_name(tmp_path):
    """The name check before training runs one validation batch through the strategy on every process:
    one with none runs a spare (the bug: the run fails at the start on that process)."""
    flags = [
        *FIT,
        "--task",
        "tests.distributed.test_uneven_validation:OneValidationSample",
        "--max-steps",
        "1",
    ]
    trained_weights(tmp_path, [*flags, "--strategy", "fsdp"], processes=2)
    assert sorted(validation(tmp_path)) == ["val_abs_error", "val_loss"]
