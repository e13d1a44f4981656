"""--tp on real processes (gloo, float64): a tensor-parallel run computes what one process computes,
alone (2 processes), with ddp replicas and under fsdp (2D, 4 processes), with leantrain's example
and with a transformers Llama whose plan is transformers' own; its checkpoints resume on the same
layout after a kill, on one process and on fsdp alone. Accumulation and clipping are on everywhere."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import launch_here, run_with_one_kill, trained_weights
from tests.simulate.planned import accounted, planned, summarized

# 8 samples a step, micro-batches of 2: 4 (tp alone) or 2 (2D) accumulated micro-batches a step.
FIT = "fit --global-batch-size 8 --micro-batch-size 2 --max-grad-norm 0.5 --progress plain --logger none"
FIT = [*FIT.split(), "--log-every-n-steps", "1"]
TOLERANCE = 1e-10


def fit(out, task: str, *flags: str, processes: int = 1) -> dict[str, torch.Tensor]:
    return trained_weights(out, [*FIT, "--task", f"tests.distributed.tasks:{task}", *flags], processes)


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)  # whole tensors under one process's names
    for name, tensor in expected.items():
        assert actual[name].shape == tensor.shape, name
        assert float((actual[name] - tensor).abs().max()) <= TOLERANCE, name


def test_tp_alone_trains_as_one_process_and_its_checkpoint_resumes_on_one_process_and_on_fsdp(tmp_path):
    """Bugs: the norm over shards counted per rank (clipping off), losses counted once per rank of a
    group, the optimizer left with the parameters from before the plan, a checkpoint that only the
    same layout reads."""
    steps = ["--max-steps", "6", "--checkpoint-every", "3"]
    one = fit(tmp_path / "one", "tiny_charlm", *steps)
    two = fit(tmp_path / "tp", "tiny_charlm", *steps, "--tp", "2", processes=2)
    assert_close(two, one)
    summary = json.loads((tmp_path / "tp" / "summary.json").read_text())
    assert summary["tensor_parallel"] == 2 and summary["strategy"] == "ddp"
    # plan --cluster, simulated in this process on fake tensors, holds what each rank of the run held
    # (the shards of the plan, their optimizer state, sequence parallelism's activations).
    plan = planned([*FIT, "--task", "tests.distributed.tasks:tiny_charlm", *steps, "--tp", "2"], 2)
    assert accounted(plan) == summarized(summary)
    expected_loss = json.loads((tmp_path / "one" / "summary.json").read_text())["final_train_loss"]
    assert summary["final_train_loss"] == pytest.approx(expected_loss, rel=1e-9)
    # Each rank holds half of every planned matrix: the run's parameter bytes are below one process's.
    single = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["params_bytes"] < single["params_bytes"]
    halfway = str(tmp_path / "tp" / "checkpoints" / "step-00000003.pt")
    resumed_alone = fit(tmp_path / "alone", "tiny_charlm", *steps, "--resume", halfway)
    assert_close(resumed_alone, one)
    resumed = ["--resume", halfway, "--strategy", "fsdp"]
    on_fsdp = fit(tmp_path / "fsdp", "tiny_charlm", *steps, *resumed, processes=2)
    assert_close(on_fsdp, one)


def test_a_killed_run_of_ddp_replicas_of_tp_groups_resumes_and_ends_as_one_process(tmp_path):
    """4 processes, 2 replicas of 2-rank tensor-parallel groups: each rank's shard gradients averaged
    over its replicas (the bug: not averaged, or averaged over the world); sequence parallelism off."""
    flags = [*FIT, "--task", "tests.distributed.tasks:tiny_charlm", "--max-steps", "8"]
    flags += ["--checkpoint-every", "2"]
    one = fit(tmp_path / "one", "tiny_charlm", "--max-steps", "8")
    layout = ["--strategy", "ddp", "--tp", "2", "--resume", "auto", "--out", str(tmp_path / "2d")]
    layout += ["--sequence-parallel", "false"]  # the other tests split charlm's positions
    stdout = run_with_one_kill([*flags, *layout], kill_after="step 5/", processes=4)
    assert "resumed after step" in stdout
    assert "tensor parallel over 2 ranks x 2 data-parallel: 16 modules split (task.tp_plan(model))" in stdout
    assert_close(load_file(tmp_path / "2d" / "model.safetensors"), one)


@pytest.mark.parametrize(
    ("task", "plan", "recomputed"),
    [
        # its rowwise biases: whole on the tensor-parallel ranks, sharded by FSDP (the norm counts them so);
        # its blocks recomputed in backward (checkpointing wraps forward: the plan still finds the modules)
        ("tiny_charlm", "(task.tp_plan(model))", "Block"),
        ("tiny_llama_float64", "(LlamaForCausalLM's own plan (transformers))", None),
    ],
)
def test_fsdp_over_tp_groups_trains_as_one_process(tmp_path, task, plan, recomputed):
    if task == "tiny_llama_float64":
        pytest.importorskip("transformers")
    one = fit(tmp_path / "one", task, "--max-steps", "4")
    flags = ["--task", f"tests.distributed.tasks:{task}", "--max-steps", "4"]
    flags += ["--activation-checkpointing", recomputed] if recomputed else []
    layout = ["--strategy", "fsdp", "--tp", "2", "--out", str(tmp_path / "2d")]
    stdout = launch_here("--nproc-per-node", "4", *FIT, *flags, *layout).stdout
    assert "tensor parallel over 2 ranks x 2 data-parallel: " in stdout and plan in stdout
    if task == "tiny_llama_float64":  # lm_head's logits never gathered: the loss sees them split
        assert "loss parallel: on: the cross-entropy on lm_head's logits split by vocabulary" in stdout
    assert "suboptimal" not in stdout  # torch's note on gathering 2D shards, once per rank, is not the user's
    assert_close(load_file(tmp_path / "2d" / "model.safetensors"), one)
    # Simulated on fake tensors: each rank's 1/2 of a 1/2 shard, its recomputed blocks' activations.
    summary = json.loads((tmp_path / "2d" / "summary.json").read_text())
    assert accounted(planned([*FIT, *flags, "--strategy", "fsdp", "--tp", "2"], 4)) == summarized(summary)


def test_a_whole_parameter_on_split_activations_is_summed_when_planned_so_and_refused_when_not(tmp_path):
    """Bugs (peers shipped both): the parts of such a gradient left unsummed, each rank of a group
    then drifting apart silently; or the check that names it missing."""
    one = fit(tmp_path / "one", "head_scaled_summed", "--max-steps", "4")
    two = fit(tmp_path / "two", "head_scaled_summed", "--max-steps", "4", "--tp", "2", processes=2)
    assert_close(two, one)
    arguments = [*FIT, "--task", "tests.distributed.tasks:head_scaled_whole", "--max-steps", "4", "--tp", "2"]
    with pytest.raises(AssertionError) as failed:
        launch_here("--nproc-per-node", "2", *arguments, "--out", str(tmp_path / "whole"))
    assert (
        "invalid tp=2: 1.weight is whole on every rank but gets a different gradient on each: it works on "
        "split activations; plan its module replicated_with_grad_allreduce"
    ) in str(failed.value)
    assert not (tmp_path / "whole" / "model.safetensors").exists()


def test_a_loss_that_split_logits_cannot_take_runs_on_gathered_logits_and_says_why(tmp_path):
    """The loss's cross-entropy written by hand: loss parallelism is tried on the first micro-batch,
    refused, and the logits gathered as the plan says (the bug: the run fails at the first step, or
    trains on split logits a loss it does not compute right)."""
    pytest.importorskip("transformers")
    one = fit(tmp_path / "one", "tiny_llama_gather_loss", "--max-steps", "3")
    flags = ["--task", "tests.distributed.tasks:tiny_llama_gather_loss", "--max-steps", "3", "--tp", "2"]
    stdout = launch_here("--nproc-per-node", "2", *FIT, *flags, "--out", str(tmp_path / "tp")).stdout
    assert "loss parallel: off (the task's loss fails on split logits: " in stdout
    assert "lm_head's logits gathered" in stdout
    assert_close(load_file(tmp_path / "tp" / "model.safetensors"), one)
