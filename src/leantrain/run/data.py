"""The data part: the run's schedule, the split of the global batch, and the loaders that follow it.

Built by ``builders.build_data`` once the step to start from is known (a resumed checkpoint's).
The position in map-style data is the step alone: the sampler derives every global batch from
(seed, epoch, step), so a checkpoint records the step and the numbers that must not change
under it (``checkpoint_state``); ``check_compatible`` compares them when resuming. A stream's
position (and a mixture's tokens per source) is read by the loader's processes and kept by
the main process (``data/shard.py``): the checkpoint holds it too, as ``data_position``.
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
from leantrain.data.mixture import Mixture
from leantrain.data.sampler import GlobalBatchSampler, steps_per_epoch
from leantrain.data.shard import DataPosition
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
        """The training batches from ``step`` on, cut as ``split`` says (streams from where they are)."""
        self.split = split
        position = self._position()
        saved = None if position is None else self._position_state(position, step, position.tokens(step))
        self.train_loader, _, _ = build_train_loader(
            self.train,
            self.ctx.cfg,
            self.ctx.data_env,
            split,
            self.schedule.total_steps,
            step,
            self.pin_memory,
            saved,
            None if saved is None else saved["tokens"],
        )

    def global_batch_indices(self, after: int, through: int) -> list[int] | None:
        """The sample indices of steps ``after + 1 .. through`` (1-based; None for a stream, whose
        positions are the steps' global batches in the stream's order)."""
        if self.train.size is None or self.train.is_stream:
            return None
        order = GlobalBatchSampler(
            self.train.size, self.split, self.schedule.total_steps, seed=self.ctx.cfg.seed,
            shuffle=self.ctx.cfg.shuffle,
        )  # fmt: skip
        return [index for step in range(after, through) for index in order.global_batch(step)]

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

    def _position(self) -> DataPosition | None:
        """Where the streams and a mixture's sources are (None for map-style data: the step says it)."""
        return getattr(self.train_loader, "position", None)

    @staticmethod
    def _position_state(position: DataPosition, done: int, tokens: list[int]) -> dict[str, Any]:
        return {"step": done, "sources": position.names, "positions": position.after(done), "tokens": tokens}

    def rank_state(self, done: int) -> dict[str, Any]:
        """This process's part of the data position: the tokens of its micro-batches (gathered)."""
        position = self._position()
        return {} if position is None else {"data_tokens": position.tokens(done)}

    def checkpoint_state(self, done: int, per_rank: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The data position after ``done`` steps; ``per_rank``: every rank's ``rank_state``."""
        state: dict[str, Any] = {
            "step": done,
            "dataset_size": self.train.size,
            "micro_batch_size": self.split.micro_batch_size,
            "accumulation_steps": self.split.accumulation_steps,
        }
        if (position := self._position()) is not None:
            ranks = [rank["data_tokens"] for rank in per_rank or [self.rank_state(done)]]
            tokens = [sum(counts) for counts in zip(*ranks, strict=True)]
            state["data_position"] = self._position_state(position, done, tokens)
        return state

    def mixture_counts(self, done: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> dict[str, dict[str, int]]:  # fmt: skip
        """A mixture's samples and tokens per source in steps ``0..done-1`` (``reduce``: the sum over
        ranks, a collective every rank calls); empty for other data."""
        if not isinstance(self.train.dataset, Mixture):
            return {}
        position = self._position()
        assert position is not None
        tokens = torch.tensor(position.tokens(done), dtype=torch.int64, device=self.ctx.device)
        totals = (reduce(tokens) if reduce is not None else tokens).tolist()
        plan = self.train.dataset.plan("train_data", self.split.global_batch_size, 0, False)
        samples = plan.draws_before(done)  # the counts depend on the step alone
        return {
            name: {"samples": int(count), "tokens": int(total)}
            for name, count, total in zip(position.names, samples, totals, strict=True)
        }
