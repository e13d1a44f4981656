"""Schedules that know the run: the task's scheduler is given the run's optimizer steps, the built-in
schedules follow their closed form at every step, across a resume and a changed max_steps, and a task's
scheduler that ends before the run is named."""

from __future__ import annotations

import csv
import math
import warnings
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler

import leantrain as lt
from leantrain.cli import main
from leantrain.step.schedules import finite_length, shorter_than_the_run
from tests.conftest import RegressionTask, quiet_config
from tests.test_resume import StopAt

BASE_LR = 0.05  # RegressionTask's SGD
# 160 samples / 16 = 10 steps an epoch.
SETTINGS = dict(global_batch_size=16, log_every_n_steps=1, lr_schedule="cosine", lr_warmup_steps=0.25)


def closed_form(step: int, total: int, warmup: int, kind: str = "cosine", floor: float = 0.0) -> float:
    """The learning rate after ``step`` updates, written out as the docs give it."""
    if step < warmup:
        return BASE_LR * step / warmup
    if kind == "constant":
        return BASE_LR
    progress = min(1.0, (step - warmup) / (total - warmup))
    decay = 1 - progress if kind == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return BASE_LR * (floor + (1 - floor) * decay)


class UsedRates(RegressionTask):
    """Records the learning rate each optimizer update is made with."""

    def __init__(self) -> None:
        super().__init__()
        self.used: list[float] = []

    def optimizer(self, params):
        used = self.used

        class Recording(torch.optim.SGD):
            def step(self, closure=None):
                used.append(self.param_groups[0]["lr"])
                return super().step(closure)

        return Recording(params, lr=BASE_LR, momentum=0.9)


def train(out_dir, task=None, callbacks=(), **changes) -> UsedRates:
    task = task or UsedRates()
    lt.Trainer(quiet_config(out_dir, **{**SETTINGS, **changes}), callbacks=list(callbacks)).fit(task)
    return task


def logged_rates(run_dir) -> dict[int, float]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(row["step"]): float(row["lr"]) for row in rows if row.get("lr")}


def assert_follows(
    task: UsedRates, run_dir, first: int, total: int, warmup: int, rows_from: int = 1, **shape: Any
) -> None:
    """Update ``s`` (from ``first``) is made with the rate after ``s`` updates; the row of step ``d``
    (from ``rows_from``) logs the rate after ``d`` updates (the next step's)."""
    assert task.used == pytest.approx(
        [closed_form(s, total, warmup, **shape) for s in range(first, total)], rel=1e-12, abs=1e-15
    )
    logged = logged_rates(run_dir)
    assert sorted(logged) == list(range(1, total + 1))
    for step in range(rows_from, total + 1):
        expected = closed_form(step, total, warmup, **shape)
        assert logged[step] == pytest.approx(expected, rel=1e-12, abs=1e-15), step


@pytest.mark.parametrize(
    ("kind", "warmup", "floor"), [("cosine", 0.25, 0.0), ("linear", 3, 0.1), ("constant", 2, 0.0)]
)
def test_the_learning_rate_is_the_closed_form_at_every_step(tmp_path, kind, warmup, floor):
    """Catches a wrong shape: progress counted from step 0 instead of the end of the warmup, a
    fraction of warmup not taken of the run's steps, the floor left out."""
    task = train(tmp_path, max_steps=12, lr_schedule=kind, lr_warmup_steps=warmup, lr_min_ratio=floor)
    steps = 3 if warmup == 0.25 else warmup  # 0.25 x 12
    assert_follows(task, tmp_path, 0, 12, steps, kind=kind, floor=floor)


def test_a_resumed_schedule_goes_on_where_it_stopped(tmp_path):
    """Catches a schedule whose position is not restored (it would warm up again after the resume)."""
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, max_steps=12, checkpoint_every=5, callbacks=[StopAt(8)])
    resumed = train(tmp_path, max_steps=12, checkpoint_every=5, resume="auto")
    assert_follows(resumed, tmp_path, 5, 12, 3)


def test_a_larger_max_steps_on_resume_rederives_the_schedule_and_says_so(tmp_path):
    """Catches a resume that keeps the checkpoint's total (the decay would end at step 8), and one
    that makes the first resumed update with the checkpoint's rate (0 at the end of its cosine)."""
    train(tmp_path, max_steps=8)
    with pytest.warns(lt.LeantrainWarning, match=r"schedule changed on resume at step 8: .* over 8 steps, "
                      r"warmup 2, this run's is cosine over 16 steps, warmup 4"):  # fmt: skip
        longer = train(tmp_path, max_steps=16, resume="auto")
    assert_follows(longer, tmp_path, 8, 16, 4, rows_from=9)
    first_run = [logged_rates(tmp_path)[step] for step in range(1, 9)]
    assert first_run == pytest.approx([closed_form(step, 8, 2) for step in range(1, 9)])


