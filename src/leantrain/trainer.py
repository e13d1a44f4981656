"""``Trainer.fit``: the environment, the process group, the run (assembled in ``run/``), the summary."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from leantrain.cluster import ClusterEnv, detect
from leantrain.config import TrainConfig
from leantrain.errors import ConfigError, StorageError
from leantrain.extensions.trackers import check_trackers
from leantrain.run.context import RunContext
from leantrain.run.hooks import Callback, Instruments, NoInstruments, StepStats
from leantrain.run.loop import Run
from leantrain.run.mirror import open_mirror
from leantrain.run.preflight import check_machine
from leantrain.run.results import FitResult
from leantrain.run.watchdog import process_group_timeout
from leantrain.runtime import (
    allocator_cap_lifted_after,
    compute_threads_restored,
    deterministic_kernels,
    matmul_reduction,
    resolve_device,
    seed_everything,
)
from leantrain.stop_signals import StopSignals
from leantrain.strategies.process_group import init_process_group
from leantrain.strategies.registry import check_config
from leantrain.task import check_task

__all__ = ["Callback", "FitResult", "Instruments", "NoInstruments", "StepStats", "Trainer"]


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
        strategy = check_config(cfg, env.world_size)
        device = _process_device(strategy.input_device(cfg, resolve_device(cfg.device)), env)
        mirror = open_mirror(cfg.out_dir, cfg.staging_dir, env.is_main)  # None: out_dir is a folder
        run_dir = mirror.staging if mirror is not None else _run_dir(cfg.out_dir, name)
        check_machine(cfg, run_dir, env.local_world_size, mirror)
        check_trackers(cfg)
        created_group = init_process_group(env, device, process_group_timeout(cfg.hang_timeout))
        run = None
        try:
            with (
                deterministic_kernels(cfg.deterministic),
                matmul_reduction(cfg.reduced_precision_reduction),
                allocator_cap_lifted_after(device),
                compute_threads_restored(),
                StopSignals() as signals,  # from set-up to the summary: acted on at step boundaries
            ):
                seed_everything(cfg.seed)
                dims = strategy.dims(cfg, env.world_size)
                ctx = RunContext(cfg, task, env, device, run_dir, dims, self.instruments, started, mirror)
                run = Run(ctx, strategy, self.callbacks)
                try:
                    result = _train(run, signals)
                except StorageError as error:
                    raise StorageError(f"{error}; {run.persistence.recovery()}") from error
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


def _train(run: Run, signals: StopSignals) -> FitResult:
    try:
        run.train(signals)
    except BaseException:
        run.observers.logger.close_after_error()
        # The error's traceback holds the run in a reference cycle: left to the collector, each
        # data worker would cost a 5 s wait at some later moment (in the user's next cell).
        run.data.stop_workers()
        run.observers.end(None)
        with contextlib.suppress(StorageError):  # the error that ended the run is the one to report
            run.persistence.publish()
        raise
    run.observers.logger.close()
    result = run.finish()
    run.observers.end(result.summary())
    run.persistence.publish()  # a run folder at a URL: its last files
    return result


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


def _run_dir(out_dir: str | None, name: str) -> Path:
    """The run folder: ``out_dir``, else ``runs/<name>-<time>`` (created when the run starts writing)."""
    if out_dir is not None:
        return Path(out_dir)
    return Path("runs") / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
