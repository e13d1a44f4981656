"""Adapters (peft LoRA on a transformers Llama): only the adapter trains and is kept; the base comes
from task.model() again, and a checkpoint refuses another base."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import leantrain as lt
from leantrain.checkpoint import load_checkpoint
from leantrain.errors import CheckpointError
from tests.conftest import quiet_config

pytest.importorskip("peft")
from tests.distributed.tasks import TinyLlamaLoRA

SETTINGS = {"global_batch_size": 4, "max_steps": 4, "checkpoint_every": 2, "log_every_n_steps": 1}


def fit(out, task=None, **changes) -> lt.FitResult:
    config = quiet_config(out, **{**SETTINGS, **changes})
    return lt.Trainer(config).fit(task or TinyLlamaLoRA())


def adapter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """4 steps without a stop; its checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("whole")
    fit(out)
    return out


def test_checkpoints_and_weights_hold_the_adapter_and_its_optimizer_state_only(whole_run):
    names = adapter_names(TinyLlamaLoRA().model())
    state = load_checkpoint(whole_run / "checkpoints" / "step-00000004.pt")
    assert set(state["model"]) == names  # no base weight, no buffer of the base
    assert len(state["optimizer"]["state"]) == len(names)  # AdamW's moments: the adapter's only
    assert set(load_file(whole_run / "model.safetensors")) == names
    assert set(state["frozen"]["fingerprint"]) == set(state["frozen"]["names"])
    assert not names & set(state["frozen"]["names"])


def test_an_adapter_run_resumed_ends_bit_identical(whole_run, tmp_path):
    fit(tmp_path, max_steps=2)
    fit(tmp_path, resume="auto")
    resumed, whole = load_file(tmp_path / "model.safetensors"), load_file(whole_run / "model.safetensors")
    assert resumed.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
    assert any(value.abs().max() > 0 for name, value in whole.items() if "lora_B" in name)  # it trained


def test_a_resume_onto_another_base_is_refused(whole_run, tmp_path):
    checkpoint = whole_run / "checkpoints" / "step-00000002.pt"
    with pytest.raises(
        CheckpointError, match=r"trained on another base model: \d+ of \d+ frozen tensors differ"
    ):
        fit(tmp_path, TinyLlamaLoRA(base_seed=1), resume=str(checkpoint))


def test_an_adapter_checkpoint_into_a_model_without_adapter_is_refused_and_back(whole_run, tmp_path):
    class WithoutAdapter(TinyLlamaLoRA):
        def model(self):
            return super().model().merge_and_unload().requires_grad_(True)

    checkpoint = str(whole_run / "checkpoints" / "step-00000002.pt")
    with pytest.raises(
        CheckpointError, match=r"holds an adapter only, and task.model\(\) returns a model without"
    ):
        fit(tmp_path / "a", WithoutAdapter(), resume=checkpoint)
    fit(tmp_path / "b", WithoutAdapter(), max_steps=2)
    whole = str(tmp_path / "b" / "checkpoints" / "step-00000002.pt")
    with pytest.raises(CheckpointError, match="holds a whole model, not an adapter"):
        fit(tmp_path / "c", resume=whole)


def test_the_run_folder_adapter_is_read_by_peft_with_the_trained_models_logits(whole_run):
    from peft import PeftModel

    task = TinyLlamaLoRA()
    trained = task.model()
    trained.load_state_dict(load_file(whole_run / "model.safetensors"), strict=False)
    loaded = PeftModel.from_pretrained(task.base(), str(whole_run / "adapter"))
    tokens = torch.arange(32).view(2, 16)
    with torch.no_grad():
        expected = trained.eval()(input_ids=tokens).logits
        got = loaded.eval()(input_ids=tokens).logits
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)
    untrained = task.model().eval()(input_ids=tokens).logits.detach()
    assert not torch.allclose(untrained, expected, rtol=0, atol=1e-3)  # the adapter changed the output


def test_lora_b_gets_gradients_under_activation_checkpointing(tmp_path):
    """transformers #26221: recomputed blocks whose inputs need no gradient (a frozen embedding)
    gave LoRA no gradients with the reentrant checkpoint; lora_B starts at zero and would stay so."""
    result = fit(
        tmp_path, activation_checkpointing="LlamaDecoderLayer", max_steps=2, checkpoint_every="never"
    )
    weights = load_file(result.out_dir / "model.safetensors")
    moved = [name for name, value in weights.items() if "lora_B" in name and value.abs().max() > 0]
    assert len(moved) == 4, sorted(weights)  # q_proj and v_proj of both layers


def test_true_16_bit_keeps_fp32_masters_of_the_adapter_only(tmp_path):
    from leantrain.step.precision import make_precision

    model = TinyLlamaLoRA().model()
    adapter = adapter_names(model)
    masters = make_precision("bf16-true", torch.device("cpu")).prepare(model)
    assert sum(m.numel() for m in masters) == sum(
        p.numel() for n, p in model.named_parameters() if n in adapter
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # the base: half of fp32's memory
    result = fit(tmp_path, precision="bf16-true", max_steps=2, checkpoint_every="never")
    weights = load_file(result.out_dir / "model.safetensors")
    assert set(weights) == adapter
    assert {value.dtype for value in weights.values()} == {torch.float32}  # the masters, exported


def test_export_writes_the_adapter_for_peft_and_merged_for_transformers(whole_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from leantrain import cli

    task = TinyLlamaLoRA()
    trained = task.model()
    trained.load_state_dict(load_file(whole_run / "model.safetensors"), strict=False)
    checkpoint = str(whole_run / "checkpoints" / "step-00000004.pt")
    export = [
        "export",
        checkpoint,
        "--format",
        "transformers",
        "--task",
        "tests.distributed.tasks:tiny_llama_lora",
    ]
    assert cli.main([*export[:2], str(tmp_path / "adapter"), *export[2:]]) == 0
    assert cli.main([*export[:2], str(tmp_path / "merged"), *export[2:], "--merge"]) == 0
    tokens = torch.arange(32).view(2, 16)
    with torch.no_grad():
        expected = trained.eval()(input_ids=tokens).logits
        adapter = PeftModel.from_pretrained(task.base(), str(tmp_path / "adapter"))
        assert torch.allclose(adapter.eval()(input_ids=tokens).logits, expected, rtol=0, atol=1e-6)
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
        assert not any("lora" in name for name in merged.state_dict())
        assert torch.allclose(merged.eval()(input_ids=tokens).logits, expected, rtol=0, atol=1e-5)


def test_export_refuses_another_base_and_merge_without_the_transformers_format(whole_run, tmp_path, capsys):
    from leantrain import cli

    checkpoint = str(whole_run / "checkpoints" / "step-00000004.pt")
    assert cli.main(["export", checkpoint, str(tmp_path / "a"), "--merge"]) == 2
    assert "merge" in capsys.readouterr().err
    other = "tests.test_adapters:another_base"
    assert (
        cli.main(["export", checkpoint, str(tmp_path / "b"), "--format", "transformers", "--task", other])
        != 0
    )
    assert "trained on another base model" in capsys.readouterr().err


def another_base() -> TinyLlamaLoRA:
    return TinyLlamaLoRA(base_seed=1)
