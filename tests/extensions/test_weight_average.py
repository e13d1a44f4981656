"""The moving average of the weights (--ema-decay, --ema-validate), against a hand-written loop."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import leantrain as lt
from leantrain.checkpoint import load_checkpoint
from leantrain.cli import main
from leantrain.errors import ConfigError
from leantrain.extensions.weight_average import WeightAverage
from leantrain.memory.estimate import estimate_memory
from leantrain.run.hooks import StepStats
from leantrain.runtime import seed_everything
from leantrain.step.accumulator import StepStatus
from leantrain.step.precision import Fp32
from tests.conftest import RegressionTask, quiet_config
from tests.test_resume import StopAt

DECAY = 0.8  # far from 1: after 20 steps the average is still well away from the weights
STEPS = dict(global_batch_size=16, micro_batch_size=8, max_steps=20, shuffle=False)


class WithValidation(RegressionTask):
    """The float64 regression with its first 48 samples as validation data."""

    def val_data(self) -> torch.utils.data.Dataset:
        return torch.utils.data.TensorDataset(self.x[:48], self.y[:48], self.mask[:48])


def train(out, task: Any = None, callbacks: tuple[Any, ...] = (), **fields: Any) -> lt.FitResult:
    config = quiet_config(out, **{**STEPS, "ema_decay": DECAY, **fields})
    return lt.Trainer(config, callbacks=list(callbacks)).fit(task or RegressionTask())


def hand_written_average(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A plain PyTorch loop over the same batches, in order, keeping e = D*e + (1-D)*w by the
    issue's formula; its (weights, average)."""
    task = RegressionTask()
    seed_everything(0)  # leantrain's default seed, before the model is built
    model = task.model()
    optimizer = task.optimizer(model.parameters())
    average = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = task.train_data()
    for step in range(steps):
        rows = [(step * 16 + i) % len(data) for i in range(16)]
        x, y, mask = (tensor[rows] for tensor in data.tensors)
        optimizer.zero_grad()
        task.loss(model, (x, y, mask)).backward()
        optimizer.step()
        with torch.no_grad():
            for name, p in model.named_parameters():
                average[name] = DECAY * average[name] + (1 - DECAY) * p
    return dict(model.state_dict()), average


def test_the_average_equals_a_hand_written_loops_in_float64(tmp_path):
    train(tmp_path / "run")
    weights, average = hand_written_average(20)
    trained, averaged = (
        load_file(tmp_path / "run" / "model.safetensors"),
        load_file(tmp_path / "run" / "ema.safetensors"),
    )
    assert sorted(averaged) == sorted(average)
    for name in average:
        assert float((trained[name] - weights[name]).abs().max()) < 1e-10, name  # the same training
        assert float((averaged[name] - average[name]).abs().max()) < 1e-10, name
        assert float((averaged[name] - trained[name]).abs().max()) > 1e-3, name  # an average, not a copy
        assert averaged[name].dtype == torch.float64


def test_a_crashed_run_resumes_with_its_average_bit_identical(tmp_path):
    reference = train(tmp_path / "reference")
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", callbacks=(StopAt(13),), checkpoint_every=4)
    train(tmp_path / "run", resume="auto", checkpoint_every=4)  # from step 12
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000012.pt")
    assert saved["callbacks"]["ema"]["decay"] == DECAY
    expected = load_file(reference.out_dir / "ema.safetensors")
    resumed = load_file(tmp_path / "run" / "ema.safetensors")
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


