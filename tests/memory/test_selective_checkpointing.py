"""``--activation-checkpointing selective``: op-level checkpointing of the repeated blocks that keeps
the outputs of their matrix products and recomputes the rest. Exact against no checkpointing
(float64, dropout on), and counted: the accountant, ``plan`` and the doctor report the bytes the
kept products hold, which autograd's saved-tensor hooks never see (checkpoint's own cache holds them).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.utils.checkpoint import CheckpointPolicy

import leantrain as lt
from leantrain import cli
from leantrain.blocks import BlockPolicy, matching_blocks
from leantrain.diagnose import run_doctor
from leantrain.examples.charlm import CharLMTask
from leantrain.memory.estimate import estimate_memory
from leantrain.memory.recompute import _KeepMatmuls, apply_activation_checkpointing
from tests.conftest import quiet_config, without_validation

SETTINGS = dict(global_batch_size=8, micro_batch_size=4, max_steps=3)  # 2 micro-batches per step


class Float64CharLM(CharLMTask):
    """charlm in float64, dropout on: a recomputation that differs by one rounding (or one dropout
    mask) shows in the weights."""

    def __init__(self) -> None:
        super().__init__(block=32, layers=3, width=64, heads=4, max_chars=60_000, dropout=0.1)
        without_validation(self)

    def model(self) -> nn.Module:
        return super().model().double()


def kept_product_bytes(model: nn.Module, blocks: str, micro: int, length: int, heads: int) -> int:
    """What selective checkpointing keeps, from the shapes alone: per block, the output of each of its
    Linear layers (tokens x out_features) and, with dropout on (torch's CPU attention then takes its
    math path), attention's two batched products (scores: length x length, then their product with
    the values: length x head width) per sample and head."""
    total = 0
    for _, block in matching_blocks(model, BlockPolicy.parse(blocks)):
        linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
        head_width = linears[0].in_features // heads
        total += micro * length * sum(m.out_features for m in linears)
        total += micro * heads * length * (length + head_width)
    return total * torch.finfo(torch.float64).bits // 8


def test_the_policy_accepts_selective_alone_or_on_picked_blocks_and_refuses_it_elsewhere():
    assert BlockPolicy.parse("selective") == BlockPolicy(selective=True)
    assert BlockPolicy.parse("Block,selective,every:2") == BlockPolicy(("Block",), 2, selective=True)
    assert not BlockPolicy.parse("Block").selective
    for text in ("auto,selective", "selective:2"):
        with pytest.raises(lt.ConfigError, match=r"^invalid activation_checkpointing="):
            lt.TrainConfig(activation_checkpointing=text)
    with pytest.raises(lt.ConfigError, match=r"^invalid shard_blocks='selective'"):
        BlockPolicy.parse("selective", field="shard_blocks")  # FSDP shards blocks; it recomputes nothing


def test_the_policy_keeps_products_and_collectives_and_recomputes_the_rest():
    keep, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    ctx = type("Context", (), {"op_output": None})()
    aten = torch.ops.aten
    _keep_matmuls = _KeepMatmuls()
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default):
        assert _keep_matmuls(ctx, op) == keep, op
    # fp8's product and the attention kernels SDPA dispatches to, each one this torch has
    kernels = ["_scaled_mm", "_scaled_dot_product_attention_math"] + [
        f"_scaled_dot_product_{kind}" for kind in ("flash_attention", "flash_attention_for_cpu",
        "efficient_attention", "cudnn_attention", "fused_attention_overrideable")
    ]  # fmt: skip
    assert hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu")  # the one this machine runs
    for name in kernels:
        if hasattr(aten, name):
            assert _keep_matmuls(ctx, getattr(aten, name).default) == keep, name
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.native_dropout.default):
        assert _keep_matmuls(ctx, op) == recompute, op
    assert _keep_matmuls(ctx, torch.ops._c10d_functional.all_reduce.default) == keep
    assert _keep_matmuls(ctx, torch.ops._c10d_functional.wait_tensor.default) == keep


def test_a_collective_in_a_selectively_checkpointed_block_runs_once():
    """Recomputing it would communicate twice, and hang if the ranks recomputed different ones."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    class Reduced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # relu saves its output: the recomputation has to get past the collective.
            return funcol.all_reduce(self.linear(x), "sum", torch.distributed.group.WORLD).relu()

    calls = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    reduces = {}
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        for policy in (None, "Reduced", "Reduced,selective"):
            model = nn.Sequential(Reduced(), Reduced())
            if policy:
                apply_activation_checkpointing(model, BlockPolicy.parse(policy))
            calls.clear()
            with Count():
                model(torch.randn(2, 4)).sum().backward()
            reduces[policy] = calls.count(torch.ops._c10d_functional.all_reduce.default)
    finally:
        torch.distributed.destroy_process_group()
    # Forward's, and backward's of the gradients; whole-block checkpointing also recomputes the two.
    assert reduces == {None: 4, "Reduced": 6, "Reduced,selective": 4}


