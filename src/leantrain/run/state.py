"""A run's saved state: what a checkpoint holds, and how a run resumes from one.

Everything the next step depends on is taken at a step boundary: the weights and optimizer
state (whole, or each process's shards for a sharded strategy), the scheduler, the precision's
loss scale, every rank's random generators, the logged losses not yet read, and the progress
counters. Resuming needs the same number of processes (the generators are per rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from leantrain._version import __version__
from leantrain.checkpoint import (
    CheckpointFolder,
    capture_rng,
    check_compatible,
    checkpoint_name,
    load_checkpoint,
    load_into,
    tied_aliases,
)
from leantrain.cluster import ClusterEnv
from leantrain.config import TrainConfig
from leantrain.errors import CheckpointError
from leantrain.files import writing
from leantrain.run.hooks import state_key
from leantrain.step.batching import BatchSplit
from leantrain.step.losses import LossTracker
from leantrain.step.precision import Precision
from leantrain.strategies.base import Strategy


class RunState:
    """Saving and resuming, for ``Run``: the pieces below are the run's own."""

    cfg: TrainConfig
    env: ClusterEnv
    device: torch.device
    strategy: Strategy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Precision
    tracker: LossTracker
    progress: dict[str, float]
    checkpoints: CheckpointFolder
    split: BatchSplit
    dataset_size: int | None
    total_steps: int
    start_step: int
    saved_rng: dict[str, Any] | None
    saved_callbacks: dict[str, Any]
    callbacks: Sequence[Any]

    def _wall_seconds(self) -> float:
        raise NotImplementedError

    def save_checkpoint(self, done: int) -> Path:
        """Everything the next step depends on, taken at this step boundary; rank 0 writes it."""
        rng = self.strategy.gather(capture_rng())  # each rank's generators: they differ by rank
        path = self.checkpoints.folder / checkpoint_name(done)
        shards = None
        if self.strategy.sharded:  # every rank writes its shards first; the file below comes last
            shards = self.checkpoints.shard_folder(done)
            with writing("checkpoint shards", shards):
                self.strategy.save_sharded(shards, self.optimizer)
        if not self.env.is_main:
            return path
        state = {
            "step": done,
            "model": None if shards else self.model.state_dict(),
            "optimizer": None if shards else self.optimizer.state_dict(),
            "sharded": None if shards is None else shards.name,
            "tied": tied_aliases(self.model),  # `leantrain export` of shards: each gathered apart
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "precision": self.precision.state_dict(),
            "rng": rng,
            "losses": self.tracker.state_dict(),
            "progress": {**self.progress, "wall_seconds": self._wall_seconds()},
            "callbacks": {
                state_key(callback): callback.state_dict()
                for callback in self.callbacks
                if hasattr(callback, "state_dict")
            },
            "config": self.cfg.to_dict(),
            "dataset_size": self.dataset_size,
            "micro_batch_size": self.split.micro_batch_size,
            "accumulation_steps": self.split.accumulation_steps,
            "world_size": self.env.world_size,
            "leantrain_version": __version__,
        }
        return self.checkpoints.save(done, state)

    def recovery(self) -> str:
        """After a write the storage refused: what of the run is safe, and how to go on."""
        if not self.cfg.saves_checkpoints:
            return "no checkpoint is kept (checkpoint_every never): the run must start again"
        saved = self.checkpoints.files()  # complete files only: a save in progress is not listed
        if not saved:
            return "no checkpoint was written yet: free space or restore write access, then start again"
        return (
            f"the last good checkpoint is {saved[-1]}: free space or restore write access, then continue "
            "with --resume auto"
        )

    def resume_from(self, resume: str | None) -> None:
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
        if bool(state.get("sharded")) != self.strategy.sharded:
            saved_as = "in parts" if state.get("sharded") else "whole"
            saved_as += f" (strategy {state['config'].get('strategy')})"
            raise CheckpointError(
                f"checkpoint {path} holds its model {saved_as}, unlike this run (strategy "
                f"{self.strategy.name}); resume it with the strategy it was saved with"
            )
        if self.strategy.sharded:
            self.strategy.load_sharded(path.parent / state["sharded"], self.optimizer, path)
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
        self.saved_rng = _rng_of_rank(state, self.env, path)
        self.saved_callbacks = state.get("callbacks", {})  # loaded into them when training starts


def _rng_of_rank(state: dict[str, Any], env: ClusterEnv, path: Path) -> dict[str, Any]:
    """This rank's saved generator states; exact resume needs the same world size."""
    saved = state["rng"]
    if len(saved) != env.world_size:
        raise CheckpointError(
            f"checkpoint {path} was saved by {len(saved)} process(es) but this run has {env.world_size}; "
            "resume with the same number of processes"
        )
    return saved[env.rank]
