"""Trainer.fit: builds the pieces of a run from the config, then runs a short loop.

Every piece is chosen once, before the loop: the device, the precision, the batch plan
and its accumulator, the sampler and loader, the logger, the checkpoint folder. The loop
itself makes no host synchronisation between log points: losses stay on the device
(``LossTracker``) and are read every ``log_every_n_steps`` steps.
"""

from __future__ import annotations

import gc
import signal
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn

from leantrain._version import __version__
from leantrain.batching import Accumulator, BatchPlan, StepOutcome, StepStatus
from leantrain.checkpoint import (
    CheckpointFolder,
    capture_rng,
    check_compatible,
    checkpoint_name,
    export_weights,
    load_checkpoint,
    load_into,
    restore_rng,
)
from leantrain.config import TrainConfig
from leantrain.data.loader import device_batches
from leantrain.data.pipeline import build_train_loader, build_val_loader, load_train_data
from leantrain.data.sampler import steps_per_epoch
from leantrain.errors import (
    CheckpointError,
    ConfigError,
    LeantrainError,
    NonFiniteLossError,
    RunInterrupted,
    TaskError,
)
from leantrain.files import atomic_write_json
from leantrain.log.metrics import LossTracker
from leantrain.log.precision_health import PrecisionHealth
from leantrain.log.run_logger import RunLogger
from leantrain.memory.accountant import MemoryBreakdown, SavedActivations, breakdown, parse_bytes
from leantrain.memory.adaptive import MicroBatchSizer, scale_learning_rates
from leantrain.memory.checkpointing import CheckpointPolicy, apply_activation_checkpointing
from leantrain.memory.plan import fewest_checkpointed_blocks
from leantrain.parallel.apply import (
    SingleProcess,
    build_device,
    init_process_group,
    parallelize,
    resolve_strategy,
    run_device,
)
from leantrain.parallel.dims import ParallelDims
from leantrain.parallel.env import ClusterEnv, detect
from leantrain.parallel.pipeline import example_inputs
from leantrain.precision import Precision, make_precision
from leantrain.runtime import (
    StopSignals,
    allocator_cap_lifted_after,
    derived_seed,
    deterministic_kernels,
    matmul_reduction,
    peak_memory_bytes,
    resolve_device,
    seed_everything,
)
from leantrain.task import check_task


class StepStats(NamedTuple):
    step: int  # optimizer steps completed (a skipped step counts: its batch was used)
    status: StepStatus  # STEPPED, or why the update was skipped
    grad_norm: torch.Tensor | None  # on the device: reading it is a host sync
    grad_underflow_share: torch.Tensor | None = None  # fp16 only, at log points

    @property
    def stepped(self) -> bool:
        return self.status is StepStatus.STEPPED