def test_selective_trains_the_same_weights_and_every_count_reports_the_kept_products(fit, tmp_path):
    """One fit per setting, in float64 with dropout: the weights equal, and the activation bytes of
    the run (summary), of ``plan`` and of the doctor equal those of block checkpointing plus the kept
    products computed from the shapes, strictly between block checkpointing and none."""
    runs = {policy: fit(Float64CharLM(), activation_checkpointing=policy, **SETTINGS) for policy in
            (None, "selective", "Block")}  # fmt: skip
    plain = runs[None].model.state_dict()
    for policy in ("selective", "Block"):
        for name, value in runs[policy].model.state_dict().items():
            assert torch.equal(value, plain[name]), (policy, name)
    saved = {policy: run.activation_bytes for policy, run in runs.items()}
    kept = kept_product_bytes(Float64CharLM().model(), "Block", micro=4, length=32, heads=4)
    assert saved["selective"] == saved["Block"] + kept
    assert saved["Block"] < saved["selective"] < saved[None]
    cfg = lt.TrainConfig(**SETTINGS, activation_checkpointing="selective")
    [row] = [r for r in estimate_memory(Float64CharLM(), cfg).rows if r.micro_batch_size == 4]
    assert (row.activation_checkpointing, row.memory.activation_bytes) == ("selective", saved["selective"])
    doctor_cfg = quiet_config(
        tmp_path / "doctor", **SETTINGS, activation_checkpointing="selective", device="cpu"
    )
    doctor = run_doctor(Float64CharLM(), doctor_cfg, steps=1, warmup=1, try_compile=False)
    assert doctor.memory is not None and doctor.memory.activation_bytes == saved["selective"]


def test_selective_on_a_transformers_llama_trains_the_same_weights_and_counts_its_products(fit):
    pytest.importorskip("transformers")
    from leantrain.examples.hf_lm import HFCausalLMTask

    class Float64Llama(HFCausalLMTask):
        def __init__(self) -> None:
            super().__init__("llama", block=16, layers=3, heads=2, width=32, max_chars=4000, dropout=0.1)
            without_validation(self)

        def model(self) -> nn.Module:
            return super().model().double()

    runs = {policy: fit(Float64Llama(), activation_checkpointing=policy, **SETTINGS) for policy in
            (None, "selective", "LlamaDecoderLayer")}  # fmt: skip
    plain = runs[None].model.state_dict()
    for name, value in runs["selective"].model.state_dict().items():
        assert torch.equal(value, plain[name]), name
    saved = {policy: run.activation_bytes for policy, run in runs.items()}
    # The grouped keys and values are repeated per head before attention's products: its shapes
    # are the heads'.
    kept = kept_product_bytes(Float64Llama().model(), "LlamaDecoderLayer", micro=4, length=16, heads=2)
    assert saved["selective"] == saved["LlamaDecoderLayer"] + kept
    assert saved["LlamaDecoderLayer"] < saved["selective"] < saved[None]
    cfg = lt.TrainConfig(**SETTINGS, activation_checkpointing="selective")
    [row] = [r for r in estimate_memory(Float64Llama(), cfg).rows if r.micro_batch_size == 4]
    assert row.memory.activation_bytes == saved["selective"]


def test_plan_takes_selective_on_the_command_line(capsys):
    argv = ["plan", "--example", "charlm", "--global-batch-size", "8", "--micro-batch-size", "4",
            "--activation-checkpointing", "selective", "--json", "true"]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["activation_checkpointing"] == "selective" and result["activation_bytes"] > 0


@pytest.mark.parametrize(("policy", "said"), [("Block,selective", True), ("Block", False)])
def test_the_run_log_says_the_blocks_are_recomputed_op_by_op(policy, said):
    from leantrain.run.model import ModelPart
    from leantrain.strategies.base import Strategy
    from leantrain.strategies.dims import ParallelDims

    strategy = Strategy(lt.TrainConfig(), torch.device("cpu"), ParallelDims())
    part = ModelPart(strategy, None, None, [], policy, ["blocks.0", "blocks.1"], {}, [])  # type: ignore[arg-type]
    line = part.setup_lines()[0]
    assert line.startswith("activation checkpointing: 2 blocks (blocks.0, blocks.1)")
    assert line.endswith(", op by op: their matrix products kept") is said
