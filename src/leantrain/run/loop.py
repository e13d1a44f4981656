"""A run: its pieces assembled from the builders, the loop, and the summary at the end.

The loop makes no host synchronisation between log points: losses stay on the device
(``LossTracker``) and are read every ``log_every_n_steps`` steps. It never asks which strategy
it has: the accumulator runs each step through the strategy.
"""

from __future__ import annotations

import gc
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leantrain.checkpoint import CheckpointFolder, export_weights, restore_rng, tied_aliases
from leantrain.cluster import ClusterEnv
from leantrain.config import TrainConfig
from leantrain.data.build import build_train_loader, build_val_loader, load_train_data
from leantrain.data.loader import device_batches, stop_workers
from leantrain.data.workers import cpus_per_process
from leantrain.errors import CheckpointError, NonFiniteLossError, RunInterrupted
from leantrain.files import atomic_write_json
from leantrain.log.precision_health import PrecisionHealth
from leantrain.log.run_logger import RunLogger
from leantrain.memory.accountant import MemoryBreakdown, SavedActivations, breakdown
from leantrain.memory.adaptive import MicroBatchSizer
from leantrain.run.background_save import BackgroundSaves
from leantrain.run.builders import (
    build_model,
    build_optimization,
    build_strategy,
    example_of,
    pin_memory,
    schedule_length,
)
from leantrain.run.hooks import Callback, Instruments, StepStats, state_key
from leantrain.run.results import FitResult
from leantrain.run.state import RunState
from leantrain.run.watchdog import Heartbeat, Watchdog
from leantrain.run.watchers import built_in_callbacks
from leantrain.runtime import (
    StopSignals,
    derived_seed,
    leave_cpus_to_workers,
    peak_memory_bytes,
    seed_everything,
)
from leantrain.step.accumulator import Accumulator, StepOutcome, StepStatus, TaskLoss
from leantrain.step.batch_norm import batch_norm_layers, split_statistics_warning
from leantrain.step.batching import BatchSplit
from leantrain.step.compilation import CompileWatch
from leantrain.step.evaluation import evaluate
from leantrain.step.losses import LossTracker
from leantrain.strategies.base import Strategy
from leantrain.strategies.process_group import group_store