def test_an_unchanged_resume_says_nothing_about_the_schedule(tmp_path):
    train(tmp_path, max_steps=6, checkpoint_every=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lt.LeantrainWarning)
        train(tmp_path, max_steps=6, resume=str(tmp_path / "checkpoints" / "step-00000003.pt"))


def test_a_task_schedulers_checkpoint_does_not_resume_into_a_built_in_schedule(tmp_path):
    class StepDown(UsedRates):
        def scheduler(self, optimizer):
            return lr_scheduler.StepLR(optimizer, step_size=2)

    train(tmp_path, task=StepDown(), max_steps=4, lr_schedule="task", lr_warmup_steps=0)
    with pytest.raises(lt.CheckpointError, match=r"does not match this run's scheduler: .*a task's own"):
        train(tmp_path, max_steps=8, resume="auto")


class TakesTotal(RegressionTask):
    def __init__(self) -> None:
        super().__init__()
        self.given: list[int] = []

    def scheduler(self, optimizer, total_steps):
        self.given.append(total_steps)
        return lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)


def test_the_task_scheduler_is_given_the_runs_optimizer_steps(fit):
    """Catches the steps not passed, or max_steps passed (null here: 2 epochs of 10 steps decide)."""
    task = TakesTotal()
    with warnings.catch_warnings():
        warnings.simplefilter("error", lt.LeantrainWarning)  # its length fits the run: no warning
        fit(task, global_batch_size=16, max_epochs=2)
    assert task.given == [20]


def test_the_one_argument_scheduler_still_works_and_a_wrong_one_is_named(fit):
    class OneArgument(RegressionTask):
        def scheduler(self, optimizer):
            return lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    class ThreeArguments(RegressionTask):
        def scheduler(self, optimizer, total_steps, other):
            raise AssertionError("never called")

    result = fit(OneArgument(), global_batch_size=16, max_steps=2)
    assert result.steps == 2
    with pytest.raises(lt.TaskError, match=r"^task.scheduler\(optimizer, total_steps, other\) must take"):
        fit(ThreeArguments(), global_batch_size=16, max_steps=2)


def test_a_task_scheduler_shorter_than_the_run_is_a_warning(fit):
    """Catches the warning missing (a CosineAnnealingLR rises again past T_max, silently)."""

    class Hardcoded(RegressionTask):
        def scheduler(self, optimizer):
            return lr_scheduler.CosineAnnealingLR(optimizer, T_max=5)

    with pytest.warns(lt.LeantrainWarning, match=r"CosineAnnealingLR ends after 5 steps \(CosineAnnealingLR "
                      r"T_max=5\) but the run has 8 optimizer steps: .* total_steps"):  # fmt: skip
        fit(Hardcoded(), global_batch_size=16, max_steps=8)


