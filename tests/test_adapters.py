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


def test_export_pretrained_writes_the_adapter_by_default_from_the_weights_chosen(
    whole_run, tmp_path, monkeypatch
):
    """The Python call behind ``export --format transformers``: the adapter unless ``merge``; the weights
    ``choose`` makes (the average, with --ema); the user's own files in the folder left as they were; and
    each refusal one line naming the checkpoint, the folder or the model."""
    import errno
    import stat

    from peft import PeftModel

    from leantrain.adapters import merged
    from leantrain.checkpoint import export_pretrained
    from leantrain.errors import ConfigError, StorageError, TaskError

    checkpoint = whole_run / "checkpoints" / "step-00000004.pt"
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "notes.txt").chmod(0o600)
    zeros = lambda weights, callbacks: {name: torch.zeros_like(value) for name, value in weights.items()}  # noqa: E731
    assert export_pretrained(TinyLlamaLoRA().model, checkpoint, out, choose=zeros) == out
    written = load_file(out / "adapter_model.safetensors")
    assert written and all(not value.any() for value in written.values())  # chosen, and an adapter only
    assert stat.S_IMODE((out / "notes.txt").stat().st_mode) == 0o600  # not the folder's new files' mode

    with pytest.raises(TaskError) as plain:
        export_pretrained(lambda: torch.nn.Linear(1, 1), checkpoint, tmp_path / "plain")
    assert str(plain.value) == (
        "--format transformers needs a transformers model (one with save_pretrained); task.model() "
        "returned a Linear: use the default safetensors format"
    )
    with pytest.raises(
        CheckpointError, match=f"^checkpoint {checkpoint}: its adapter was trained on another"
    ):
        export_pretrained(another_base().model, checkpoint, tmp_path / "other")
    first = next(iter(load_checkpoint(checkpoint)["model"]))
    fits_not = rf"^checkpoint {checkpoint}: the adapter's weights do not fit task\.model\(\): "
    with pytest.raises(CheckpointError, match=fits_not + rf"1 missing, 0 unexpected \(first: {first}\)$"):
        first_left_out = lambda weights, callbacks: dict(list(weights.items())[1:])  # noqa: E731
        export_pretrained(TinyLlamaLoRA().model, checkpoint, tmp_path / "short", choose=first_left_out)
    with pytest.raises(CheckpointError, match=fits_not + ".*size mismatch for " + first):
        cut = lambda weights, callbacks: {n: v[:1] if n == first else v for n, v in weights.items()}  # noqa: E731
        export_pretrained(TinyLlamaLoRA().model, checkpoint, tmp_path / "cut", choose=cut)
    with pytest.raises(CheckpointError, match=f"^checkpoint {checkpoint} holds an adapter only"):
        export_pretrained(TinyLlamaLoRA().base, checkpoint, tmp_path / "base")
    with pytest.raises(ConfigError, match=r"^invalid out=.*notes\.txt'?: is a file; give a folder$"):
        export_pretrained(TinyLlamaLoRA().model, checkpoint, out / "notes.txt")

    def disk_full(self, folder, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PeftModel, "save_pretrained", disk_full)
    with pytest.raises(
        StorageError, match=f"^could not write transformers folder {tmp_path / 'full'}: No space"
    ):
        export_pretrained(TinyLlamaLoRA().model, checkpoint, tmp_path / "full")
    with pytest.raises(
        TaskError,
        match=r"^--merge folds an adapter into its base; task\.model\(\) returned a Linear without one",
    ):
        merged(torch.nn.Linear(1, 1))


def another_base() -> TinyLlamaLoRA:
    return TinyLlamaLoRA(base_seed=1)


class BaseOnly(TinyLlamaLoRA):
    """The same model without an adapter: ``--lora-rank`` adds it."""

    def model(self):
        return self.base()


def base_only() -> BaseOnly:
    return BaseOnly()


