"""A run: its parts assembled by the builders, the loop, and the summary at the end.

The loop makes no host synchronisation between log points: losses stay on the device
(``LossTracker``) and are read every ``log_every_n_steps`` steps. It never asks which strategy
it has: the accumulator runs each step through the strategy.
"""

from __future__ import annotations

import gc
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from leantrain.adapters import ADAPTER_FOLDER
from leantrain.data.build import load_train_data
from leantrain.diagnose.nan_origin import origin_line
from leantrain.errors import NonFiniteLossError, RunInterrupted
from leantrain.files import atomic_write_json
from leantrain.run.builders import (
    build_data,
    build_model_part,
    build_observers,
    build_optimization,
    prepare_model,
)
from leantrain.run.context import RunContext
from leantrain.run.data import Schedule
from leantrain.run.hooks import Callback, StepStats
from leantrain.run.observers import LogWindow
from leantrain.run.persistence import Persistence
from leantrain.run.recovery import Recovery
from leantrain.run.results import FitResult, fit_result
from leantrain.run.spikes import Spike
from leantrain.runtime import emulated_precision
from leantrain.step.accumulator import StepOutcome, StepStatus, TaskLoss
from leantrain.step.batching import BatchSplit
from leantrain.step.evaluation import evaluate
from leantrain.stop_signals import StopSignals
from leantrain.strategies.base import Strategy


