"""The NaN/inf policy: ``stop`` saves the last good state and names the step; ``skip`` drops the step."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

import leantrain as lt
from leantrain.checkpoint import load_checkpoint
from leantrain.data.sampler import GlobalBatchSampler
from leantrain.step.accumulator import StepStatus
from leantrain.step.batching import BatchSplit
from tests.conftest import PoisonedSteps, RegressionTask, quiet_config


class Weights:
    """Records the statuses, and a copy of the weights after every step."""

    def __init__(self, model_of) -> None:
        self.model_of = model_of
        self.after: dict[int, list[torch.Tensor]] = {}
        self.statuses: list[StepStatus] = []
        self.logs: list[tuple[int, dict]] = []

    def on_step(self, stats: lt.StepStats) -> None:
        self.statuses.append(stats.status)
        self.after[stats.step] = [p.detach().clone() for p in self.model_of().parameters()]

    def on_log(self, step: int, metrics: dict) -> None:
        self.logs.append((step, metrics))


STEPS = dict(global_batch_size=16, max_steps=6, log_every_n_steps=2)


def test_stop_names_the_step_and_saves_the_state_before_it(fit, tmp_path):
    clean = fit(RegressionTask(), **{**STEPS, "max_steps": 2})
    with pytest.raises(
        lt.NonFiniteLossError, match=r"loss is not finite at step 3; replaying .*; the last good state"
    ) as error:
        fit(PoisonedSteps({3}), **STEPS)
    assert error.value.step == 3
    saved = load_checkpoint(error.value.checkpoint)
    assert saved["step"] == 2
    reference = clean.model.state_dict()
    assert all(torch.equal(saved["model"][name], value.cpu()) for name, value in reference.items())


def test_a_run_stopped_by_nan_continues_from_the_last_good_state(fit, tmp_path):
    """Resumed with the problem gone, the run ends exactly where a clean run ends."""
    config = dict(STEPS, out_dir=str(tmp_path / "run"), progress="none", logger="none")
    with pytest.raises(lt.NonFiniteLossError):
        lt.Trainer(lt.TrainConfig(**config)).fit(PoisonedSteps({4}))
    resumed = lt.Trainer(lt.TrainConfig(**config, resume="auto")).fit(RegressionTask())
    clean = fit(RegressionTask(), **STEPS)
    for name, value in clean.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    assert resumed.final_train_loss == clean.final_train_loss


def test_stop_without_checkpoints_says_nothing_was_saved(tmp_path):
    config = quiet_config(tmp_path / "run", checkpoint_every="never", **STEPS)
    with pytest.raises(lt.NonFiniteLossError, match=r"step 3; replaying .*; nothing was saved") as error:
        lt.Trainer(config).fit(PoisonedSteps({3}))
    assert error.value.checkpoint is None
    assert not any((tmp_path / "run" / "checkpoints").glob("*"))


def test_stop_on_the_first_step_saves_the_initial_state(fit):
    with pytest.raises(lt.NonFiniteLossError, match="at step 1;") as error:
        fit(PoisonedSteps({1}), **STEPS)
    assert load_checkpoint(error.value.checkpoint)["step"] == 0


def test_skip_drops_the_step_counts_it_and_keeps_the_log_finite(fit):
    holder = {}
    recorder = Weights(lambda: holder["model"])

    class Task(PoisonedSteps):
        def model(self):
            holder["model"] = super().model()
            return holder["model"]

        def scheduler(self, optimizer):
            return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    result = fit(Task({3}), callbacks=[recorder], on_nan="skip", **STEPS)
    assert recorder.statuses[2] is StepStatus.NONFINITE_LOSS
    assert [s for s in recorder.statuses if s is not StepStatus.STEPPED] == [StepStatus.NONFINITE_LOSS]
    assert all(torch.equal(a, b) for a, b in zip(recorder.after[2], recorder.after[3], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(recorder.after[3], recorder.after[4], strict=True))
    assert result.skipped_steps == 1 and result.nonfinite_steps == 1
    losses = [m["train_loss"] for _, m in recorder.logs if "train_loss" in m]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert [m["skipped_steps"] for _, m in recorder.logs if "skipped_steps" in m] == [0, 1, 1]
    # The scheduler stepped for the 5 updates only: 0.05 * 0.5**5.
    assert recorder.logs[-1][1]["lr"] == pytest.approx(0.05 * 0.5**5)


def test_one_bad_micro_batch_poisons_its_whole_step(fit):
    recorder = Weights(lambda: None)
    recorder.on_step = lambda stats: recorder.statuses.append(stats.status)
    # micro-batch 4 x 4 accumulation: loss call 6 is the 2nd micro-batch of step 2
    fit(PoisonedSteps({6}), callbacks=[recorder], micro_batch_size=4, on_nan="skip", **STEPS)
    assert recorder.statuses[:3] == [StepStatus.STEPPED, StepStatus.NONFINITE_LOSS, StepStatus.STEPPED]


class NanGradient(RegressionTask):
    """A finite loss whose gradient is NaN on one step: sqrt's derivative at 0."""

    calls = 0

    def loss(self, model, batch):
        self.calls += 1
        loss = super().loss(model, batch)
        if self.calls == 2:
            loss = loss + torch.sqrt(model[0].weight.sum() * 0)
        return loss


def test_a_nan_gradient_under_clipping_is_caught_too(fit):
    with pytest.raises(lt.NonFiniteLossError, match="gradient norm is not finite at step 2"):
        fit(NanGradient(), max_grad_norm=1.0, **STEPS)


def test_skipped_steps_reach_the_summary(fit):
    # Loss calls 2 and 4: steps 2 and 3, as the replay of step 2 (where its NaN came from) is call 3.
    result = fit(PoisonedSteps({2, 4}), on_nan="skip", **STEPS)
    summary = result.summary()
    assert summary["skipped_steps"] == 2 and summary["nonfinite_steps"] == 2


def test_model_weights_stay_finite_with_skip(fit):
    result = fit(PoisonedSteps({1, 2, 5}), on_nan="skip", **STEPS)
    weights = load_file(result.out_dir / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


class HugeTarget(RegressionTask):
    """One sample of step 3's global batch has a target of 1e200: its squared error overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.y[GlobalBatchSampler(160, BatchSplit(16, 16), 100).global_batch(2)[0]] = 1e200


def test_each_nan_policy_says_where_the_value_came_from(tmp_path):
    """The step's micro-batch replayed with hooks: here the model's outputs are finite, the loss is not."""
    origin = (
        r"non-finite loss at step 3, from finite model outputs \(model output max \S+ in float64\): "
        r"the task's loss made it"
    )
    with pytest.raises(
        lt.NonFiniteLossError, match=rf"^the training loss is not finite at step 3; {origin}; the last"
    ):
        lt.Trainer(quiet_config(tmp_path / "stop", **STEPS)).fit(HugeTarget())
    with pytest.warns(
        lt.LeantrainWarning, match=rf"^step 3 skipped: the training loss is not finite; {origin}$"
    ):
        skipped = lt.Trainer(quiet_config(tmp_path / "skip", on_nan="skip", **STEPS)).fit(HugeTarget())
    assert re.fullmatch(origin, skipped.nan_origin)
    assert json.loads((tmp_path / "skip" / "summary.json").read_text())["nan_origin"] == skipped.nan_origin
    rolled = lt.Trainer(quiet_config(tmp_path / "rollback", on_spike="rollback", **STEPS)).fit(HugeTarget())
    assert re.fullmatch(origin, rolled.rollbacks[0]["nan_origin"]) and rolled.nan_origin is not None
