"""Bugs other training engines shipped, as tests of leantrain (issue 43).

Each test names the report (Lightning, Accelerate, transformers' Trainer, torchtitan, DeepSpeed,
Composer) in its docstring, says what went wrong there and what is checked here. Every check compares
leantrain with an independent computation of the same thing: a plain full-batch loop, one micro-batch
against accumulated ones, one process against two, an uninterrupted run against a resumed one.

The multi-process reports share two launches (module fixtures): 2 processes under ddp and under fsdp,
each beside the same run in one process. Reports tested where their concern's tests are: the same
augmentation every epoch (Lightning #20412, PyTorch #41329) in tests/data/test_stream.py.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.optim import lr_scheduler
from torch.utils.data import TensorDataset

import leantrain as lt
from leantrain.step.accumulator import StepStatus
from tests.conftest import DeepRegression, PoisonedSteps, RegressionTask, one_worker_at_a_time, quiet_config
from tests.extensions.test_early_stopping_and_best import STALLS, ScriptedValidation
from tests.test_batching import max_difference, reference_parameters
from tests.test_precision import Spikes
from tests.test_resume import RandomnessEverywhere, StopAt

# -- helpers -------------------------------------------------------------------------------------


def metric_rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open(newline="") as rows:
        return list(csv.DictReader(rows))


def logged(out: Path, name: str) -> dict[int, float]:
    """``name`` at each step of metrics.csv that logged it."""
    return {int(row["step"]): float(row[name]) for row in metric_rows(out) if row.get(name)}


def weights(out: Path, file: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(out / file)


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_close(a: dict[int, float], b: dict[int, float], tolerance: float = 1e-10) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for step, value in a.items():
        assert abs(value - b[step]) <= tolerance * max(1.0, abs(b[step])), (step, value, b[step])


def train(out: Path, task: Any, callbacks: tuple[Any, ...] = (), **fields: Any) -> lt.FitResult:
    return lt.Trainer(quiet_config(out, **fields), callbacks=list(callbacks)).fit(task)


class LossCalls:
    """A task wrapper that counts training loss calls (a resumed run's own work)."""

    def __init__(self, task: Any) -> None:
        self.task, self.calls = task, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def loss(self, model, batch):
        self.calls += model.training
        return self.task.loss(model, batch)


# -- accumulation and loss normalisation ---------------------------------------------------------


class EmptyRows(RegressionTask):
    """A token-level LossSum where every 5th sample has no valid position at all (a row of padding):
    with one sample per micro-batch, some micro-batches count 0 elements."""

    def __init__(self, samples: int = 160) -> None:
        super().__init__(samples=samples, loss_kind="sum")
        self.mask[::5] = 0


def test_an_accumulated_token_loss_is_the_global_token_mean_even_with_empty_micro_batches(fit):
    """https://github.com/huggingface/transformers/issues/24725 (transformers' Trainer, and its 2024
    gradient-accumulation fix): each micro-batch's loss was a mean over its own tokens, and the
    accumulated gradient the mean of those means, so tokens weighed differently by how the global
    batch was cut (and a micro-batch of padding only is 0/0). Checked: a LossSum accumulated over 16
    micro-batches of 1 sample, several with no valid element, trains exactly as a plain full-batch loop
    on sum / count of the whole global batch."""
    reference = reference_parameters(EmptyRows(), 12)
    for micro in (1, 4):
        result = fit(EmptyRows(), global_batch_size=16, micro_batch_size=micro, max_steps=12)
        assert result.accumulation_steps == 16 // micro
        assert max_difference([p.detach() for p in result.model.parameters()], reference) <= 1e-10, micro


@pytest.mark.parametrize("loss_kind", ["mean", "sum"])
def test_the_logged_training_loss_does_not_depend_on_the_accumulation(fit, loss_kind):
    """https://github.com/huggingface/transformers/issues/37766 (transformers' Trainer): "as
    gradient_accumulation_steps increases, the loss also increases": the logged loss was a sum over the
    micro-batches, or their means averaged. Checked: the train_loss logged at every step, and the final
    loss, are the same with 1, 4 and 16 micro-batches per step (one micro-batch is the reference)."""
    runs = {}
    for micro in (16, 4, 1):
        result = fit(
            RegressionTask(loss_kind=loss_kind),
            global_batch_size=16,
            micro_batch_size=micro,
            max_steps=5,
            log_every_n_steps=1,
        )
        runs[micro] = (logged(result.out_dir, "train_loss"), result.final_train_loss)
    for micro in (4, 1):
        assert_close(runs[micro][0], runs[16][0], 1e-12)
        assert runs[micro][1] == pytest.approx(runs[16][1], rel=1e-12)


def test_a_last_partial_global_batch_never_makes_a_short_accumulated_step(fit):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/19987 (Lightning): at the end of an
    epoch the loader ran out before ``accumulate_grad_batches`` micro-batches, and the short step was
    still scaled as a whole one. Checked: with 72 samples (4 global batches of 16 and 8 left over) and 4
    micro-batches per step, 10 steps over 3 epochs train exactly as a full-batch loop that drops each
    epoch's remainder, and 2 epochs are 8 steps."""
    reference = reference_parameters(RegressionTask(samples=72), 10)
    result = fit(RegressionTask(samples=72), global_batch_size=16, micro_batch_size=4, max_steps=10)
    assert max_difference([p.detach() for p in result.model.parameters()], reference) <= 1e-10
    two_epochs = fit(RegressionTask(samples=72), global_batch_size=16, micro_batch_size=4, max_epochs=2)
    assert two_epochs.steps == 2 * (72 // 16)


# -- schedulers and skipped steps ----------------------------------------------------------------


class HalvingSpikes(Spikes):
    """An fp16 overflow on step 3 (tests/test_precision.py); the learning rate halves at each step."""

    def scheduler(self, optimizer):
        return lr_scheduler.ExponentialLR(optimizer, gamma=0.5)


class HalvingNaN(PoisonedSteps):
    """A NaN loss on step 3 (one micro-batch per step); the learning rate halves at each step."""

    def __init__(self) -> None:
        super().__init__({3})

    def scheduler(self, optimizer):
        return lr_scheduler.ExponentialLR(optimizer, gamma=0.5)


class Statuses:
    def __init__(self) -> None:
        self.statuses: list[StepStatus] = []

    def on_step(self, stats: lt.StepStats) -> None:
        self.statuses.append(stats.status)


@pytest.mark.parametrize(
    ("task", "settings", "skipped"),
    [
        (HalvingSpikes, dict(precision="16-mixed", global_batch_size=32), StepStatus.OVERFLOW),
        (HalvingNaN, dict(on_nan="skip", global_batch_size=16), StepStatus.NONFINITE_LOSS),
    ],
)
def test_a_skipped_step_does_not_move_the_learning_rate_schedule(
    fit, task, settings, skipped, native_16_bit_cpu
):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/18828 (Lightning: the scheduler is still
    stepped when an fp16 overflow skipped the optimizer step) and
    https://github.com/huggingface/accelerate/issues/4242 (Accelerate: a skipped update not seen as
    skipped, and the schedule advanced). Checked, for an fp16 overflow and for a NaN step dropped by
    ``on_nan skip``: the learning rate logged after every step is the base rate halved once per step that
    updated the weights, counted from the steps' own statuses."""
    recorder = Statuses()
    dropped = skipped is StepStatus.NONFINITE_LOSS
    said = pytest.warns(lt.LeantrainWarning, match="step 3 skipped") if dropped else contextlib.nullcontext()
    with said:
        result = fit(task(), callbacks=[recorder], max_steps=6, log_every_n_steps=1, **settings)
    assert recorder.statuses[2] is skipped and recorder.statuses.count(skipped) == 1
    base = task().optimizer(torch.nn.Linear(1, 1).parameters()).param_groups[0]["lr"]
    rates = logged(result.out_dir, "lr")
    updates = 0
    for step, status in enumerate(recorder.statuses, start=1):
        updates += status is StepStatus.STEPPED
        assert rates[step] == pytest.approx(base * 0.5**updates, rel=1e-12), step


class MilestoneRates(RegressionTask):
    """The task's own MultiStepLR: the rate drops 10x after steps 5 and 7."""

    def scheduler(self, optimizer):
        return lr_scheduler.MultiStepLR(optimizer, milestones=[5, 7], gamma=0.1)


def test_a_task_schedule_resumed_just_before_its_milestone_does_not_lag(tmp_path):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/4655 (Lightning: a MultiStepLR lagged one
    step behind after ``resume_from_checkpoint``, its milestone crossed late). Checked: a run resumed from
    step 4, one step before the first milestone, logs the uninterrupted run's learning rate at every step,
    and ends with its weights bit-identical."""
    settings = dict(global_batch_size=16, max_steps=9, log_every_n_steps=1, checkpoint_every=4)
    reference = train(tmp_path / "reference", MilestoneRates(), **settings)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", MilestoneRates(), (StopAt(6),), **settings)
    resumed = train(tmp_path / "run", MilestoneRates(), resume="auto", **settings)
    rates, expected = logged(resumed.out_dir, "lr"), logged(reference.out_dir, "lr")
    assert rates == expected
    assert expected[5] == pytest.approx(0.1 * expected[4]) and expected[7] == pytest.approx(0.1 * expected[6])
    assert_bit_identical(weights(resumed.out_dir), weights(reference.out_dir))


# -- resume at epoch boundaries and twice in a row -----------------------------------------------


def test_a_resume_from_an_epoch_end_checkpoint_trains_the_next_epoch(tmp_path):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/850 (Lightning: a checkpoint written at the
    end of an epoch restarted that epoch on resume; other engines skipped the next one instead).
    Checked: 72 samples in global batches of 16 are 4 steps an epoch; a run resumed from the checkpoint
    of step 4 (the end of epoch 0) trains 6 more steps (counted by its loss calls) and ends bit-identical
    to the uninterrupted 10-step run."""
    settings = dict(global_batch_size=16, micro_batch_size=8, max_steps=10, checkpoint_every=4)
    reference = train(tmp_path / "reference", RegressionTask(samples=72), **settings)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", RegressionTask(samples=72), (StopAt(6),), **settings)
    task = LossCalls(RegressionTask(samples=72))
    resumed = train(tmp_path / "run", task, resume="auto", **settings)
    assert task.calls == 6 * 2  # steps 5..10, two micro-batches each
    assert_bit_identical(weights(resumed.out_dir), weights(reference.out_dir))


TWICE = dict(global_batch_size=16, micro_batch_size=4, max_steps=14, log_every_n_steps=1, checkpoint_every=4)


@pytest.fixture(scope="module")
def resumed_twice(tmp_path_factory) -> tuple[Path, Path, list[int]]:
    """An uninterrupted run, and one killed after steps 6 and 10 and resumed each time (from the
    checkpoints of steps 4 and 8); the loss calls of each of its 3 processes."""
    root = tmp_path_factory.mktemp("twice")
    train(root / "reference", RandomnessEverywhere(), **TWICE)
    calls = []
    for stop in (6, 10, None):
        task = LossCalls(RandomnessEverywhere())
        resume = "auto" if calls else None
        if stop is None:
            train(root / "run", task, resume=resume, **TWICE)
        else:
            with pytest.raises(KeyboardInterrupt):
                train(root / "run", task, (StopAt(stop),), resume=resume, **TWICE)
        calls.append(task.calls)
    return root / "reference", root / "run", calls


def test_a_second_resume_starts_from_the_second_checkpoints_step(resumed_twice):
    """https://github.com/pytorch/torchtitan/issues/571 (torchtitan: resumed a second time, the run loaded
    the newest checkpoint but its step counter was still the first resume's: "Loading the checkpoint at
    step 45 ... Training starts at step 26"). Checked: the third process trains steps 9..14 only (6 steps
    of 4 micro-batches), and metrics.csv holds each step 1..14 once, with the uninterrupted run's losses."""
    reference, run, calls = resumed_twice
    assert calls == [6 * 4, 6 * 4, 6 * 4]  # steps 1-6, 5-10, 9-14
    rows = [int(row["step"]) for row in metric_rows(run)]
    assert rows == list(range(1, 15))
    assert logged(run, "train_loss") == logged(reference, "train_loss")
    assert json.loads((run / "summary.json").read_text())["steps"] == 14


def test_two_resumes_with_accumulation_end_bit_identical(resumed_twice):
    """https://github.com/mosaicml/composer/issues/3725 (Composer: runs resumed several times diverged
    from the uninterrupted one after the second or third resume; gradient accumulation suspected).
    Checked, with 4 micro-batches per step, dropout, augmentation, Adam and a StepLR: twice resumed, the
    weights and the final loss are bit-identical to the uninterrupted run's."""
    reference, run, _ = resumed_twice
    assert_bit_identical(weights(run), weights(reference))
    final = (json.loads((out / "summary.json").read_text())["final_train_loss"] for out in (run, reference))
    assert next(final) == next(final)


# -- callbacks and the weight average across resumes ---------------------------------------------


class Tally:
    """A user's callback with state: the steps it saw and the sum of the losses logged."""

    def __init__(self) -> None:
        self.steps, self.losses = 0, 0.0

    def on_step(self, stats: lt.StepStats) -> None:
        self.steps += 1

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        self.losses += metrics.get("train_loss", 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "losses": self.losses}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.losses = state["steps"], state["losses"]


def test_a_users_callback_keeps_its_state_across_two_resumes(tmp_path):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/2631 (Lightning: custom callbacks were
    lost after ``resume_from_checkpoint``; a checkpoint should hold everything to go on, callbacks
    included). Checked: a stateful callback of the user's, killed twice and resumed, ends with the counts
    of the same callback in an uninterrupted run."""
    settings = dict(global_batch_size=16, max_steps=10, log_every_n_steps=1, checkpoint_every=3)
    whole = Tally()
    train(tmp_path / "reference", RegressionTask(), (whole,), **settings)
    for stop in (5, 8, None):
        tally = Tally()
        stops = () if stop is None else (StopAt(stop),)
        resume = "auto" if stop != 5 else None
        if stop is None:
            train(tmp_path / "run", RegressionTask(), (tally,), resume=resume, **settings)
        else:
            with pytest.raises(KeyboardInterrupt):
                train(tmp_path / "run", RegressionTask(), (tally, *stops), resume=resume, **settings)
    assert tally.steps == whole.steps == 10
    assert tally.losses == pytest.approx(whole.losses, rel=1e-12)


def test_early_stopping_resumed_from_a_checkpoint_taken_at_a_validation_stops_where_it_would_have(tmp_path):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/1464 (Lightning: EarlyStopping's state in
    a checkpoint lagged one epoch behind, saved before that epoch's validation was counted) and
    https://github.com/Lightning-AI/pytorch-lightning/issues/1463 (its wait count reset on resume).
    Checked: validations at steps 2, 4, 6, 8 score 1.0, 0.9, 0.95, 0.93 (two stalls); the checkpoint of
    step 8 is taken right after the 4th validation; resumed from it, the run stops at step 10 (the 3rd
    stall), as the uninterrupted run does."""
    settings = dict(
        global_batch_size=64, max_steps=40, val_every_n_steps=2, log_every_n_steps=2, checkpoint_every=4,
        early_stop_metric="val_loss", early_stop_patience=3,
    )  # fmt: skip
    reference = train(tmp_path / "reference", ScriptedValidation(STALLS), **settings)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", ScriptedValidation(STALLS), (StopAt(9),), **settings)
    # The resumed task's own count of validations starts again: its script goes on at the 5th value.
    resumed = train(tmp_path / "run", ScriptedValidation(STALLS[4:]), resume="auto", **settings)
    assert (resumed.steps, resumed.stopped_early) == (reference.steps, reference.stopped_early) == (10, True)


class WithValidation(RegressionTask):
    def val_data(self) -> TensorDataset:
        return TensorDataset(self.x[:32], self.y[:32], self.mask[:32])


def test_the_average_and_the_trained_weights_resume_apart_after_validating_the_average(tmp_path):
    """https://github.com/mosaicml/composer/pull/1003 (Composer: resuming training with EMA went wrong;
    elsewhere the average was not saved, or a checkpoint written while the average was swapped in for
    validation resumed training from the average). Checked: a run validating the average (--ema-validate)
    every 4 steps, checkpointed right after those validations, killed and resumed, ends with the trained
    weights and the average bit-identical to an uninterrupted run that never swapped the average in."""
    settings = dict(global_batch_size=16, micro_batch_size=8, max_steps=10, ema_decay=0.8, shuffle=False)
    reference = train(tmp_path / "reference", WithValidation(), **settings)
    swapping = dict(settings, ema_validate=True, val_every_n_steps=4, checkpoint_every=4)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", WithValidation(), (StopAt(6),), **swapping)
    resumed = train(tmp_path / "run", WithValidation(), resume="auto", **swapping)
    assert_bit_identical(weights(resumed.out_dir), weights(reference.out_dir))
    average = weights(reference.out_dir, "ema.safetensors")
    assert_bit_identical(weights(resumed.out_dir, "ema.safetensors"), average)
    assert not all(torch.equal(average[n], t) for n, t in weights(reference.out_dir).items())  # an average


# -- several processes: what is logged, validated, clipped and decided across ranks --------------


def launched_once(factory: Any, name: str, one: list[str], two: list[str]) -> tuple[Path, Path]:
    """``one`` in this process and ``two`` on 2 processes, into a folder every pytest-xdist worker of the
    session shares: made once (the tests that read it may run on several workers)."""
    from tests.distributed.conftest import trained_weights

    with one_worker_at_a_time(factory, name) as folder:
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            trained_weights(folder / "one", one)
            trained_weights(folder / "two", two, processes=2)
            (folder / "done").touch()
    return folder / "one", folder / "two"


DDP_FIT = ["fit", "--task", "tests.test_peer_bugs:RankedValidation", "--global-batch-size", "8",
           "--micro-batch-size", "2", "--max-steps", "8", "--val-every-n-steps", "2",
           "--log-every-n-steps", "1", "--max-grad-norm", "0.05", "--early-stop-metric", "val_score",
           "--early-stop-patience", "2", "--progress", "plain", "--logger", "none",
           "--hang-timeout", "60"]  # fmt: skip
EVEN_SCORES = [1.0] * 8  # stalls from the 2nd validation on
ODD_SCORES = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]  # improves at every validation