class Callback(Protocol):
    """Extension point: both methods are optional."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...


class Instruments(Protocol):
    """Measurement seam (``leantrain doctor``): wraps the run's pieces once, when they are built.

    Each method returns its argument or a wrapper with the same interface; the loop never
    asks whether it is measured. A plain run uses ``NoInstruments``, which wraps nothing.
    """

    def precision(self, precision: Precision) -> Precision: ...

    def parallel(self, plan: SingleProcess) -> SingleProcess: ...

    def loss(self, loss_fn: Any) -> Any: ...

    def loader(self, batches: Iterable[Any]) -> Iterable[Any]: ...

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]: ...


class NoInstruments:
    """Measures nothing: every piece is used as it is."""

    def precision(self, precision: Precision) -> Precision:
        return precision

    def parallel(self, plan: SingleProcess) -> SingleProcess:
        return plan

    def loss(self, loss_fn: Any) -> Any:
        return loss_fn

    def loader(self, batches: Iterable[Any]) -> Iterable[Any]:
        return batches

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        return batches


@dataclass
class FitResult:
    """What a run did; ``summary()`` is what ``summary.json`` holds."""

    steps: int
    samples: int
    final_train_loss: float
    samples_per_second: float
    wall_seconds: float
    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    precision: str
    strategy: str
    peak_memory_bytes: int
    global_batch_size: int
    device: str
    num_workers: int = 0  # the DataLoader workers used (as resolved from auto / tune)
    skipped_steps: int = 0  # steps without an update: fp16 overflows and, with on_nan=skip, non-finite ones
    nonfinite_steps: int = 0  # of those, the steps whose loss or gradient was NaN/inf
    params_bytes: int = 0  # parameters (and fp32 masters); see memory/accountant.py
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0  # saved for backward by one micro-batch, measured at the first step
    val_metrics: dict[str, float] = field(default_factory=dict)
    out_dir: Path | None = None
    model: nn.Module | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        # Not asdict(): it deep-copies every field, the model too (and FSDP models refuse).
        data = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("val_metrics", "out_dir", "model")
        }
        return {**data, **self.val_metrics, "out_dir": str(self.out_dir)}


class Trainer:
    """Trains a :class:`~leantrain.task.Task` as the :class:`TrainConfig` says."""

    def __init__(
        self,
        config: TrainConfig | None = None,
        callbacks: Sequence[Callback] = (),
        instruments: Instruments | None = None,
    ) -> None:
        self.config = config or TrainConfig()
        self.callbacks = list(callbacks)
        self.instruments = instruments or NoInstruments()

    def fit(self, task: Any, name: str | None = None) -> FitResult:
        """Train ``task``; ``name`` labels the default run folder (default: the task's class name).

        Raises :class:`RunInterrupted` after saving a checkpoint when SIGTERM or SIGUSR1 arrives.
        """
        started = time.perf_counter()
        cfg = self.config
        name = name or type(task).__name__
        check_task(task, name)
        env = detect()
        strategy = resolve_strategy(cfg.strategy, env)
        device = _process_device(run_device(strategy, resolve_device(cfg.device), cfg), env)
        run_dir = _prepare_run_dir(cfg.out_dir, name, cfg.resume)
        created_group = init_process_group(env, device)
        run = None
        try:
            with (
                deterministic_kernels(cfg.deterministic),
                matmul_reduction(cfg.reduced_precision_reduction),
                allocator_cap_lifted_after(device),
            ):
                seed_everything(cfg.seed)
                run = _Run(cfg, task, device, run_dir, env, strategy, started, self.instruments)
                try:
                    with StopSignals() as signals:
                        run.train(self.callbacks, signals)
                finally:
                    run.logger.close()
                result = run.finish()
            if created_group:
                # Rank 0 writes the outputs while the others are done: a rank that tears its
                # gloo connections down while a peer still uses them can abort at exit.
                # Only on success: after an error on one rank, a barrier would wait forever.
                dist.barrier()
            return result
        finally:
            if created_group:
                # DDP's wrapper sits in reference cycles; destroyed after its process group,
                # its reducer can abort the process at exit. Free it while the group exists.
                run = None
                gc.collect()
                dist.destroy_process_group()


class _Run:
    """The pieces of one run, built from the config before the loop starts."""

    def __init__(
        self,
        cfg: TrainConfig,
        task: Any,
        device: torch.device,
        run_dir: Path,
        env: ClusterEnv,
        strategy: str,
        started: float,
        instruments: Instruments,
    ) -> None:
        self.cfg, self.task, self.device, self.run_dir, self.env = cfg, task, device, run_dir, env
        self.started = started  # perf_counter() when fit() began
        self.instruments = instruments
        pipeline_stages = cfg.pipeline_stages if strategy == "pipeline" else None
        if pipeline_stages and callable(getattr(task, "augment", None)):
            # The first and the last stage each run the task's loss: they would augment differently.
            raise TaskError("task.augment is not supported under strategy pipeline yet")
        self.dims = ParallelDims.of(env.world_size, pipeline_stages)
        self.data_env = self.dims.data_env(env)  # the stages of one pipeline load the same samples
        self.plan = BatchPlan.from_config(cfg, world_size=self.dims.dp)
        self.model = _build_model(task, build_device(strategy, device))  # unwrapped: state dicts, weights
        self.precision = instruments.precision(make_precision(cfg.precision, device))
        # Before any wrapper: true 16-bit converts the model; the optimizer gets the fp32 masters.
        self.optimizer_params = optimizer_params = self.precision.prepare(self.model)
        self.memory: MemoryBreakdown | None = None
        self.checkpointed: list[str] = []
        self.notes: list[str] = []  # set-up decisions, for the run log
        self.checkpointing = checkpointing = cfg.activation_checkpointing  # resolved, when auto
        if checkpointing == "auto":
            budget = parse_bytes(cfg.memory_budget) or 0
            self.checkpointing = checkpointing = fewest_checkpointed_blocks(task, cfg, budget, env.world_size)
            self.notes.append(f"activation checkpointing auto: {checkpointing or 'none needed'}")
        if checkpointing is not None:
            self.checkpointed = apply_activation_checkpointing(
                self.model, CheckpointPolicy.parse(checkpointing)
            )
        self.strategy = strategy
        self.data = load_train_data(task, cfg, env)
        example = None
        if pipeline_stages and not isinstance(self.model, nn.Sequential):
            example = example_inputs(task, self.data.dataset, self.plan.micro_batch_size, device)
        self.parallel = instruments.parallel(
            parallelize(self.model, self.dims, cfg, strategy, device, example)
        )
        # What this process holds from now on: the model itself, or its pipeline stage (a traced
        # stage is a new module; dropping the whole model here frees the other stages).
        self.model = self.parallel.model
        if env.distributed:
            # Every rank drew the same initial weights above (DDP also broadcasts rank 0's).
            # From here on each rank draws its own numbers: dropout masks must differ by rank.
            seed_everything(derived_seed(cfg.seed, env.rank))
        self.optimizer_params = self.parallel.optimizer_params(optimizer_params)
        self.optimizer = task.optimizer(iter(self.optimizer_params))
        if cfg.lr_scaling != "none":  # before the scheduler, which records the base learning rates
            self.notes.append(scale_learning_rates(self.optimizer, cfg))
        scheduler_fn = getattr(task, "scheduler", None)
        self.scheduler = scheduler_fn(self.optimizer) if callable(scheduler_fn) else None
        self.tracker = LossTracker()
        self.val_metrics: dict[str, float] = {}
        # Carried across resumes: seconds in the training loop and in earlier processes of the run.
        self.progress = {
            "train_seconds": 0.0,
            "wall_seconds": 0.0,
            "final_train_loss": float("nan"),
            "skipped_steps": 0,
            "nonfinite_steps": 0,
        }

        self.dataset_size = self.data.size  # None for a stream without __len__
        self.steps_per_epoch = None if self.data.size is None else steps_per_epoch(self.data.size, self.plan)
        epoch_steps = cfg.epoch_limit and self.steps_per_epoch and cfg.epoch_limit * self.steps_per_epoch
        self.total_steps = min(limit for limit in (cfg.max_steps, epoch_steps) if limit)
        self.checkpoints = CheckpointFolder(run_dir / "checkpoints", cfg.keep_checkpoints)
        self.start_step = 0
        self._saved_rng: dict[str, Any] | None = None
        self._resume(cfg.resume)

        self.sizer = MicroBatchSizer(task, cfg, self.precision, self.model, device, env, self.checkpointing)
        if cfg.micro_batch_size == "auto":
            self.plan = self.plan.with_micro_batch(self.sizer.search(self.plan, self.data.dataset))
        self.notes += self.sizer.notes
        self.accumulator = self._make_accumulator()
        self.pin_memory = cfg.pin_memory if cfg.pin_memory is not None else device.type == "cuda"
        self.train_loader, self.num_workers, prefetch = build_train_loader(
            self.data, cfg, self.data_env, self.plan, self.total_steps, self.start_step, self.pin_memory
        )
        self.val_loader = build_val_loader(
            task, cfg, self.data_env, self.plan, self.num_workers, prefetch, self.pin_memory, self.data.notes
        )
        self.logger = RunLogger(
            run_dir, self.total_steps, cfg.progress, cfg.tensorboard, self.start_step, enabled=env.is_main
        )
        resumed = f", resumed after step {self.start_step}" if self.start_step else ""
        self.logger.message(
            f"training {self.total_steps} steps of {self.plan.global_batch_size} samples "
            f"(micro-batch {self.plan.micro_batch_size} x {self.plan.accumulation_steps} accumulation), "
            f"x {env.world_size} process(es), strategy {strategy}, precision {self.precision.name}, "
            f"on {device}, into {run_dir}{resumed}"
        )
        if self.checkpointed:
            shown = ", ".join(self.checkpointed[:4]) + (", ..." if len(self.checkpointed) > 4 else "")
            self.logger.message(f"activation checkpointing: {len(self.checkpointed)} blocks ({shown})")
        for note in self.notes + self.data.notes:
            self.logger.message(note)
        self.health = PrecisionHealth(self.progress, self.logger.warning)

    def _make_accumulator(self) -> Accumulator:
        agree_on_oom = self.sizer.agree_on_oom if self.sizer.adaptive else None
        return self.parallel.accumulator(self.plan, self.precision, self.cfg.max_grad_norm, agree_on_oom)

    def _shrink_micro_batch(self, step: int, reason: str) -> Any:
        """Halve the micro-batch (the global batch stays) and reload from ``step``; the new batches."""
        old = self.plan.micro_batch_size
        self.plan = self.plan.with_micro_batch(self.sizer.smaller(self.plan, step, reason))
        if self.env.distributed:
            # DDP's reducer expected the aborted step's backward; a fresh wrapper (every rank
            # makes one: they all agreed on the error) starts clean. The weights are equal on
            # every rank, so its broadcast of rank 0's changes nothing.
            # The old wrapper's reducer still hooks the parameters: it must be gone first.
            self.parallel = self.accumulator = None  # type: ignore[assignment]
            gc.collect()
            self.parallel = self.instruments.parallel(
                parallelize(self.model, self.dims, self.cfg, self.strategy, self.device)
            )
        self.accumulator = self._make_accumulator()
        self.train_loader, _, _ = build_train_loader(
            self.data, self.cfg, self.data_env, self.plan, self.total_steps, step, self.pin_memory
        )
        self.logger.warning(
            f"{reason} at step {step + 1}: micro-batch {old} -> {self.plan.micro_batch_size} "
            f"(x {self.plan.accumulation_steps} accumulation); the global batch and the optimisation stay"
        )
        return self._device_batches()

    def _device_batches(self) -> Iterator[Any]:
        loader = self.instruments.loader(self.train_loader)
        return self.instruments.batches(device_batches(loader, self.device, self.precision.input_dtype))

    def train(self, callbacks: Sequence[Callback], signals: StopSignals) -> None:
        cfg, optimizer = self.cfg, self.optimizer
        loss_fn = self.instruments.loss(self.sizer.enforce_budget(_with_augmentation(self.task)))
        batches = self._device_batches()
        self.parallel.module.train()
        if self._saved_rng is not None:
            restore_rng(self._saved_rng)  # last, after everything that draws random numbers at set-up
        step_hooks = [callback.on_step for callback in callbacks if hasattr(callback, "on_step")]
        # The first step's first micro-batch counts what autograd saves (see memory/accountant.py).
        saved = SavedActivations(self.model.parameters(), self.sizer.activation_limit)
        measured_loss = _measured_once(_with_augmentation(self.task), saved, loss_fn)
        window_started = time.perf_counter()
        window_first_step = self.start_step
        step = self.start_step
        while step < self.total_steps:
            done = step + 1
            log_due = done % cfg.log_every_n_steps == 0 or done == self.total_steps
            step_loss = measured_loss if self.memory is None else loss_fn
            # No local name for the wrapped model: a halving may replace it (see _shrink_micro_batch).
            outcome = self.accumulator.step(
                self.parallel.module, optimizer, step_loss, batches, step, self.tracker, log_due
            )
            if outcome.status is StepStatus.OUT_OF_MEMORY:
                batches = self._shrink_micro_batch(step, "out of memory")  # and the same step again
                measured_loss = _measured_once(_with_augmentation(self.task), saved, loss_fn)
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
            if cfg.val_every_n_steps and done % cfg.val_every_n_steps == 0 and done < self.total_steps:
                window_started += self._validate(done, callbacks)
            checkpoint_due = done == self.total_steps or bool(
                cfg.checkpoint_every and done % cfg.checkpoint_every == 0
            )
            stop = self._stop_requested(signals, done, checkpoint_due)
            if checkpoint_due or stop:
                path = self._save_checkpoint(done)
                if stop:
                    received = signals.received or signal.SIGTERM
                    raise RunInterrupted(received.name, int(received), done, str(path))
            step = done
        if self.val_loader is not None:
            self._validate(self.total_steps, callbacks)

    def _account_memory(self, activation_bytes: int) -> None:
        """Log what the memory is spent on, once, after the first step (the optimizer state exists)."""
        self.memory = breakdown(self.model, self.optimizer_params, self.optimizer, activation_bytes)
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
        path = self._save_checkpoint(step)  # nothing was updated: the state after the step before
        raise NonFiniteLossError(
            f"the training {what} is not finite at step {step + 1}; the last good state (after step "
            f"{step}) is saved in {path}; lower the learning rate or check the data, then continue "
            "with --resume auto (or pass --on-nan skip to drop such steps)",
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
        window = self.tracker.read(self.parallel.all_reduce_sum if self.env.distributed else None)
        seconds = max(time.perf_counter() - window_started, 1e-9)
        self.progress["train_seconds"] += seconds
        # No window: every step since the last log point was dropped for a non-finite loss.
        train_loss = float("nan") if window is None else window.mean_loss
        if window is not None:
            self.progress["final_train_loss"] = window.last_step_loss
        speed = window_steps * self.plan.global_batch_size / seconds
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
        remaining = (self.total_steps - done) * self.plan.global_batch_size / speed
        self.logger.progress.update(done, train_loss, speed, remaining)
        for callback in callbacks:
            if hasattr(callback, "on_log"):
                callback.on_log(done, metrics)

    def _validate(self, done: int, callbacks: Sequence[Any]) -> float:
        """Validate, log the metrics and return the seconds it took."""
        assert self.val_loader is not None
        started = time.perf_counter()
        reduce = self.parallel.all_reduce_sum if self.env.distributed else None
        self.val_metrics = self.parallel.evaluate(self.task, self.val_loader, self.precision, reduce)
        self.logger.log(done, self.val_metrics)
        self.logger.message(
            f"validation at step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in self.val_metrics.items())
        )
        for callback in callbacks:
            if hasattr(callback, "on_log"):
                callback.on_log(done, self.val_metrics)
        return time.perf_counter() - started

    def _stop_requested(self, signals: StopSignals, done: int, checkpoint_due: bool) -> bool:
        """Whether a stop signal arrived; in a multi-process run, on any rank.

        One process checks after every step. Ranks must agree, which costs a collective,
        so they do at the steps that already synchronise: log points and checkpoints.
        """
        if not self.env.distributed:
            return signals.received is not None
        at_sync_point = checkpoint_due or done % self.cfg.log_every_n_steps == 0
        return at_sync_point and self.parallel.any_rank(signals.received is not None)

    def _save_checkpoint(self, done: int) -> Path:
        """Everything the next step depends on, taken at this step boundary; rank 0 writes it."""
        rng = self.parallel.gather(capture_rng())  # each rank's generators: they differ by rank
        path = self.checkpoints.folder / checkpoint_name(done)
        shards = None
        if self.parallel.sharded:  # every rank writes its shards first; the file below comes last
            shards = self.checkpoints.shard_folder(done)
            self.parallel.save_sharded(shards, self.optimizer)
        if not self.env.is_main:
            return path
        state = {
            "step": done,
            "model": None if shards else self.model.state_dict(),
            "optimizer": None if shards else self.optimizer.state_dict(),
            "sharded": None if shards is None else shards.name,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "precision": self.precision.state_dict(),
            "rng": rng,
            "losses": self.tracker.state_dict(),
            "progress": {**self.progress, "wall_seconds": self._wall_seconds()},
            "config": self.cfg.to_dict(),
            "dataset_size": self.dataset_size,
            "micro_batch_size": self.plan.micro_batch_size,
            "accumulation_steps": self.plan.accumulation_steps,
            "world_size": self.env.world_size,
            "leantrain_version": __version__,
        }
        return self.checkpoints.save(done, state)

    def _resume(self, resume: str | None) -> None:
        """Load the checkpoint that ``resume`` names, if any, into the run's pieces."""
        if resume is None:
            return
        if resume == "auto":
            found = self.checkpoints.newest_valid(warn=lambda text: print(f"leantrain: {text}"))
            if found is None:
                return  # nothing saved yet: start fresh
            path, state = found
        else:
            path = Path(resume)
            state = load_checkpoint(path)
        check_compatible(state, path, self.cfg.to_dict(), self.dataset_size)
        if bool(state.get("sharded")) != self.parallel.sharded:
            saved_as = "in parts" if state.get("sharded") else "whole"
            saved_as += f" (strategy {state['config'].get('strategy')})"
            raise CheckpointError(
                f"checkpoint {path} holds its model {saved_as}, unlike this run (strategy "
                f"{self.parallel.strategy}); resume it with the strategy it was saved with"
            )
        if self.parallel.sharded:
            self.parallel.load_sharded(path.parent / state["sharded"], self.optimizer, path)
        else:
            load_into(self.model, state["model"], "model", path)
            load_into(self.optimizer, state["optimizer"], "optimizer", path)
        if (state["scheduler"] is None) != (self.scheduler is None):
            has = "has" if state["scheduler"] is not None else "has no"
            raise CheckpointError(f"checkpoint {path} {has} scheduler state, unlike this task")
        if self.scheduler is not None:
            load_into(self.scheduler, state["scheduler"], "scheduler", path)
        load_into(self.precision, state["precision"], "precision", path)
        self.tracker.load_state_dict(state["losses"], self.device)
        self.progress.update(state["progress"])
        self.start_step = min(state["step"], self.total_steps)
        self._saved_rng = _rng_of_rank(state, self.env, path)

    def _wall_seconds(self) -> float:
        return self.progress["wall_seconds"] + time.perf_counter() - self.started

    def finish(self) -> FitResult:
        """Write the weights and summary.json (rank 0); return the result."""
        weights = self.parallel.trained_weights(self.precision)  # sharded: gathered, a collective
        if self.env.is_main:
            export_weights(weights, self.run_dir / "model.safetensors")
        samples = self.total_steps * self.plan.global_batch_size
        result = FitResult(
            steps=self.total_steps,
            samples=samples,
            final_train_loss=self.progress["final_train_loss"],
            samples_per_second=samples / max(self.progress["train_seconds"], 1e-9),
            wall_seconds=self._wall_seconds(),
            micro_batch_size=self.plan.micro_batch_size,
            accumulation_steps=self.plan.accumulation_steps,
            world_size=self.env.world_size,
            precision=self.precision.name,
            strategy=self.parallel.strategy,
            peak_memory_bytes=peak_memory_bytes(self.device),
            global_batch_size=self.plan.global_batch_size,
            device=str(self.device),
            num_workers=self.num_workers,
            skipped_steps=int(self.progress["skipped_steps"]),
            nonfinite_steps=int(self.progress["nonfinite_steps"]),
            **(self.memory.as_dict() if self.memory is not None else {}),
            val_metrics=dict(self.val_metrics),
            out_dir=self.run_dir,
            model=self.model,
        )
        if self.env.is_main:
            atomic_write_json(self.run_dir / "summary.json", result.summary())
        return result


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


def _with_augmentation(task: Any) -> Any:
    """The task's loss, applied to ``task.augment(batch)`` when the task has ``augment``."""
    augment = getattr(task, "augment", None)
    if not callable(augment):
        return task.loss
    loss = task.loss

    def augmented_loss(model: nn.Module, batch: Any) -> Any:
        return loss(model, augment(batch))

    return augmented_loss


def _process_device(device: torch.device, env: ClusterEnv) -> torch.device:
    """The CUDA device this process drives, with its index: the local rank's GPU in a multi-process
    run, else the current one (``torch.cuda.set_device`` refuses a bare ``cuda``)."""
    if device.type != "cuda":
        return device
    if device.index is None and env.distributed:
        if env.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                "device", str(device), f"{env.local_world_size} processes on this node but "
                f"{torch.cuda.device_count()} CUDA device(s): start at most one process per GPU, "
                "or use --device cpu (gloo)",
            )  # fmt: skip
        device = torch.device("cuda", env.local_rank)
    elif device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def _rng_of_rank(state: dict[str, Any], env: ClusterEnv, path: Path) -> dict[str, Any]:
    """This rank's saved generator states; exact resume needs the same world size."""
    saved = state["rng"]
    if len(saved) != env.world_size:
        raise CheckpointError(
            f"checkpoint {path} was saved by {len(saved)} process(es) but this run has {env.world_size}; "
            "resume with the same number of processes"
        )
    return saved[env.rank]


def _build_model(task: Any, device: torch.device) -> nn.Module:
    model = task.model()
    if not isinstance(model, nn.Module):
        raise TaskError(f"task.model() must return a torch.nn.Module, got {type(model).__name__}")
    return model.to(device)


def _prepare_run_dir(out_dir: str | None, name: str, resume: str | None) -> Path:
    """The run folder (created when the run starts writing).

    Without ``resume``, a folder that already holds a run is refused, so nothing is overwritten.
    """
    if out_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{name}-{stamp}"
    else:
        path = Path(out_dir)
    if path.is_file():
        raise LeantrainError(f"out_dir {path} is a file, not a folder")
    if resume is None:
        for marker in ("metrics.csv", "summary.json", "checkpoints"):
            if (path / marker).exists():
                raise LeantrainError(
                    f"out_dir {path} already holds a run ({marker}); continue it with --resume auto "
                    "or choose another out_dir"
                )
    return path