class Run:
    """The parts of one run, built from the config before the loop starts (see ``builders.py``)."""

    def __init__(self, ctx: RunContext, strategy: type[Strategy], callbacks: Sequence[Callback]) -> None:
        cfg, self.ctx = ctx.cfg, ctx
        strategy.check_task(ctx.task)
        split = BatchSplit.from_config(cfg, world_size=ctx.dims.dp)
        prepared = prepare_model(ctx, strategy)  # before the data: task.model() draws its weights first
        train = load_train_data(ctx.task, cfg, ctx.env)
        schedule = Schedule.of(cfg, train.size, split)
        self.model = build_model_part(ctx, strategy, prepared, train, split)
        self.optimization = build_optimization(ctx, self.model, schedule.total_steps)
        self.persistence = Persistence(ctx)
        self.resumed = self.persistence.resume(
            self.model, self.optimization, train.size, schedule.total_steps
        )
        if cfg.micro_batch_size == "auto":
            split = split.with_micro_batch(self.optimization.sizer.search(split, train.dataset))
        self.optimization.use_split(split)
        self.data = build_data(ctx, self.model, train, schedule, split, self.resumed)
        self.observers = build_observers(
            ctx, self.model, self.optimization, self.data, self.persistence, self.resumed, callbacks
        )
        self.recovery = Recovery(cfg)  # --on-spike: its state as the checkpoint left it
        if (note := self.recovery.load(self.resumed.spikes, ctx.env.rank, ctx.env.world_size)) is not None:
            self.resumed.notes.append(note)
        self.steps_done = 0  # the step training ended at: total_steps, or where it stopped early
        self.task_loss = TaskLoss(ctx.task)  # keeps the step's micro-batches: a non-finite one is replayed
        self.val_metrics: dict[str, float] = {}
        self._log_setup()

    def _log_setup(self) -> None:
        ctx, split, logger = self.ctx, self.data.split, self.observers.logger
        start = self.data.start_step
        resumed = f", resumed after step {start}" if start else ""
        logger.message(
            f"training {self.data.schedule.total_steps} steps of {split.global_batch_size} samples "
            f"(micro-batch {split.micro_batch_size} x {split.accumulation_steps} accumulation), "
            f"x {ctx.env.world_size} process(es), strategy {self.model.strategy.name}, precision "
            f"{self.model.precision.name}, on {ctx.device}, into {_where(ctx)}{resumed}"
        )
        notes = self.model.setup_lines() + self.optimization.notes + self.optimization.sizer.notes
        for note in notes + self.data.train.notes + self.resumed.notes:
            logger.message(note)
        for callback in self.observers.callbacks:  # trackers: where they log, and what chose it
            for line in callback.setup_lines() if hasattr(callback, "setup_lines") else []:
                logger.message(line)
        for text in self.optimization.warnings:  # the scheduler's, found at set-up or resume
            logger.warning(text)
        if (slow := emulated_precision(self.model.precision.name, ctx.device)) is not None:
            logger.warning(slow)
        self._warn_about_batch_norm()

    def _warn_about_batch_norm(self) -> None:
        """Once per split: BatchNorm layers whose statistics follow it (see ``step/batch_norm.py``)."""
        if (text := self.model.batch_norm_warning(self.data.split)) is not None:
            self.observers.logger.warning(text)

    def _shrink_micro_batch(self, step: int, reason: str) -> Iterator[Any]:
        """Halve the micro-batch (the global batch stays) and reload from ``step``; the new batches."""
        old = self.data.split
        split = old.with_micro_batch(self.optimization.sizer.smaller(old, step, reason))
        # The abandoned step's tensors can sit in reference cycles (its traceback's frames, the
        # user's own objects): free them before the retry, or they count against the budget.
        gc.collect()
        self.model.strategy.reset_after_out_of_memory()
        self.optimization.use_split(split)
        self.data.restart(split, step)
        self.observers.logger.warning(
            f"{reason} at step {step + 1}: micro-batch {old.micro_batch_size} -> {split.micro_batch_size} "
            f"(x {split.accumulation_steps} accumulation); the global batch and the optimisation stay"
        )
        self._warn_about_batch_norm()
        return self.data.batches(self.observers.heartbeat)

    def train(self, signals: StopSignals) -> None:
        with self.observers.watching():
            try:
                self._train(signals)
            except BaseException:
                self._wait_for_saves_after_error()
                raise
            self.persistence.saves.wait()  # the final checkpoint is complete before fit returns

    def _wait_for_saves_after_error(self) -> None:
        """A save in flight completes (it is the newest state to resume from); its own failure is
        a warning, so that the error that ended the run is the one raised."""
        try:
            self.persistence.saves.wait()
        except Exception as error:
            self.observers.logger.warning(
                f"the checkpoint being written when the run ended failed too: {error}"
            )

    def _train(self, signals: StopSignals) -> None:
        cfg, observers, total = self.ctx.cfg, self.observers, self.data.schedule.total_steps
        step = self.steps_done = self.data.start_step
        if (early := observers.stop_reason()) is not None:  # a resume of a run that stopped early
            observers.logger.message(f"{early}; the checkpoint is where it ended: nothing more to train")
            return
        if self._stop_requested(signals, step, checkpoint_due=True):  # a signal while it was set up
            received = signals.received or signal.SIGTERM
            raise RunInterrupted(received.name, int(received), step, None, set_up_only=True)
        task_loss = self.task_loss
        loss_fn = observers.heartbeat.after(
            self.ctx.instruments.loss(self.optimization.sizer.enforce_budget(task_loss))
        )
        batches = self.data.batches(observers.heartbeat)
        self.model.strategy.module.train()
        self.resumed.restore_rng()  # last, after everything that draws random numbers at set-up
        if self.recovery.rolls_back and self.recovery.snapshot is None:  # a state to go back to at once
            self.recovery.take(step, (self.model, self.optimization, observers))
        window = LogWindow(step, time.perf_counter(), observers.compiler.seconds)
        memory = self.optimization.memory  # what the first step saves for backward is counted
        while step < total:
            done = step + 1
            log_due = done % cfg.log_every_n_steps == 0 or done == total
            task_loss.start_step(done, self.data.split.accumulation_steps)
            outcome = self.optimization.step(memory.loss_fn(task_loss, loss_fn), batches, step, log_due)
            if outcome.status is StepStatus.OUT_OF_MEMORY:
                batches = self._shrink_micro_batch(step, "out of memory")  # and the same step again
                continue
            if (spent := memory.account(self.optimization.optimizer)) is not None:  # after the first step
                observers.logger.message(spent.describe())
            if self.optimization.sizer.allocator_struggles():
                batches = self._shrink_micro_batch(
                    done, "the CUDA allocator retried in several steps in a row"
                )
            if not outcome.stepped:
                self._skipped(step, outcome.status)
            observers.on_step(StepStats(done, *outcome))
            if log_due and (spike := self._log_point(done, window, outcome)) is not None:
                self._after_spike(spike, done)
            val_due = self.data.validation_due(done)
            if val_due:
                window.leave_out(self._validate(done), observers.compiler.seconds)
            # Callbacks speak only after a log point or a validation: nothing to ask otherwise.
            early = observers.stop_reason() if log_due or val_due else None
            asked = val_due and observers.checkpoint_requested(done)
            checkpoint_due = cfg.checkpoint_due(done, total) or asked or early is not None
            if (stop := self._stop_requested(signals, done, checkpoint_due)) or checkpoint_due:
                self._save_at(done, stop, signals)
            if self.recovery.snapshot_due(done):  # the state a checkpoint here holds
                self.recovery.take(done, (self.model, self.optimization, observers))
            step = self.steps_done = observers.heartbeat.step = done
            observers.heartbeat.beat()  # the step, and its checkpoint, are done
            if early is not None:
                observers.logger.message(early)
                break
        if window.first_step < step:  # stopped early between log points: its last steps are logged too
            self._log_point(step, window, outcome)
        if self.data.validation is not None and self.data.start_step == total:
            self._validate(total)  # resumed after the last step: not validated yet

    def _save_at(self, done: int, stop: bool, signals: StopSignals) -> None:
        """The checkpoint of step ``done`` (if the run keeps checkpoints); after a stop signal, the
        interruption that names it, once it is complete."""
        path = self._save_checkpoint(done) if self.ctx.cfg.saves_checkpoints else None
        if stop:
            self.persistence.saves.wait()  # the message names a complete checkpoint
            received = signals.received or signal.SIGTERM
            raise RunInterrupted(received.name, int(received), done, path and str(path))

    def _save_checkpoint(self, done: int) -> Path:
        return self.persistence.save(
            done, self.model, self.optimization, self.data, self.observers, self.recovery
        )

    def _after_spike(self, spike: Spike, done: int) -> None:
        """Warn of a spike, or roll back past it."""
        if not self.recovery.rolls_back:
            self.observers.logger.warning(f"{spike.describe()} (--on-spike rollback would undo it)")
            return
        self._roll_back(spike, done)

    def _roll_back(self, spike: Spike, done: int) -> None:
        """Restore the snapshot and go on after step ``done``: the batches since the snapshot are skipped.
        The loader stays: its next batch is step ``done + 1``'s, as the data order is the step's."""
        observers = self.observers
        parts = (self.model, self.optimization, observers)
        record = self.recovery.roll_back(spike, done, parts, self.data.global_batch_indices)
        first, last = record["skipped_steps"]
        observers.logger.warning(
            f"{spike.describe()}: rolled back to step {record['restored_step']}, skipping the global "
            f"batches of steps {first}-{last} ({len(self.recovery.rollbacks)} of at most "
            f"{self.recovery.max_rollbacks} rollbacks)"
        )
        event = {"rolled_back_to_step": float(record["restored_step"]), "spike_loss": spike.loss}
        observers.logger.log(done, event)
        observers.on_log(done, event)

    def _skipped(self, step: int, status: StepStatus) -> None:
        """Count a step that made no update; apply the NaN policy to a non-finite one (with
        ``--on-spike rollback``: roll back past it)."""
        self.observers.health.count_skip(step, status)
        if status is StepStatus.OVERFLOW:
            return  # routine for fp16: the scale was lowered
        self.optimization.tracker.discard_step(step)  # non-finite values never reach the log
        what = "loss" if status is StepStatus.NONFINITE_LOSS else "gradient norm"
        origin = self._nan_origin(step, status)  # before a rollback: the replay sees the step's weights
        detail = "" if origin is None else f"; {origin}"
        if self.recovery.rolls_back:
            self._roll_back(Spike(step + 1, float("nan"), float("nan"), what, origin), step + 1)
            return
        if self.ctx.cfg.on_nan == "skip":
            self.observers.logger.warning(
                f"step {step + 1} skipped: the training {what} is not finite{detail}"
            )
            return
        remedy = "lower the learning rate or check the data (or pass --on-nan skip to drop such steps)"
        if not self.ctx.cfg.saves_checkpoints:
            raise NonFiniteLossError(
                f"the training {what} is not finite at step {step + 1}{detail}; nothing was saved "
                f"(checkpoint_every is never); {remedy}, then train again",
                step=step + 1,
            )
        path = self._save_checkpoint(step)  # nothing was updated: the state after the step before
        self.persistence.saves.wait()
        raise NonFiniteLossError(
            f"the training {what} is not finite at step {step + 1}{detail}; the last good state (after step "
            f"{step}) is saved in {path}; {remedy}, then continue with --resume auto",
            step=step + 1,
            checkpoint=str(path),
        )

    def _nan_origin(self, step: int, status: StepStatus) -> str | None:
        """Where the non-finite value came from: the step's micro-batches replayed once with hooks (not
        under a pipeline, whose stages hold parts of the model); the first such line is kept."""
        strategy = self.model.strategy
        if strategy.dims.pp > 1:
            return None
        gradients = status is StepStatus.NONFINITE_GRADIENT
        origin = origin_line(
            strategy.module, self.task_loss, self.model.precision, step + 1, gradients, strategy.gather
        )
        progress = self.persistence.progress
        progress.nan_origin = progress.nan_origin or origin
        return origin

    def _log_point(self, done: int, window: LogWindow, outcome: StepOutcome) -> Spike | None:
        """Read the device-side metrics (the host sync of this window) and write them out; the
        window's first spike, if ``--on-spike`` finds one."""
        strategy, progress = self.model.strategy, self.persistence.progress
        reduce = strategy.all_reduce_sum if self.ctx.env.distributed else None
        losses = self.optimization.tracker.read(reduce)
        steps, seconds = window.close(done, self.observers.compiler.seconds)
        progress.train_seconds += seconds
        # No losses: every step since the last log point was dropped for a non-finite loss.
        train_loss = float("nan") if losses is None else losses.mean_loss
        if losses is not None:
            progress.final_train_loss = losses.last_step_loss
        speed = steps * self.data.split.global_batch_size / seconds
        metrics = {
            "train_loss": train_loss,
            "lr": self.optimization.learning_rate,
            "samples_per_second": speed,
        }
        if (epoch := self.data.schedule.epoch_of(done)) is not None:
            metrics["epoch"] = epoch
        if outcome.grad_norm is not None and outcome.stepped:
            metrics["grad_norm"] = float(outcome.grad_norm)
        loss_scale = self.model.precision.loss_scale()
        metrics.update(self.observers.health.metrics(done, steps, loss_scale, outcome.grad_underflow_share))
        for source, counts in self.data.mixture_counts(done, reduce).items():  # a mixture's, so far
            metrics.update({f"{source}_{what}": count for what, count in counts.items()})
        self.observers.logger.log(done, metrics)
        remaining = (self.data.schedule.total_steps - done) * self.data.split.global_batch_size / speed
        self.observers.logger.progress.update(done, train_loss, speed, remaining)
        self.observers.on_log(done, metrics)
        window.restart(done)
        return None if losses is None else self.recovery.judge(losses.step_losses)

    def _validate(self, done: int) -> float:
        """Validate, log the metrics and return the seconds it took."""
        started, observers = time.perf_counter(), self.observers
        batches, forwards, spare = self.data.validation_batches(observers.heartbeat)
        with observers.evaluated_weights():  # a callback may have other weights validated (--ema-validate)
            self.val_metrics = evaluate(
                self.model.strategy, self.ctx.task, batches, self.model.precision, forwards, spare
            )
            observers.logger.log(done, self.val_metrics)
            shown = ", ".join(f"{k} {v:.4f}" for k, v in self.val_metrics.items())
            observers.logger.message(f"validation at step {done}: {shown}")
            observers.on_log(done, self.val_metrics)  # on those weights: best.safetensors holds what scored
        return time.perf_counter() - started

    def _stop_requested(self, signals: StopSignals, done: int, checkpoint_due: bool) -> bool:
        """Whether a stop signal arrived; in a multi-process run, on any rank.

        One process checks after every step. Ranks must agree, which costs a collective,
        so they do at the steps that already synchronise: log points and checkpoints.
        """
        if not self.ctx.env.distributed:
            return signals.received is not None
        at_sync_point = checkpoint_due or done % self.ctx.cfg.log_every_n_steps == 0
        return at_sync_point and self.model.strategy.any_rank(signals.received is not None)

    def finish(self) -> FitResult:
        """Write the weights and summary.json (rank 0); return the result."""
        ctx = self.ctx
        self.model.write_weights(
            ctx.run_dir / "model.safetensors", ctx.env.is_main, ctx.run_dir / ADAPTER_FOLDER
        )
        breakdown = self.optimization.memory.known
        result = fit_result(
            ctx,
            self.steps_done,
            self.model,
            self.data,
            self.persistence,
            self.observers,
            self.recovery,
            breakdown,
            self.val_metrics,
        )
        if ctx.env.is_main:
            atomic_write_json(ctx.run_dir / "summary.json", result.summary())
        return result


def _where(ctx: RunContext) -> str:
    """The run folder, as the user named it (a URL, with the folder it is staged in)."""
    if ctx.mirror is None:
        return str(ctx.run_dir)
    return f"{ctx.mirror.url} (staged in {ctx.run_dir})"