class RankedValidation(DeepRegression):
    """A float64 LossSum (1..4 elements a sample: every rank's count differs), 101 validation samples
    (shares of 51 and 50 on 2 processes, each rank taking every 2nd sample), and a metric ``score`` whose
    value is EVEN_SCORES[v] on the even samples and ODD_SCORES[v] on the odd ones at validation v: the
    whole set improves at every validation, rank 0's share alone stalls from the 2nd."""

    def __init__(self) -> None:
        super().__init__(loss_kind="sum")
        self.train_calls = 0

    def val_data(self) -> TensorDataset:
        parity = (torch.arange(101) % 2).double()
        return TensorDataset(self.x[:101], self.y[:101], self.mask[:101], parity)

    def loss(self, model, batch):
        self.train_calls += model.training
        return super().loss(model, batch[:3])

    def metrics(self, model, batch):
        per_rank_step = 8 // (2 * int(os.environ.get("WORLD_SIZE", "1")))  # micro-batches a step here
        validation = max(self.train_calls // per_rank_step // 2 - 1, 0)  # after steps 2, 4, ...
        parity = batch[3]
        return {"score": torch.where(parity > 0, ODD_SCORES[validation], EVEN_SCORES[validation])}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[Path, Path]:
    """The same run in one process and on 2 processes under ddp."""
    return launched_once(tmp_path_factory, "peer_bugs_ddp", DDP_FIT, [*DDP_FIT, "--strategy", "ddp"])


def test_two_ranks_with_different_token_counts_train_as_one_process(ddp_runs):
    """https://github.com/huggingface/transformers/issues/37474 (transformers' Trainer normalised a
    token-mean loss wrongly with more than one GPU: each rank divided by a count that was not the global
    batch's). Checked: a LossSum whose element counts differ by rank, on 2 ddp processes, gives the
    weights of one process to 1e-10 (float64)."""
    one, two = ddp_runs
    single, double = weights(one), weights(two)
    assert sorted(single) == sorted(double)
    for name in single:
        assert float((single[name] - double[name]).abs().max()) <= 1e-10, name


def test_the_logged_training_loss_is_the_whole_global_batchs_on_two_ranks(ddp_runs):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/4395 (Lightning: the loss shown on the
    progress bar was the sum of every GPU's loss; elsewhere rank 0's alone was logged). Checked: the
    train_loss logged at each of 8 steps on 2 processes is one process's, to 1e-10."""
    one, two = ddp_runs
    assert_close(logged(two, "train_loss"), logged(one, "train_loss"))


def test_the_clipped_gradient_norm_is_the_global_one_on_two_ranks(ddp_runs):
    """https://github.com/deepspeedai/DeepSpeed/issues/7837 (DeepSpeed: the gradient norm abnormally large
    under ZeRO-0, a per-rank view of the gradient instead of the reduced one). Checked: with clipping on
    (max norm 0.05, below every step's norm), the grad_norm logged at each step on 2 processes is one
    process's, to 1e-10; the weights test above shows the clipping used it."""
    one, two = ddp_runs
    norms = logged(one, "grad_norm")
    assert min(norms.values()) > 0.05  # every step was clipped
    assert_close(logged(two, "grad_norm"), norms)


def test_uneven_validation_shares_count_every_sample_once(ddp_runs):
    """https://github.com/mosaicml/composer/pull/2218 (Composer, "Exact Eval": DistributedSampler padded
    the ranks' shares with repeated samples, which counted twice in the metrics). Checked: 101 validation
    samples on 2 ddp processes (51 and 50, the second rank running a spare forward) give one process's
    val_loss at every validation, to 1e-10."""
    one, two = ddp_runs
    assert_close(logged(two, "val_loss"), logged(one, "val_loss"))


def test_a_metric_averaged_over_uneven_shares_is_weighted_by_samples(ddp_runs):
    """https://github.com/huggingface/accelerate/issues/1674 (Accelerate: ``gather_for_metrics`` gave a
    wrong evaluation with several GPUs and uneven batch sizes). Checked: the score, 1 on the 51 even
    samples and 10, 9, 8, 7 on the 50 odd ones, is their sample-weighted mean over the 101 samples on 2
    processes, as in one process: not the mean of the two ranks' means."""
    one, two = ddp_runs
    expected = {2 * (v + 1): (51 * EVEN_SCORES[v] + 50 * ODD_SCORES[v]) / 101 for v in range(4)}
    assert_close(logged(one, "val_score"), expected, 1e-12)
    assert_close(logged(two, "val_score"), expected, 1e-12)


def test_ranks_whose_own_shares_disagree_decide_early_stopping_together(ddp_runs):
    """https://github.com/Lightning-AI/pytorch-lightning/issues/379 (Lightning: with ddp, early stopping
    met on some processes but not all stopped those, and the others hung). Checked: rank 0's share of
    the score stalls from the 2nd validation (patience 2 would stop it at step 6), the whole set improves:
    both processes train the 8 steps, as one process does, and the run ends (no rank left waiting)."""
    one, two = ddp_runs
    for out in (one, two):
        summary = json.loads((out / "summary.json").read_text())
        assert (summary["steps"], summary["stopped_early"]) == (8, False), out


FSDP_FIT = ["fit", "--task", "tests.distributed.tasks:sum_task", "--global-batch-size", "16",
            "--max-steps", "6", "--log-every-n-steps", "1", "--max-grad-norm", "0.05",
            "--progress", "plain", "--logger", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> tuple[Path, Path]:
    """The same clipped run in one process and on 2 processes under fsdp (every Linear sharded)."""
    sharded = ["--strategy", "fsdp", "--shard-blocks", "Linear", "--micro-batch-size", "4"]
    return launched_once(
        tmp_path_factory, "peer_bugs_fsdp", [*FSDP_FIT, "--micro-batch-size", "16"], [*FSDP_FIT, *sharded]
    )


def test_the_gradient_norm_of_sharded_gradients_is_the_whole_models(fsdp_runs):
    """https://github.com/pytorch/torchtitan/issues/766 (torchtitan: under FSDP the grad_norm varied
    across ranks: each rank's shard's norm, not aggregated). Checked: with every Linear sharded over 2
    processes, the grad_norm logged at each step is one process's, to 1e-10 (and every step clipped)."""
    one, two = fsdp_runs
    norms = logged(one, "grad_norm")
    assert min(norms.values()) > 0.05
    assert_close(logged(two, "grad_norm"), norms)


def test_clipping_sharded_gradients_scales_every_shard_by_the_global_norm(fsdp_runs):
    """https://github.com/deepspeedai/DeepSpeed/issues/8475 (DeepSpeed: clipping combined rank-local norms
    as if every rank held the same parameters; where ranks hold different parts, the clip coefficient and
    the update changed with the layout). Checked: clipped at 0.05 on every step, the 2 processes' sharded
    run ends with one process's weights, to 1e-10."""
    one, two = fsdp_runs
    single, sharded = weights(one), weights(two)
    assert sorted(single) == sorted(sharded)
    for name in single:
        assert float((single[name] - sharded[name]).abs().max()) <= 1e-10, name
