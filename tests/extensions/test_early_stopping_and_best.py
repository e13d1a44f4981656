"""Early stopping and the best checkpoints, on a task whose validation loss follows a script."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import leantrain as lt
from tests.conftest import TinyClassifier, quiet_config
from tests.test_resume import StopAt


class ScriptedValidation(TinyClassifier):
    """The n-th validation's val_loss is ``script[n]`` (one validation batch: 50 samples)."""

    def __init__(self, script: list[float]) -> None:
        super().__init__()
        self.script = script
        self.validations = 0

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if model.training:
            return super().loss(model, batch)
        value = self.script[min(self.validations, len(self.script) - 1)]
        self.validations += 1
        return torch.tensor(value) + 0 * model(batch[0]).sum()


STALLS = [1.0, 0.9, 0.95, 0.93, 0.91, 0.5, 0.4]  # best at the 2nd validation, then 3 without improvement
EVERY_2 = dict(global_batch_size=64, max_steps=40, val_every_n_steps=2, log_every_n_steps=2)


def train(out: Path, script: list[float], callbacks: tuple[Any, ...] = (), **fields: Any) -> lt.FitResult:
    config = quiet_config(out, **{**EVERY_2, **fields})
    return lt.Trainer(config, callbacks=list(callbacks)).fit(ScriptedValidation(script))


def checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name[5:13]) for p in (out / "checkpoints").glob("step-*.pt"))


def test_a_stalled_metric_stops_the_run_after_a_checkpoint(tmp_path):
    result = train(tmp_path / "run", STALLS, early_stop_metric="val_loss", early_stop_patience=3)
    assert (result.steps, result.stopped_early) == (
        10,
        True,
    )  # validations at 2..10: the 5th stalls a 3rd time
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["steps"], summary["stopped_early"], summary["samples"]) == (10, True, 640)
    assert checkpoint_steps(tmp_path / "run")[-1] == 10
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[-1].startswith("10,")


def test_a_stop_between_log_points_logs_its_last_steps(tmp_path):
    """Stopped at step 10 with log points every 50 steps: the summary had a NaN final_train_loss
    and 1.9e11 samples/s (no window was timed), and metrics.csv no training row."""
    result = train(tmp_path / "run", STALLS, early_stop_metric="val_loss", early_stop_patience=3,
                   log_every_n_steps=50)  # fmt: skip
    assert (result.steps, result.stopped_early) == (10, True)
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    [trained] = [row for row in rows if row["train_loss"]]
    assert trained["step"] == "10" and float(trained["samples_per_second"]) == pytest.approx(
        result.samples_per_second, rel=0.5
    )
    assert math.isfinite(result.final_train_loss) and result.samples_per_second < 1e7


def test_min_delta_and_mode_decide_what_counts_as_an_improvement(tmp_path):
    # 1.0 -> 0.9 is no improvement by more than 0.2: three stalls from the first validation on.
    result = train(tmp_path / "a", STALLS, early_stop_metric="val_loss", early_stop_patience=3,
                   early_stop_min_delta=0.2)  # fmt: skip
    assert result.steps == 8
    # Maximised, the falling loss never improves after the first validation.
    result = train(
        tmp_path / "b", STALLS, early_stop_metric="val_loss", early_stop_patience=2, early_stop_mode="max"
    )
    assert result.steps == 6
    # Patience longer than the stall: the run reaches its end.
    result = train(tmp_path / "c", STALLS, early_stop_metric="val_loss", early_stop_patience=4, max_steps=16)
    assert (result.steps, result.stopped_early) == (16, False)


def test_early_stopping_resumes_where_it_left_off_and_a_stopped_run_stays_stopped(tmp_path):
    out = tmp_path / "run"
    settings = dict(early_stop_metric="val_loss", early_stop_patience=3, checkpoint_every=2)
    with pytest.raises(KeyboardInterrupt):
        train(out, STALLS, callbacks=(StopAt(7),), **settings)  # after 3 validations: 1 stall counted
    assert checkpoint_steps(out)[-1] == 6
    # The resumed task's own validation count starts again: its script continues from the 4th value.
    resumed = train(out, STALLS[3:], resume="auto", **settings)
    assert (resumed.steps, resumed.stopped_early) == (10, True)
    again = train(out, STALLS[3:], resume="auto", **settings)
    assert (again.steps, again.stopped_early) == (10, True)


def test_the_best_checkpoints_are_kept_beside_the_newest_and_best_weights_are_the_best_steps(tmp_path):
    out = tmp_path / "run"
    script = [0.8, 0.5, 0.9, 0.4, 0.7, 0.45, 0.95]  # validations at steps 2, 4, ..., 14
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Weights:
        def on_log(self, step: int, metrics: dict[str, float]) -> None:
            if "val_loss" in metrics:
                seen[step] = {k: v.cpu().clone() for k, v in result_model[0].state_dict().items()}

    result_model: list[torch.nn.Module] = []
    task = ScriptedValidation(script)
    original = task.model
    task.model = lambda: result_model.append(original()) or result_model[0]
    config = quiet_config(out, **{**EVERY_2, "max_steps": 14}, keep_best=2, best_metric="val_loss",
                          keep_checkpoints=1, checkpoint_every=3)  # fmt: skip
    lt.Trainer(config, callbacks=[Weights()]).fit(task)
    # Best two: 0.4 at step 8 and 0.45 at step 12 (0.5 at step 4 dropped out); newest: 14.
    assert checkpoint_steps(out) == [8, 12, 14]
    best = load_file(out / "best.safetensors")
    assert all(torch.equal(best[name], seen[8][name]) for name in best)
    saved = torch.load(out / "checkpoints" / "step-00000012.pt", weights_only=False)
    assert all(torch.equal(saved["model"][name].cpu(), seen[12][name]) for name in seen[12])