def test_the_schedulers_whose_end_is_inspected():
    """Catches SequentialLR's milestone left out, a warmup LinearLR taken for a decay, a
    ChainedScheduler judged by its last scheduler rather than the first to end."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    warmup = lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    cosine = lr_scheduler.CosineAnnealingLR(opt, T_max=30)
    assert finite_length(lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=40))[0] == 40
    assert finite_length(warmup) is None
    assert finite_length(lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=7))[0] == 7
    assert finite_length(lr_scheduler.PolynomialLR(opt, total_iters=9))[0] == 9
    assert finite_length(lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[5]))[0] == 35
    chained = lr_scheduler.ChainedScheduler([cosine, lr_scheduler.PolynomialLR(opt, total_iters=50)])
    assert finite_length(chained)[0] == 30
    assert finite_length(lr_scheduler.StepLR(opt, step_size=3)) is None
    assert shorter_than_the_run(cosine, 30) is None
    assert "ends after 30 steps" in shorter_than_the_run(cosine, 31)


def test_settings_that_do_not_fit_are_one_line_naming_the_field(fit):
    for fields, message in [
        ({"lr_warmup_steps": -1}, "invalid lr_warmup_steps=-1: must be a number of steps"),
        ({"lr_warmup_steps": 1.5, "lr_schedule": "linear"}, "invalid lr_warmup_steps=1.5"),
        ({"lr_warmup_steps": 10}, "lr_warmup_steps=10: needs lr_schedule constant, linear or cosine"),
        ({"lr_min_ratio": -0.1, "lr_schedule": "cosine"}, "invalid lr_min_ratio=-0.1"),
        ({"lr_min_ratio": 0.1, "lr_schedule": "constant"}, "lr_min_ratio=0.1: needs lr_schedule linear"),
    ]:
        with pytest.raises(lt.ConfigError, match=message):
            lt.TrainConfig(**fields)
    whole = (
        r"^invalid lr_warmup_steps=4: is 4 steps, not fewer than the run's 4 optimizer steps: the learning "
        r"rate would never reach its base value; give fewer steps or a fraction such as 0\.1$"
    )
    with pytest.raises(lt.ConfigError, match=whole):
        fit(RegressionTask(), global_batch_size=16, max_steps=4, lr_schedule="linear", lr_warmup_steps=4)
    with pytest.raises(lt.TaskError, match="the task has its own scheduler and lr_schedule is cosine"):
        fit(TakesTotal(), global_batch_size=16, max_steps=4, lr_schedule="cosine")


def test_the_flags_set_a_schedule(tmp_path):
    task = ["--task", "tests.conftest:RegressionTask", "--global-batch-size", "16", "--max-steps", "4"]
    schedule = ["--lr-schedule", "linear", "--lr-warmup-steps", "1", "--lr-min-ratio", "0.5"]
    quiet = ["--log-every-n-steps", "1", "--progress", "none", "--logger", "none", "--out", str(tmp_path)]
    assert main(["fit", *task, *schedule, *quiet]) == 0
    rates = logged_rates(tmp_path)
    factors = [1, 5 / 6, 4 / 6, 0.5]  # warmup over at step 1, then 1 -> 0.5 at step 4
    assert [rates[step] for step in (1, 2, 3, 4)] == pytest.approx([BASE_LR * f for f in factors])


def test_the_shape_at_its_edges_and_as_described():
    """No warmup starts at the base rate (not 0/0); past the end the floor stays; the floor is named
    only where there is a decay to floor."""
    from leantrain.step.schedules import ScheduleShape

    assert ScheduleShape("cosine", 0, 10)(0) == 1.0
    assert ScheduleShape("linear", 2, 10)(2) == 1.0 and ScheduleShape("linear", 2, 10)(1) == 0.5
    assert ScheduleShape("linear", 0, 10)(15) == 0.0  # the default floor, past the end
    assert ScheduleShape("linear", 0, 10, min_ratio=0.25)(15) == 0.25
    assert ScheduleShape("cosine", 10, 100, 0.1).describe() == "cosine to 0.1 x over 100 steps, warmup 10"
    assert ScheduleShape("constant", 0, 100, 0.1).describe() == "constant over 100 steps, warmup 0"
    assert ScheduleShape("linear", 5, 100).describe() == "linear over 100 steps, warmup 5"


def schedule(lr: float | torch.Tensor, total: int, groups: int = 1):
    from leantrain.step.schedules import BuiltInSchedule, ScheduleShape

    params = [[torch.nn.Parameter(torch.zeros(1))] for _ in range(groups)]
    optimizer = torch.optim.SGD([{"params": p} for p in params], lr=lr)
    return BuiltInSchedule(optimizer, ScheduleShape("linear", 0, total))


def test_a_built_in_schedule_resumes_its_rates_in_place_and_says_what_changed():
    saved = schedule(0.1, total=10)
    for _ in range(4):
        saved.optimizer.step(), saved.step()
    state = saved.state_dict()
    assert "resume_warning" not in state and "shape" not in state  # saved once, as lr_lambdas
    same = schedule(torch.tensor(0.1), total=10)  # a rate held in a tensor (capturable optimizers)
    rate = same.optimizer.param_groups[0]["lr"]
    same.load_state_dict(state)
    assert same.optimizer.param_groups[0]["lr"] is rate and math.isclose(rate.item(), 0.1 * 0.6, rel_tol=1e-6)
    assert same.get_last_lr() == [rate] and same.resume_warning is None
    longer = schedule(0.1, total=20)
    longer.load_state_dict(state)
    assert longer.get_last_lr() == [pytest.approx(0.1 * 0.8)]
    assert longer.resume_warning == (
        "the learning-rate schedule changed on resume at step 4: the checkpoint's was linear over 10 steps, "
        "warmup 0, this run's is linear over 20 steps, warmup 0 (max_steps or the lr_* settings changed); "
        "the learning rate follows the new one from here on"
    )
    assert "resume_warning" not in longer.state_dict()
    with pytest.raises(ValueError):  # another number of parameter groups than the checkpoint's
        schedule(0.1, total=10, groups=2).load_state_dict(state)


@pytest.mark.parametrize("lambdas", [None, [], [None], [{"kind": "linear"}]])
def test_a_state_a_built_in_schedule_did_not_save_is_refused(lambdas):
    with pytest.raises(ValueError) as refused:
        schedule(0.1, total=10).load_state_dict({"lr_lambdas": lambdas, "last_epoch": 3})
    assert str(refused.value) == "it was not saved by a built-in lr_schedule (a task's own scheduler?)"
