"""--strategy fsdp on 2 real processes: the same parameters as one process, exact sharded resume."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from leantrain.checkpoint import export_checkpoint
from leantrain.extensions.weight_average import averaged_weights
from tests.distributed.conftest import launch_here, run_with_one_kill, trained_weights
from tests.simulate.planned import accounted, planned, summarized

FIT = "fit --global-batch-size 16 --micro-batch-size 4 --max-steps 20 --progress plain --logger none"
FIT = FIT.split()


def train(out, task: str, *flags: str, processes: int = 1) -> dict[str, torch.Tensor]:
    return trained_weights(out, [*FIT, "--task", f"tests.distributed.tasks:{task}", *flags], processes)


# A LossSum in float64 (the exact normalisation) and a mean loss in float32.
@pytest.mark.parametrize(("task", "tolerance"), [("sum_task", 1e-10), ("mean_task_fp32", 1e-5)])
def test_fsdp_on_two_processes_trains_as_one_process(tmp_path, task, tolerance):
    one = train(tmp_path / "one", task, "--micro-batch-size", "16", "--ema-decay", "0.8")
    # 2 x (micro 4 x 2 accumulation): the reduce-scatter skipped on the first micro-batch
    sharded_flags = ["--strategy", "fsdp", "--shard-blocks", "Linear", "--ema-decay", "0.8"]
    two = train(tmp_path / "two", task, *sharded_flags, processes=2)
    average_one, average_two = (load_file(tmp_path / run / "ema.safetensors") for run in ("one", "two"))
    for name, tensor in one.items():
        assert two[name].dtype == tensor.dtype
        assert float((two[name] - tensor).abs().max()) <= tolerance, name
        assert float((average_two[name] - average_one[name]).abs().max()) <= tolerance, name
    single, sharded = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("one", "two"))
    assert sharded["strategy"] == "fsdp"
    # Each process holds half of every parameter (every dim 0 here is even), gradient and state.
    for kind in ("params_bytes", "grads_bytes", "optimizer_bytes", "ema_bytes"):
        assert sharded[kind] * 2 == single[kind], kind
    # plan --cluster simulates each rank on fake tensors: what the run measured, to the byte.
    fit_arguments = [*FIT, "--task", f"tests.distributed.tasks:{task}"]
    assert accounted(planned([*fit_arguments, *sharded_flags], 2)) == summarized(sharded)
    alone = ["--micro-batch-size", "16", "--ema-decay", "0.8"]
    assert accounted(planned([*fit_arguments, *alone], 1)) == summarized(single)


def test_a_transformers_gpt2_trains_under_fsdp_as_one_process_with_the_same_weight_names(tmp_path):
    """Its tied embedding and head: one name in every export, the embedding's (FSDP gathers each name
    into a tensor of its own, so the names are all that tell the tie)."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    flags = ["--max-steps", "4", "--checkpoint-every", "4"]
    one = train(tmp_path / "one", "tiny_gpt2", "--micro-batch-size", "16", *flags)
    two = train(tmp_path / "two", "tiny_gpt2", "--strategy", "fsdp", *flags, processes=2)
    assert sorted(two) == sorted(one) and "lm_head.weight" not in one
    for name, tensor in one.items():
        assert float((two[name] - tensor).abs().max()) <= 1e-4, name
    exported = load_file(export_checkpoint(tmp_path / "two" / "checkpoints" / "step-00000004.pt", tmp_path))
    assert sorted(exported) == sorted(one)


def test_a_killed_sharded_run_resumes_bit_identical(tmp_path):
    flags = "--task tests.distributed.tasks:slow_sum_task --max-steps 40 --checkpoint-every 4"
    flags = [*flags.split(), "--log-every-n-steps", "1", "--resume", "auto", "--strategy", "fsdp"]
    flags += ["--ema-decay", "0.8"]  # the average's shards are saved and read with the model's
    flags += ["--async-checkpoint", "true"]  # DCP's background save: the .pt file comes after the shards
    launch_here("--nproc-per-node", "2", *FIT, *flags, "--out", str(tmp_path / "uninterrupted"))
    stdout = run_with_one_kill([*FIT, *flags, "--out", str(tmp_path / "restarted")], kill_after="step 10/")
    assert "resumed after step" in stdout
    average, expected_average = (
        load_file(tmp_path / run / "ema.safetensors") for run in ("restarted", "uninterrupted")
    )
    assert average.keys() == expected_average.keys()
    assert all(torch.equal(average[name], expected_average[name]) for name in average)
    expected = load_file(tmp_path / "uninterrupted" / "model.safetensors")
    actual = load_file(tmp_path / "restarted" / "model.safetensors")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    # The last checkpoint's shards, gathered by `leantrain export`, are the final weights.
    checkpoints = tmp_path / "restarted" / "checkpoints"
    exported = load_file(export_checkpoint(checkpoints / "step-00000040.pt", tmp_path / "export.safetensors"))
    assert all(torch.equal(exported[name], expected[name]) for name in expected)
    # The average's shards, gathered the same way, are ema.safetensors.
    average_out = export_checkpoint(
        checkpoints / "step-00000040.pt", tmp_path / "ema.safetensors", averaged_weights
    )
    exported_average = load_file(average_out)
    assert all(torch.equal(exported_average[name], expected_average[name]) for name in expected_average)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f"step-000000{step}.{kind}" for step in (32, 36, 40) for kind in ("dcp", "pt")
    ]


def test_fsdp_bf16_mixed_computes_in_bf16_and_follows_the_fp32_run(tmp_path, monkeypatch):
    """bf16-mixed through FSDP's policy: bf16 compute, fp32 shards and reductions. Not equal to
    fp32 (bf16 keeps ~3 digits), but it must follow it closely and leave the fp32 masters fp32."""
    monkeypatch.setenv("LEANTRAIN_PROBE", str(tmp_path))
    fp32 = train(tmp_path / "fp32", "mean_task_fp32", "--micro-batch-size", "16")
    bf16 = train(tmp_path / "bf16", "ReduceDtypeProbe", "--strategy", "fsdp", "--precision", "bf16-mixed",
                 processes=2)  # fmt: skip
    assert all(bf16[name].dtype == torch.float32 for name in bf16)
    differences = [float((bf16[name] - fp32[name]).abs().max()) for name in fp32]
    assert 0 < max(differences) < 0.02, differences
    for rank in (0, 1):  # reduced in fp32: the ranks' bf16 gradients averaged with more than bf16's bits
        in_bf16, elements = map(int, (tmp_path / f"rank{rank}.txt").read_text().split())
        assert in_bf16 < 0.9 * elements, (rank, in_bf16, elements)
