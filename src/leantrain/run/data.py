"""The data part: the run's schedule, the split of the global batch, and the loaders that follow it.

Built by ``builders.build_data`` once the step to start from is known (a resumed checkpoint's).
The position in the data is the step alone: the sampler derives every global batch from
(seed, epoch, step), so a checkpoint records the step and the numbers that must not change
under it (``checkpoint_state``); ``check_compatible`` compares them when resuming.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from leantrain.config import TrainConfig
from leantrain.data.build import TrainData, ValidationData, build_train_loader
from leantrain.data.loader import device_batches, move_to_device, stop_workers
from leantrain.data.sampler import steps_per_epoch
from leantrain.run.context import RunContext
from leantrain.run.watchdog import Heartbeat
from leantrain.step.batching import BatchSplit


@dataclass(frozen=True)
class Schedule:
    """How long the run is: optimizer steps per epoch (None for a stream of unknown length), in all."""

    steps_per_epoch: int | None
    total_steps: int

    @classmethod
    def of(cls, cfg: TrainConfig, dataset_size: int | None, split: BatchSplit) -> Schedule:
        per_epoch = None if dataset_size is None else steps_per_epoch(dataset_size, split)
        epoch_steps = cfg.epoch_limit and per_epoch and cfg.epoch_limit * per_epoch
        return cls(per_epoch, min(limit for limit in (cfg.max_steps, epoch_steps) if limit))

    def epoch_of(self, done: int) -> int | None:
        """The epoch the ``done``-th step belongs to (None for a stream of unknown length)."""
        return None if self.steps_per_epoch is None else (done - 1) // self.steps_per_epoch


class DataPart:
    def __init__(
        self,
        ctx: RunContext,
        train: TrainData,
        schedule: Schedule,
        split: BatchSplit,
        start_step: int,
        loaders: tuple[DataLoader, ValidationData | None],
        num_workers: int,
        pin_memory: bool,
        input_dtype: torch.dtype | None,
    ) -> None:
        self.ctx, self.train, self.schedule = ctx, train, schedule
        self.split = split  # changed only by ``restart`` (a halved micro-batch)
        self.start_step = start_step  # where this process began: 0, or the resumed checkpoint's step
        self.train_loader, self.validation = loaders
        self.num_workers = num_workers  # as resolved from auto / tune
        self.pin_memory = pin_memory
        self.input_dtype = input_dtype  # batches are cast to it on the way (true 16-bit precisions)

    def restart(self, split: BatchSplit, step: int) -> None:
        """The training batches from ``step`` on, cut as ``split`` says."""
        self.split = split
        self.train_loader, _, _ = build_train_loader(
            self.train,
            self.ctx.cfg,
            self.ctx.data_env,
            split,
            self.schedule.total_steps,
            step,
            self.pin_memory,
        )

    def batches(self, heartbeat: Heartbeat) -> Iterator[Any]:
        """The training micro-batches on the device, measured if the doctor asked."""
        instruments = self.ctx.instruments
        loader = instruments.loader(self.train_loader)
        batches = device_batches(loader, self.ctx.device, self.input_dtype)
        return heartbeat.counted(instruments.batches(batches))

    def validation_batches(self, heartbeat: Heartbeat) -> tuple[Iterator[Any], int | None, Callable[[], Any]]:
        """This process's validation batches on the device, the forwards every rank runs, and a spare
        batch for a rank without one (``evaluate``'s arguments: see ``step/evaluation.py``)."""
        assert self.validation is not None
        loader, forwards, spare = self.validation
        batches = heartbeat.counted(device_batches(loader, self.ctx.device, self.input_dtype))
        return batches, forwards, lambda: move_to_device(spare(), self.ctx.device, dtype=self.input_dtype)

    def validation_due(self, done: int) -> bool:
        """After the last step, and every val_every_n_steps steps."""
        if self.validation is None:
            return False
        every = self.ctx.cfg.val_every_n_steps
        return done == self.schedule.total_steps or bool(every and done % every == 0)

    def stop_workers(self) -> None:
        """Stop the data workers now, not when the collector finds them (see ``stop_workers``)."""
        stop_workers(self.train_loader)
        stop_workers(self.validation and self.validation.loader)

    def checkpoint_state(self, done: int) -> dict[str, Any]:
        return {
            "step": done,
            "dataset_size": self.train.size,
            "micro_batch_size": self.split.micro_batch_size,
            "accumulation_steps": self.split.accumulation_steps,
        }