def test_export_writes_a_checkpoints_average_as_ema_safetensors_holds_it(tmp_path, capsys):
    train(tmp_path / "run", checkpoint_every=10)
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-00000020.pt")
    assert main(["export", checkpoint, str(tmp_path / "a.safetensors"), "--weights", "ema"]) == 0
    exported, expected = (
        load_file(tmp_path / "a.safetensors"),
        load_file(tmp_path / "run" / "ema.safetensors"),
    )
    assert sorted(exported) == sorted(expected)
    assert all(torch.equal(exported[name], expected[name]) for name in expected)
    train(tmp_path / "plain", ema_decay=None, max_steps=2)
    plain = tmp_path / "plain" / "checkpoints" / "step-00000002.pt"
    assert main(["export", str(plain), str(tmp_path / "b.safetensors"), "--weights", "ema"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"leantrain: error: checkpoint {plain} holds no weight average: its run had no --ema-decay"
    )


def test_validating_the_average_scores_it_and_leaves_training_untouched(tmp_path):
    plain = train(tmp_path / "plain", WithValidation())
    scored = train(tmp_path / "scored", WithValidation(), ema_validate=True)
    trained = load_file(tmp_path / "plain" / "model.safetensors")
    assert all(torch.equal(scored.model.state_dict()[k].cpu(), v) for k, v in trained.items())  # swapped back
    task = WithValidation()
    model = task.model()
    model.load_state_dict(load_file(tmp_path / "scored" / "ema.safetensors"))
    with torch.no_grad():
        expected = float(task.loss(model, tuple(t[:48] for t in (task.x, task.y, task.mask))))
    assert abs(scored.val_metrics["val_loss"] - expected) < 1e-12
    assert abs(plain.val_metrics["val_loss"] - expected) > 1e-4  # the trained weights score otherwise


def test_the_average_of_16_bit_weights_is_kept_in_fp32_and_swapped_back_exactly(tmp_path):
    """bf16-true: the average follows the fp32 masters; validating it must put the 16-bit model
    back as it was (rounded from the masters), or the next steps would differ."""
    fields = dict(precision="bf16-true", max_steps=8)
    task = lambda: WithValidation(dtype=torch.float32)  # noqa: E731
    plain = train(tmp_path / "plain", task(), val_every_n_steps=2, **fields)
    scored = train(tmp_path / "scored", task(), val_every_n_steps=2, ema_validate=True, **fields)
    for name, value in plain.model.state_dict().items():
        assert torch.equal(scored.model.state_dict()[name], value), name
    assert plain.val_metrics != scored.val_metrics
    averaged = load_file(tmp_path / "scored" / "ema.safetensors")
    assert {tensor.dtype for tensor in averaged.values()} == {torch.float32}
    summary = json.loads((tmp_path / "scored" / "summary.json").read_text())
    assert summary["ema_bytes"] == sum(p.numel() * 4 for p in scored.model.parameters())


def test_a_16_bit_parameter_trained_directly_has_an_fp32_average_and_is_put_back_bit_for_bit():
    """A bf16 model under 32-bit precision: swapping the average in rounds it to bf16 for the model,
    and afterwards both the weights and the fp32 average are what they were."""
    model = nn.Linear(3, 2).to(torch.bfloat16)
    average = WeightAverage(0.5, ["weight", "bias"], list(model.parameters()), Fp32(), print, print)
    assert [a.dtype for a in average.average] == [torch.float32, torch.float32]
    with torch.no_grad():
        model.weight.add_(0.01)  # one step: the average now lies between two bf16 values
    average.on_step(StepStats(1, StepStatus.STEPPED, None))
    trained = [p.detach().clone() for p in model.parameters()]
    averaged = [a.clone() for a in average.average]
    assert not torch.equal(averaged[0], averaged[0].to(torch.bfloat16).float())  # not a bf16 value
    with average.swapped_in():
        assert torch.equal(model.weight, averaged[0].to(torch.bfloat16))
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(average.average, averaged, strict=True))


def test_a_bf16_model_under_32_bit_precision_keeps_an_average(tmp_path):
    """Bug: a pretrained model loaded in bf16, trained as it is, with --ema-decay: the first step's
    fused lerp refused the fp32 average and the bf16 weights (a raw RuntimeError)."""
    result = train(tmp_path, RegressionTask(dtype=torch.bfloat16))
    averaged = load_file(tmp_path / "ema.safetensors")
    assert {t.dtype for t in averaged.values()} == {torch.bfloat16}  # as the model holds it
    assert not torch.equal(averaged["0.weight"], result.model.state_dict()["0.weight"].cpu())