def test_lora_flags_give_the_tasks_model_adapters(tmp_path):
    from leantrain.errors import ConfigError, TaskError

    flags = {"lora_rank": 4, "lora_targets": "q_proj,v_proj", "lora_alpha": 8.0, "max_steps": 2}
    result = fit(tmp_path / "run", BaseOnly(), **flags)
    weights = load_file(result.out_dir / "model.safetensors")
    assert len(weights) == 8 and all(".lora_" in name for name in weights)  # A and B, q and v, 2 layers
    assert weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"].shape == (4, 32)
    config = (result.out_dir / "adapter" / "adapter_config.json").read_text()
    assert '"r": 4' in config and '"lora_alpha": 8.0' in config
    with pytest.raises(ConfigError, match="already returns an adapter"):
        fit(tmp_path / "twice", TinyLlamaLoRA(), lora_rank=4)
    with pytest.raises(TaskError, match="--lora-targets nope"):
        fit(tmp_path / "nope", BaseOnly(), lora_rank=4, lora_targets="nope")


def test_lora_flags_configure_peft_as_documented(monkeypatch):
    """``--lora-alpha`` defaults to twice the rank; ``all-linear`` is peft's word for every linear layer
    but the head; a target peft cannot find is one line naming the flag, with peft's reason cut short."""
    from leantrain.adapters import lora_model
    from leantrain.errors import TaskError

    model = lora_model(BaseOnly().model(), rank=2, alpha=None, dropout=0.25, targets=["all-linear"])
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (2, 4, 0.25)
    adapted = {
        name.split(".lora_A.")[0].rsplit(".", 1)[-1]
        for name, _ in model.named_parameters()
        if ".lora_A." in name
    }
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    missing = [f"missing_projection_{n}" for n in range(40)]
    with pytest.raises(TaskError) as refused:
        lora_model(BaseOnly().model(), rank=2, alpha=None, dropout=0.0, targets=missing)
    prefix = f"--lora-targets {','.join(missing)}: "
    message = str(refused.value)
    reason = message[len(prefix) :]  # peft's: on one line, its first 300 characters
    assert message.startswith(prefix) and reason.startswith("Target modules") and reason.endswith("...")
    assert len(reason) == 303 and "\n" not in reason and "  " not in reason
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # not installed
    with pytest.raises(TaskError, match=r"^--lora-rank needs peft: pip install 'leantrain\[hf\]'$"):
        lora_model(BaseOnly().model(), rank=2, alpha=None, dropout=0.0, targets=["q_proj"])


def test_export_of_a_lora_flag_run_draws_the_base_as_the_run_did(tmp_path):
    """GPT-2 drawn at random from the run's seed (no fixed base): export seeds as the run did, so
    the fingerprint matches and the merged model computes what the trained one did."""
    from transformers import AutoModelForCausalLM

    from leantrain import cli
    from leantrain.runtime import seed_everything

    task = "tests.distributed.tasks:tiny_gpt2"
    run = tmp_path / "run"
    assert cli.main(["fit", "--task", task, "--lora-rank", "4", "--lora-targets", "c_attn",
                     "--max-steps", "2", "--global-batch-size", "4", "--seed", "7", "--out", str(run),
                     "--progress", "none", "--logger", "none"]) == 0  # fmt: skip
    out = tmp_path / "merged"
    checkpoint = str(run / "checkpoints" / "step-00000002.pt")
    assert (
        cli.main(["export", checkpoint, str(out), "--format", "transformers", "--merge", "--task", task]) == 0
    )

    from leantrain.adapters import with_lora
    from tests.distributed.tasks import tiny_gpt2

    seed_everything(7)
    trained = with_lora(tiny_gpt2().model(), {"lora_rank": 4, "lora_targets": "c_attn"})
    trained.load_state_dict(load_file(run / "model.safetensors"), strict=False)
    tokens = torch.arange(16).view(1, 16)
    with torch.no_grad():
        expected = trained.eval()(input_ids=tokens).logits
        got = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=tokens).logits
    assert torch.allclose(got, expected, rtol=0, atol=1e-5)
