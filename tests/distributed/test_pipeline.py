"""--strategy pipeline on real processes: 2 stages, and 2 pipelines x 2 stages (hybrid, 4 processes)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from leantrain.cli import main
from tests.distributed.conftest import launch_here, trained_weights

FIT = "fit --global-batch-size 16 --micro-batch-size 4 --max-steps 12 --progress plain --logger none"
FIT = [*FIT.split(), "--log-every-n-steps", "4"]


def train(out, task: str, *flags: str, processes: int = 1) -> dict[str, torch.Tensor]:
    return trained_weights(out, [*FIT, "--task", f"tests.distributed.tasks:{task}", *flags], processes)


def assert_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float
) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype
        assert float((actual[name] - tensor).abs().max()) <= tolerance, name


@pytest.mark.parametrize(("task", "schedule", "tolerance"), [
    ("deep_sum_task", "gpipe", 1e-10),
    ("deep_task_fp32", "1f1b", 1e-5),
])  # fmt: skip
def test_two_stages_train_as_one_process(tmp_path, task, schedule, tolerance):
    one = train(tmp_path / "one", task, "--micro-batch-size", "16")
    # 4 micro-batches of 4 flow through the 2 stages
    two = train(tmp_path / "two", task, "--strategy", "pipeline", "--pipeline-stages", "2",
                "--pipeline-schedule", schedule, processes=2)  # fmt: skip
    assert_close(two, one, tolerance)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"], summary["accumulation_steps"]) == ("pipeline", 2, 4)


def test_validation_runs_through_the_stages(tmp_path):
    train(tmp_path / "one", "DeepWithValidation")
    train(
        tmp_path / "two",
        "DeepWithValidation",
        "--strategy",
        "pipeline",
        "--pipeline-stages",
        "2",
        processes=2,
    )
    one, two = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("one", "two"))
    for name in ("val_loss", "val_abs_error"):
        assert abs(two[name] - one[name]) <= 1e-10, name


def test_a_transformer_with_tied_weights_is_traced_into_stages(tmp_path):
    """charlm's model is no Sequential: its graph is cut before blocks.2; the tied token embedding
    and head weights sit in both stages and get the sum of both uses' gradients. Clipped (it clips
    every step here): the gradient norm counts the tied weight once, as one process does."""
    clip = ("--max-grad-norm", "0.5")
    one = train(tmp_path / "one", "tiny_charlm", "--micro-batch-size", "16", *clip)
    two = train(tmp_path / "two", "tiny_charlm", "--strategy", "pipeline", "--pipeline-stages", "2", *clip,
                processes=2)  # fmt: skip
    assert_close(two, one, 1e-10)


def test_two_pipelines_of_two_stages_train_as_one_process(tmp_path):
    """Hybrid: a 2 x 2 DeviceMesh; each pipeline takes half the global batch (2 micro-batches of 4)."""
    clip = ("--max-grad-norm", "0.5")  # the norm is summed over the stages, not over the pipelines too
    one = train(tmp_path / "one", "deep_sum_task", "--micro-batch-size", "16", *clip)
    four = train(tmp_path / "four", "deep_sum_task", "--strategy", "pipeline", "--pipeline-stages", "2",
                 *clip, processes=4)  # fmt: skip
    assert_close(four, one, 1e-10)


def test_a_pipeline_resumes_from_its_sharded_checkpoint_exactly(tmp_path):
    flags = ["--strategy", "pipeline", "--pipeline-stages", "2", "--checkpoint-every", "4",
             "--ema-decay", "0.8", "--async-checkpoint", "true"]  # fmt: skip
    whole = train(tmp_path / "whole", "deep_task", *flags, processes=2)
    # Killed after step 8's save: the run without its last checkpoint and what it wrote at the end.
    parts = tmp_path / "parts"
    shutil.copytree(tmp_path / "whole", parts)
    late = [*(parts / "checkpoints").glob("step-00000012*")]
    assert late
    for path in [*late, parts / "model.safetensors", parts / "ema.safetensors"]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    task = ["--task", "tests.distributed.tasks:deep_task"]
    again = launch_here("--nproc-per-node", "2", *FIT, *task, *flags, "--resume", "auto", "--out", str(parts))
    assert ", resumed after step 8" in again.stdout  # not trained again from the start
    resumed = load_file(parts / "model.safetensors")
    assert all(torch.equal(resumed[name], whole[name]) for name in whole)
    # Each stage's part of the average is saved under its own names, and read back by its stage.
    average, expected = (load_file(tmp_path / run / "ema.safetensors") for run in ("parts", "whole"))
    assert sorted(average) == sorted(whole)
    assert all(torch.equal(average[name], expected[name]) for name in expected)
    assert any(not torch.equal(average[name], whole[name]) for name in whole)  # an average, not the weights


def test_stages_that_do_not_divide_the_processes_are_refused_before_launch(capsys):
    flags = ["--strategy", "pipeline", "--pipeline-stages", "2"]
    assert main(["launch", "--nproc-per-node", "3", *FIT, *flags]) == 2
    message = "invalid pipeline_stages=2: must divide the number of processes 3"
    assert capsys.readouterr().err == f"leantrain: error: {message}\n"