def test_a_skipped_step_leaves_the_average_where_it_was():
    model = nn.Linear(3, 2).double()
    average = WeightAverage(0.5, ["weight", "bias"], list(model.parameters()), Fp32(), print, print)
    start = [t.clone() for t in average.average]
    with torch.no_grad():
        model.weight.add_(1.0)
    average.on_step(StepStats(1, StepStatus.OVERFLOW, None))
    assert all(torch.equal(a, b) for a, b in zip(average.average, start, strict=True))
    average.on_step(StepStats(2, StepStatus.STEPPED, None))
    assert torch.equal(average.average[0], start[0] + 0.5)


def test_a_saved_average_of_other_parameters_is_refused_by_name_and_a_changed_decay_is_told():
    model = nn.Linear(2, 1)
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"^1 parameter names for 2 parameters$"):
        WeightAverage(0.5, ["weight"], params, Fp32(), print, print)
    told: list[str] = []
    average = WeightAverage(0.5, ["weight", "bias"], params, Fp32(), print, told.append)
    weight, bias = torch.full((1, 2), 3.0), torch.full((1,), 4.0)
    with pytest.raises(
        ValueError, match=r"^the saved average does not match the model's parameters \(first: bias\)$"
    ):
        average.load_state_dict({"decay": 0.5, "weights": {"weight": weight}})
    with pytest.raises(ValueError, match=r"\(first: extra\)$"):
        average.load_state_dict({"decay": 0.5, "weights": {"weight": weight, "bias": bias, "extra": bias}})

    average.load_state_dict({"decay": 0.5, "weights": {"weight": weight, "bias": bias}})
    assert told == []
    saved = average.state_dict()
    assert saved["decay"] == 0.5 and list(saved["weights"]) == ["weight", "bias"]
    assert torch.equal(saved["weights"]["weight"], weight) and saved["weights"]["weight"] is not weight
    trained = model.weight.detach().clone()
    with average.evaluated_weights():  # validates the trained weights unless told otherwise
        assert torch.equal(model.weight, trained) and not torch.equal(model.weight, weight)
    average.load_state_dict({"decay": 0.9, "weights": {"weight": weight, "bias": bias}})
    assert told == ["the checkpoint's average was kept with ema_decay 0.9; it goes on with 0.5 from here"]


def test_resuming_a_run_that_kept_no_average_says_it_starts_afresh(tmp_path):
    train(tmp_path / "run", ema_decay=None, max_steps=4)
    with pytest.warns(
        lt.LeantrainWarning, match="holds no state of callback ema: it starts afresh at step 4"
    ):
        train(tmp_path / "run", resume="auto", max_steps=6)


def test_the_plan_and_the_summary_count_the_average(tmp_path):
    result = train(tmp_path / "run", max_steps=2)
    fp64_params = sum(p.numel() * 8 for p in result.model.parameters())
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["ema_bytes"] == fp64_params
    config = lt.TrainConfig(global_batch_size=16, ema_decay=DECAY)
    plan = estimate_memory(RegressionTask(), config)
    planned = plan.rows[0].memory
    assert planned.ema_bytes == plan.as_dict()["ema_bytes"] == fp64_params
    assert (
        planned.total_bytes
        == planned.params_bytes * 2 + planned.grads_bytes + planned.optimizer_bytes + planned.activation_bytes
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(ema_decay=1.0), "ema_decay=1.0: must be between 0 and 1 (exclusive)"),
        (dict(ema_decay=0), "ema_decay=0: must be between 0 and 1 (exclusive)"),
        (dict(ema_decay=float("nan")), "ema_decay=nan: must be between 0 and 1"),
        (dict(ema_validate=True), "ema_validate=True: needs ema_decay"),
    ],
)
def test_bad_settings_are_one_line_errors(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lt.TrainConfig(**fields)


def test_validating_the_average_needs_validation_data(tmp_path):
    with pytest.raises(ConfigError, match="ema_validate=True: needs validation data"):
        train(tmp_path / "run", ema_validate=True)