STALLED = "val_loss has not improved by more than 0 in 2 validation(s)"


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ([1.0, 2.0, 0.5, 0.6, 0.7], f"early stop at step 50: {STALLED} (best 0.5 at step 30)"),
        ([math.nan, math.nan], f"early stop at step 20: {STALLED} (no value was a number)"),
    ],
)
def test_the_stop_names_the_best_value_and_its_step_or_that_none_was_a_number(values, reason):
    """A run whose first validations are NaN (it diverged at once) stops with a reason, not a TypeError."""
    from leantrain.extensions.early_stopping import EarlyStopping
    from leantrain.extensions.metric_watch import MetricWatch

    stopping = EarlyStopping(MetricWatch("val_loss", "min", "early_stop_metric"), patience=2)
    for step, value in enumerate(values, start=1):
        assert stopping.stop_reason is None
        stopping.on_log(10 * step, {"train_loss": 1.0})  # a training log point counts for nothing
        stopping.on_log(10 * step, {"val_loss": value})
    assert stopping.stop_reason == reason


def test_a_nan_is_never_among_the_best(tmp_path):
    out = tmp_path / "run"
    train(out, [float("nan"), 0.5, float("nan")], max_steps=6, keep_best=1, best_metric="val_loss",
          keep_checkpoints=1)  # fmt: skip
    assert checkpoint_steps(out) == [4, 6]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(early_stop_metric="train_loss", val_every_n_steps=2), "must be a validation metric"),
        (dict(early_stop_metric="val_loss"), "needs val_every_n_steps"),
        (dict(keep_best=2), "best_metric=None: is needed with keep_best > 0"),
        (dict(best_metric="val_loss"), "is needed with keep_best > 0, and only then"),
        (dict(keep_best=1, best_metric="val_loss", checkpoint_every="never"), "needs checkpoints"),
        (dict(mlflow_uri="sqlite:///x.db"), "mlflow_uri='sqlite:///x.db': needs logger mlflow"),
        (
            dict(logger="tensorboard,csv"),
            "must be none or a comma-separated list of tensorboard, mlflow, wandb",
        ),
    ],
)
def test_options_that_only_work_together_are_one_line_errors(fields, message):
    with pytest.raises(lt.ConfigError, match=message):
        lt.TrainConfig(**fields)


@pytest.mark.parametrize("field", ["early_stop_metric", "best_metric"])
def test_a_watched_metric_the_task_lacks_fails_before_the_first_step(tmp_path, field):
    """It failed at the first validation, after training had run (and left no checkpoint)."""
    steps = []

    class Counts:
        def on_step(self, stats: lt.StepStats) -> None:
            steps.append(stats.step)

    expected = (
        rf"{field}='val_nope': is not a validation metric of this task \(it has val_accuracy, val_loss\)"
    )
    with pytest.raises(lt.ConfigError, match=expected):
        needs = {"keep_best": 1} if field == "best_metric" else {}
        train(tmp_path / "run", STALLS, (Counts(),), **needs, **{field: "val_nope"})
    assert steps == []


def test_a_metric_the_task_lacks_or_no_validation_data_is_a_one_line_error(tmp_path):
    expected = r"early_stop_metric='val_f1': is not a validation metric of this task \(it has val_accuracy, "
    with pytest.raises(lt.ConfigError, match=expected):
        train(tmp_path / "a", STALLS, early_stop_metric="val_f1")
    task = ScriptedValidation(STALLS)
    task.val_data = lambda: None
    config = quiet_config(tmp_path / "b", **EVERY_2, keep_best=1, best_metric="val_loss")
    with pytest.raises(lt.ConfigError, match="needs validation data: the task has no val_data"):
        lt.Trainer(config).fit(task)


def test_a_value_worse_than_the_k_best_asks_for_no_checkpoint_and_the_ranking_resumes():
    from types import SimpleNamespace

    from leantrain.extensions.best_checkpoints import BestCheckpoints
    from leantrain.extensions.metric_watch import MetricWatch

    folder, written = SimpleNamespace(protected=set()), []
    best = BestCheckpoints(
        MetricWatch("val_loss", "min", "best_metric"), 2, folder, lambda: written.append(1)
    )
    for step, value in [(10, 1.0), (20, 2.0), (30, 3.0)]:
        best.on_log(step, {"val_loss": value})
    assert (best.checkpoint_at, folder.protected, len(written)) == (20, {10, 20}, 1)  # 3.0 ranks third of 2
    best.on_log(40, {"val_loss": 0.5})
    assert (best.checkpoint_at, folder.protected, len(written)) == (40, {10, 40}, 2)

    resumed_folder = SimpleNamespace(protected=set())
    resumed = BestCheckpoints(MetricWatch("val_loss", "min", "best_metric"), 2, resumed_folder, lambda: None)
    resumed.load_state_dict(best.state_dict())
    assert (resumed.ranked, resumed_folder.protected) == ([(0.5, 40), (1.0, 10)], {10, 40})


@pytest.mark.parametrize(
    ("mode", "value", "better"),
    [
        ("min", 0.5, False),
        ("min", 0.25, True),
        ("max", 1.5, False),
        ("max", 1.75, True),
        ("max", 0.75, False),
    ],
)
def test_an_improvement_must_exceed_min_delta_not_only_reach_it(mode, value, better):
    from leantrain.extensions.metric_watch import MetricWatch

    assert MetricWatch("val_loss", mode, "early_stop_metric", min_delta=0.5).better(value, than=1.0) is better