class Run(RunState):
    """The pieces of one run, built from the config before the loop starts."""

    def __init__(
        self,
        cfg: TrainConfig,
        task: Any,
        device: torch.device,
        run_dir: Path,
        env: ClusterEnv,
        strategy: type[Strategy],
        started: float,
        instruments: Instruments,
    ) -> None:
        self.cfg, self.task, self.device, self.run_dir, self.env = cfg, task, device, run_dir, env
        self.started = started  # perf_counter() when fit() began
        self.instruments = instruments
        strategy.check_task(task)
        self.dims = strategy.dims(cfg, env.world_size)
        self.data_env = self.dims.data_env(env)  # the stages of one pipeline load the same samples
        self.split = BatchSplit.from_config(cfg, world_size=self.dims.dp)
        parts = build_model(task, cfg, strategy, device, env.world_size, instruments)
        self.precision, self.recomputed = parts.precision, parts.recomputed
        self.data = load_train_data(task, cfg, env)
        example = example_of(task, self.data.dataset, self.split, device)
        self.strategy = build_strategy(strategy, cfg, device, self.dims, parts.model, example, instruments)
        self.model = self.strategy.model  # what this process holds: the model, or its pipeline stage
        if env.distributed:
            # Every rank drew the same initial weights above (DDP also broadcasts rank 0's).
            # From here on each rank draws its own numbers: dropout masks must differ by rank.
            seed_everything(derived_seed(cfg.seed, env.rank))
        optimization = build_optimization(task, cfg, self.strategy, parts.prepared)
        self.optimizer_params, self.optimizer = optimization.params, optimization.optimizer
        self.scheduler = optimization.scheduler
        self.tracker = LossTracker()
        self.memory: MemoryBreakdown | None = None
        self.val_metrics: dict[str, float] = {}
        # Carried across resumes: seconds in the training loop and in earlier processes of the run.
        self.progress = {
            "train_seconds": 0.0,
            "wall_seconds": 0.0,
            "final_train_loss": float("nan"),
            "skipped_steps": 0,
            "nonfinite_steps": 0,
            "checkpoint_blocked_seconds": 0.0,  # in earlier processes of the run
            "compile_seconds": 0.0,  # in earlier processes of the run
        }
        self.saves = BackgroundSaves(cfg.async_checkpoint)
        self.dataset_size = self.data.size  # None for a stream without __len__
        self.steps_per_epoch, self.total_steps = schedule_length(cfg, self.data.size, self.split)
        self.checkpoints = CheckpointFolder(run_dir / "checkpoints", cfg.keep_checkpoints)
        self.start_step = 0
        self.steps_done = 0  # the step training ended at: total_steps, or where it stopped early
        self.saved_rng: dict[str, Any] | None = None
        self.saved_callbacks: dict[str, Any] = {}
        self.callbacks_in_shards: list[str] = []
        self.resumed_shards: Path | None = None
        self.resume_notes: list[str] = []
        self.callbacks: Sequence[Any] = ()
        self.resume_from(cfg.resume)

        self.sizer = MicroBatchSizer(task, cfg, self.precision, self.model, device, env, parts.recompute)
        if cfg.micro_batch_size == "auto":
            self.split = self.split.with_micro_batch(self.sizer.search(self.split, self.data.dataset))
        self.accumulator = self._accumulator()
        self.pin_memory = pin_memory(cfg, device)
        self.train_loader, self.num_workers, prefetch = build_train_loader(
            self.data, cfg, self.data_env, self.split, self.total_steps, self.start_step, self.pin_memory
        )
        self.val_loader = build_val_loader(
            task, cfg, self.data_env, self.split, self.num_workers, prefetch, self.pin_memory, self.data.notes
        )
        if device.type == "cpu":  # the workers and the step's compute share this node's CPUs
            threads = leave_cpus_to_workers(self.num_workers, cpus_per_process(env.local_world_size))
            self.data.notes += [threads] if threads else []
        tensorboard = "tensorboard" in cfg.loggers
        self.logger = RunLogger(
            run_dir, self.total_steps, cfg.progress, tensorboard, self.start_step, enabled=env.is_main
        )
        self._log_setup(
            parts.notes
            + self.strategy.notes
            + optimization.notes
            + self.sizer.notes
            + self.data.notes
            + self.resume_notes
        )
        self.built_ins = built_in_callbacks(
            cfg,
            validates=self.val_loader is not None,
            is_main=env.is_main,
            run_dir=run_dir,
            checkpoints=self.checkpoints,
            write_weights=self.write_weights,
            warn=self.logger.warning,
            model=self.model,
            optimizer_params=self.optimizer_params,
            precision=self.precision,
        )
        self.health = PrecisionHealth(self.progress, self.logger.warning)
        self.heartbeat = Heartbeat()  # marked as the loop moves on; the watchdog reads it
        self.compiler = CompileWatch(cfg.compile != "none", lambda event: self.logger.message(event.line()))
        self.compile_seconds_counted = 0.0  # of compiler.seconds, those already taken out of a window
        self.watchdog = Watchdog(
            cfg.hang_timeout, self.heartbeat, run_dir, env.rank, env.world_size, group_store(), _say_error,
            paused=lambda: self.compiler.compiling,
        )  # fmt: skip
        self.batch_norms = batch_norm_layers(parts.model)
        self._warn_about_batch_norm()

    def _log_setup(self, notes: list[str]) -> None:
        resumed = f", resumed after step {self.start_step}" if self.start_step else ""
        self.logger.message(
            f"training {self.total_steps} steps of {self.split.global_batch_size} samples "
            f"(micro-batch {self.split.micro_batch_size} x {self.split.accumulation_steps} accumulation), "
            f"x {self.env.world_size} process(es), strategy {self.strategy.name}, precision "
            f"{self.precision.name}, on {self.device}, into {self.run_dir}{resumed}"
        )
        if self.recomputed:
            shown = ", ".join(self.recomputed[:4]) + (", ..." if len(self.recomputed) > 4 else "")
            self.logger.message(f"activation checkpointing: {len(self.recomputed)} blocks ({shown})")
        for note in notes:
            self.logger.message(note)

    def _warn_about_batch_norm(self) -> None:
        """Once per split: BatchNorm layers whose statistics follow it (see ``step/batch_norm.py``)."""
        can_sync = self.strategy.can_sync_batch_norm(self.device)
        text = split_statistics_warning(self.batch_norms, self.split, can_sync)
        if text is not None:
            self.logger.warning(text)

    def _accumulator(self) -> Accumulator:
        agree_on_oom = self.sizer.agree_on_oom if self.sizer.adaptive else None
        params = list(self.model.parameters())  # those whose gradients backward fills
        return Accumulator(
            self.split, self.precision, self.strategy, params, self.cfg.max_grad_norm, agree_on_oom
        )

    def _shrink_micro_batch(self, step: int, reason: str) -> Any:
        """Halve the micro-batch (the global batch stays) and reload from ``step``; the new batches."""
        old = self.split.micro_batch_size
        self.split = self.split.with_micro_batch(self.sizer.smaller(self.split, step, reason))
        # The abandoned step's tensors can sit in reference cycles (its traceback's frames, the
        # user's own objects): free them before the retry, or they count against the budget.
        gc.collect()
        self.strategy.reset_after_out_of_memory()
        self.accumulator = self._accumulator()
        self.train_loader, _, _ = build_train_loader(
            self.data, self.cfg, self.data_env, self.split, self.total_steps, step, self.pin_memory
        )
        self.logger.warning(
            f"{reason} at step {step + 1}: micro-batch {old} -> {self.split.micro_batch_size} "
            f"(x {self.split.accumulation_steps} accumulation); the global batch and the optimisation stay"
        )
        self._warn_about_batch_norm()
        return self._device_batches()

    def _device_batches(self) -> Iterator[Any]:
        loader = self.instruments.loader(self.train_loader)
        batches = device_batches(loader, self.device, self.precision.input_dtype)
        return self.heartbeat.counted(self.instruments.batches(batches))

    def stop_workers(self) -> None:
        """Stop the data workers now, not when the collector finds them (see ``stop_workers``)."""
        stop_workers(self.train_loader)
        stop_workers(self.val_loader)

    def train(self, callbacks: Sequence[Callback], signals: StopSignals) -> None:
        with self.watchdog.watching(), self.compiler.watching():
            try:
                self._train(callbacks, signals)
            except BaseException:
                self._wait_for_saves_after_error()
                raise
            self.saves.wait()  # the final checkpoint is complete before fit returns

    def _wait_for_saves_after_error(self) -> None:
        """A save in flight completes (it is the newest state to resume from); its own failure is
        a warning, so that the error that ended the run is the one raised."""
        try:
            self.saves.wait()
        except Exception as error:
            self.logger.warning(f"the checkpoint being written when the run ended failed too: {error}")

    def _train(self, callbacks: Sequence[Callback], signals: StopSignals) -> None:
        callbacks = self._start_callbacks(callbacks)
        if (early := _stop_reason(callbacks)) is not None:  # a resume of a run that stopped early
            self.logger.message(f"{early}; the checkpoint is where it ended: nothing more to train")
            self.steps_done = self.start_step
            return
        cfg, optimizer = self.cfg, self.optimizer
        task_loss = TaskLoss(self.task)
        loss_fn = self.heartbeat.after(self.instruments.loss(self.sizer.enforce_budget(task_loss)))
        batches = self._device_batches()
        self.strategy.module.train()
        if self.saved_rng is not None:
            restore_rng(self.saved_rng)  # last, after everything that draws random numbers at set-up
        step_hooks = [callback.on_step for callback in callbacks if hasattr(callback, "on_step")]
        # The first step's first micro-batch counts what autograd saves (see memory/accountant.py).
        saved = SavedActivations(self.model.parameters(), self.sizer.activation_limit)
        measured_loss = _measured_once(task_loss, saved, loss_fn)
        window_started = time.perf_counter()
        window_first_step = self.start_step
        step = self.start_step
        while step < self.total_steps:
            done = step + 1
            log_due = done % cfg.log_every_n_steps == 0 or done == self.total_steps
            step_loss = measured_loss if self.memory is None else loss_fn
            task_loss.start_step(done, self.split.accumulation_steps)
            outcome = self.accumulator.step(optimizer, step_loss, batches, step, self.tracker, log_due)
            if outcome.status is StepStatus.OUT_OF_MEMORY:
                batches = self._shrink_micro_batch(step, "out of memory")  # and the same step again
                measured_loss = _measured_once(task_loss, saved, loss_fn)
                continue
            if self.memory is None:
                self._account_memory(saved.bytes)
            if self.sizer.allocator_struggles():
                batches = self._shrink_micro_batch(
                    done, "the CUDA allocator retried in several steps in a row"
                )
            if not outcome.stepped:
                self._skipped(step, outcome.status)
            elif self.scheduler is not None:
                self.scheduler.step()
            for hook in step_hooks:
                hook(StepStats(done, *outcome))
            if log_due:
                self._log_point(done, done - window_first_step, window_started, outcome, callbacks)
                window_first_step, window_started = done, time.perf_counter()
            val_due = self._validation_due(done)
            if val_due:
                window_started += self._validate(done, callbacks)
            # Callbacks speak only after a log point or a validation: nothing to ask otherwise.
            early = _stop_reason(callbacks) if log_due or val_due else None
            asked = val_due and any(getattr(c, "checkpoint_at", None) == done for c in callbacks)
            checkpoint_due = cfg.checkpoint_due(done, self.total_steps) or asked or early is not None
            stop = self._stop_requested(signals, done, checkpoint_due)
            if checkpoint_due or stop:
                path = self.save_checkpoint(done) if cfg.saves_checkpoints else None
                if stop:
                    self.saves.wait()  # the message names a complete checkpoint
                    received = signals.received or signal.SIGTERM
                    raise RunInterrupted(received.name, int(received), done, path and str(path))
            step = done
            self.heartbeat.step = step
            self.heartbeat.beat()  # the step, and its checkpoint, are done
            if early is not None:
                self.logger.message(early)
                break
        self.steps_done = step
        if self.val_loader is not None and self.start_step == self.total_steps:
            self._validate(self.total_steps, callbacks)  # resumed after the last step: not validated yet

    def _start_callbacks(self, user_callbacks: Sequence[Callback]) -> list[Any]:
        """The built-in callbacks, then the user's, with the state a resumed checkpoint saved for them."""
        callbacks = [*self.built_ins, *user_callbacks]
        self.callbacks = callbacks  # their state goes into every checkpoint
        if not self.start_step:
            return callbacks
        for callback in (c for c in callbacks if hasattr(c, "load_state_dict")):
            key = state_key(callback)
            saved = self.saved_callbacks.get(key)
            if saved is None:  # under a sharded strategy, each process reads its own part
                saved = self.load_callback_shards(key, callback.state_dict())
            if saved is None:
                self.logger.warning(
                    f"the checkpoint holds no state of callback {key}: it starts afresh at step "
                    f"{self.start_step}"
                )
                continue
            try:
                callback.load_state_dict(saved)
            except (KeyError, ValueError, TypeError) as error:
                raise CheckpointError(
                    f"the checkpoint's state of callback {key} does not load: {error}"
                ) from None
        return callbacks

    def _validation_due(self, done: int) -> bool:
        """After the last step, and every val_every_n_steps steps."""
        if self.val_loader is None:
            return False
        every = self.cfg.val_every_n_steps
        return done == self.total_steps or bool(every and done % every == 0)

    def _account_memory(self, activation_bytes: int) -> None:
        """Log what the memory is spent on, once, after the first step (the optimizer state exists)."""
        averaged = self.cfg.ema_decay is not None
        self.memory = breakdown(self.model, self.optimizer_params, self.optimizer, activation_bytes, averaged)
        self.logger.message(self.memory.describe())

    def _skipped(self, step: int, status: StepStatus) -> None:
        """Count a step that made no update; apply the NaN policy to a non-finite one."""
        self.health.count_skip(step, status)
        if status is StepStatus.OVERFLOW:
            return  # routine for fp16: the scale was lowered
        self.tracker.discard_step(step)  # non-finite values never reach the log
        what = "loss" if status is StepStatus.NONFINITE_LOSS else "gradient norm"
        if self.cfg.on_nan == "skip":
            self.logger.warning(f"step {step + 1} skipped: the training {what} is not finite")
            return
        remedy = "lower the learning rate or check the data (or pass --on-nan skip to drop such steps)"
        if not self.cfg.saves_checkpoints:
            raise NonFiniteLossError(
                f"the training {what} is not finite at step {step + 1}; nothing was saved "
                f"(checkpoint_every is never); {remedy}, then train again",
                step=step + 1,
            )
        path = self.save_checkpoint(step)  # nothing was updated: the state after the step before
        self.saves.wait()
        raise NonFiniteLossError(
            f"the training {what} is not finite at step {step + 1}; the last good state (after step "
            f"{step}) is saved in {path}; {remedy}, then continue with --resume auto",
            step=step + 1,
            checkpoint=str(path),
        )

    def _log_point(
        self,
        done: int,
        window_steps: int,
        window_started: float,
        outcome: StepOutcome,
        callbacks: Sequence[Any],
    ) -> None:
        """Read the device-side metrics (the host sync of this window) and write them out."""
        window = self.tracker.read(self.strategy.all_reduce_sum if self.env.distributed else None)
        compiling = self.compiler.seconds - self.compile_seconds_counted  # not training: left out
        self.compile_seconds_counted = self.compiler.seconds
        seconds = max(time.perf_counter() - window_started - compiling, 1e-9)
        self.progress["train_seconds"] += seconds
        # No window: every step since the last log point was dropped for a non-finite loss.
        train_loss = float("nan") if window is None else window.mean_loss
        if window is not None:
            self.progress["final_train_loss"] = window.last_step_loss
        speed = window_steps * self.split.global_batch_size / seconds
        metrics = {
            "train_loss": train_loss,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "samples_per_second": speed,
        }
        if self.steps_per_epoch is not None:
            metrics["epoch"] = (done - 1) // self.steps_per_epoch
        if outcome.grad_norm is not None and outcome.stepped:
            metrics["grad_norm"] = float(outcome.grad_norm)
        metrics.update(
            self.health.metrics(done, window_steps, self.precision.loss_scale(), outcome.grad_underflow_share)
        )
        self.logger.log(done, metrics)
        remaining = (self.total_steps - done) * self.split.global_batch_size / speed
        self.logger.progress.update(done, train_loss, speed, remaining)
        for callback in callbacks:
            if hasattr(callback, "on_log"):
                callback.on_log(done, metrics)

    def _validate(self, done: int, callbacks: Sequence[Any]) -> float:
        """Validate, log the metrics and return the seconds it took."""
        assert self.val_loader is not None
        started = time.perf_counter()
        batches = self.heartbeat.counted(
            device_batches(self.val_loader, self.device, self.precision.input_dtype)
        )
        with ExitStack() as weights:  # a callback may have other weights validated (--ema-validate)
            for callback in (c for c in callbacks if hasattr(c, "evaluated_weights")):
                weights.enter_context(callback.evaluated_weights())
            self.val_metrics = evaluate(self.strategy, self.task, batches, self.precision)
            self.logger.log(done, self.val_metrics)
            self.logger.message(
                f"validation at step {done}: "
                + ", ".join(f"{k} {v:.4f}" for k, v in self.val_metrics.items())
            )
            for callback in callbacks:  # still on those weights: best.safetensors holds what scored
                if hasattr(callback, "on_log"):
                    callback.on_log(done, self.val_metrics)
        self.compile_seconds_counted = self.compiler.seconds  # compiled for evaluation: left out already
        return time.perf_counter() - started

    def _stop_requested(self, signals: StopSignals, done: int, checkpoint_due: bool) -> bool:
        """Whether a stop signal arrived; in a multi-process run, on any rank.

        One process checks after every step. Ranks must agree, which costs a collective,
        so they do at the steps that already synchronise: log points and checkpoints.
        """
        if not self.env.distributed:
            return signals.received is not None
        at_sync_point = checkpoint_due or done % self.cfg.log_every_n_steps == 0
        return at_sync_point and self.strategy.any_rank(signals.received is not None)

    def _wall_seconds(self) -> float:
        return self.progress["wall_seconds"] + time.perf_counter() - self.started

    def write_weights(self, name: str) -> None:
        """The trained weights as ``name`` in the run folder (call on every rank: sharded, a collective)."""
        weights = self.strategy.trained_weights(self.precision)
        if self.env.is_main:
            export_weights(weights, self.run_dir / name, tied_aliases(self.model))

    def finish(self) -> FitResult:
        """Write the weights and summary.json (rank 0); return the result."""
        self.write_weights("model.safetensors")
        samples = self.steps_done * self.split.global_batch_size
        result = FitResult(
            steps=self.steps_done,
            samples=samples,
            final_train_loss=self.progress["final_train_loss"],
            samples_per_second=samples / max(self.progress["train_seconds"], 1e-9),
            wall_seconds=self._wall_seconds(),
            micro_batch_size=self.split.micro_batch_size,
            accumulation_steps=self.split.accumulation_steps,
            world_size=self.env.world_size,
            precision=self.precision.name,
            strategy=self.strategy.name,
            peak_memory_bytes=peak_memory_bytes(self.device),
            global_batch_size=self.split.global_batch_size,
            device=str(self.device),
            num_workers=self.num_workers,
            compute_threads=torch.get_num_threads(),
            skipped_steps=int(self.progress["skipped_steps"]),
            nonfinite_steps=int(self.progress["nonfinite_steps"]),
            stopped_early=self.steps_done < self.total_steps,  # the only way to end short of it
            checkpoint_blocked_seconds=self.checkpoint_blocked_seconds(),
            compile_seconds=self.compile_seconds(),
            compiler_events=self.compiler.events,
            **(self.memory.as_dict() if self.memory is not None else {}),
            val_metrics=dict(self.val_metrics),
            out_dir=self.run_dir,
            model=self.model,
        )
        if self.env.is_main:
            atomic_write_json(self.run_dir / "summary.json", result.summary())
        return result


def _say_error(line: str) -> None:
    """A one-line error on stderr, flushed: the watchdog ends the process right after it."""
    print(f"leantrain: error: {line}", file=sys.stderr, flush=True)


def _stop_reason(callbacks: Sequence[Any]) -> str | None:
    """The first callback's request to end the run (early stopping), if any."""
    return next((reason for c in callbacks if (reason := getattr(c, "stop_reason", None))), None)


def _measured_once(loss_fn: Any, saved: SavedActivations, later: Any) -> Any:
    """First ``loss_fn`` with ``saved`` counting (and limiting) what it saves; ``later`` on later calls."""
    calls = 0

    def measured(model: nn.Module, batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            return later(model, batch)
        with saved:
            return loss_fn(model, batch)

    return measured
