"""A run's saved state: what a checkpoint holds, and how a run resumes from one.

Everything the next step depends on is taken at a step boundary: the weights and optimizer
state (whole, or each process's shards for a sharded strategy), the scheduler, the precision's
loss scale, every rank's random generators and losses not yet logged, and the progress
counters. A checkpoint resumes on another number of processes too (see ``world_change.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
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
from leantrain.run.background_save import BackgroundSaves
from leantrain.run.hooks import state_key
from leantrain.run.world_change import change_note, losses_of_rank, rng_of_rank
from leantrain.step.batching import BatchSplit
from leantrain.step.losses import LossTracker
from leantrain.step.precision import Precision
from leantrain.strategies.base import Strategy
from leantrain.strategies.sharded_state import load_dcp_extra, load_dcp_state

CALLBACKS_IN_SHARDS = "callbacks"  # the shards' entry for callbacks saved with the model


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
    callbacks_in_shards: list[str]  # callbacks whose state the resumed checkpoint's shards hold
    resumed_shards: Path | None
    resume_notes: list[str]
    callbacks: Sequence[Any]
    saves: BackgroundSaves

    def _wall_seconds(self) -> float:
        raise NotImplementedError

    def save_checkpoint(self, done: int) -> Path:
        """Everything the next step depends on, taken at this step boundary; rank 0 writes it
        (on a thread, with ``async_checkpoint``: ``saves.wait()`` waits for it)."""
        with self.saves.blocking():
            self.saves.settle()  # at most one save in flight: the previous one ends first
            return self._save_checkpoint(done)

    def _save_checkpoint(self, done: int) -> Path:
        # Each rank's generators and unlogged losses: they differ by rank.
        per_rank = self.strategy.gather({"rng": capture_rng(), "losses": self.tracker.state_dict()})
        path = self.checkpoints.folder / checkpoint_name(done)
        stateful = [callback for callback in self.callbacks if hasattr(callback, "state_dict")]
        callbacks = {state_key(callback): callback.state_dict() for callback in stateful}
        # A callback whose state is split like the model's (the weight average) is saved with it.
        with_model = [state_key(c) for c in stateful if getattr(c, "saved_with_model", False)]
        shards, written = None, None
        if self.strategy.sharded:  # every rank writes its shards first; the file below comes last
            shards = self.checkpoints.shard_folder(done)
            in_shards = {key: callbacks.pop(key) for key in with_model}
            extra = {CALLBACKS_IN_SHARDS: in_shards}
            with writing("checkpoint shards", shards):
                written = self.strategy.save_sharded(shards, self.optimizer, extra, self.saves.enabled)
        shards_written = _shards_written(written, shards)
        if not self.env.is_main:
            if written is not None:  # this rank's shards are written on DCP's thread
                self.saves.submit(lambda _: shards_written(), None)  # errors surface at the next wait
            return path
        state = {
            "step": done,
            "model": None if shards else self.model.state_dict(),
            "optimizer": None if shards else self.optimizer.state_dict(),
            "sharded": None if shards is None else shards.name,
            "tied": tied_aliases(self.model),  # `leantrain export` of shards: each gathered apart
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "precision": self.precision.state_dict(),
            "rng": [rank["rng"] for rank in per_rank],
            "losses": [rank["losses"] for rank in per_rank],
            "progress": {
                **self.progress,
                "wall_seconds": self._wall_seconds(),
                "checkpoint_blocked_seconds": self.checkpoint_blocked_seconds(),
                "compile_seconds": self.compile_seconds(),
            },
            "callbacks": callbacks,
            "callbacks_in_shards": with_model if shards else [],
            "config": self.cfg.to_dict(),
            "dataset_size": self.dataset_size,
            "micro_batch_size": self.split.micro_batch_size,
            "accumulation_steps": self.split.accumulation_steps,
            "world_size": self.env.world_size,
            "leantrain_version": __version__,
        }

        def write(staged: dict[str, Any]) -> None:
            shards_written()  # the file comes last: it exists only once every rank's shards do
            self.checkpoints.save(done, staged)

        self.saves.submit(write, state)
        return path

    def checkpoint_blocked_seconds(self) -> float:
        """Training time lost to saving, in this process and the earlier ones of the run."""
        return self.progress["checkpoint_blocked_seconds"] + self.saves.blocked_seconds

    def compile_seconds(self) -> float:
        """Time torch spent compiling (``--compile``), in this process and the earlier ones of the run."""
        return self.progress["compile_seconds"] + self.compiler.seconds

    def load_callback_shards(self, key: str, template: dict[str, Any]) -> dict[str, Any] | None:
        """A callback's state from the resumed checkpoint's shards (``template``: its current state,
        filled in place), or None when they hold none of it."""
        if self.resumed_shards is None or key not in self.callbacks_in_shards:
            return None
        load_dcp_extra({CALLBACKS_IN_SHARDS: {key: template}}, self.resumed_shards)
        return template

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
        self._load_model_and_optimizer(state, path)
        if (state["scheduler"] is None) != (self.scheduler is None):
            has = "has" if state["scheduler"] is not None else "has no"
            raise CheckpointError(f"checkpoint {path} {has} scheduler state, unlike this task")
        if self.scheduler is not None:
            load_into(self.scheduler, state["scheduler"], "scheduler", path)
        load_into(self.precision, state["precision"], "precision", path)
        self.tracker.load_state_dict(losses_of_rank(state, self.env), self.device)
        self.progress.update(state["progress"])
        self.start_step = min(state["step"], self.total_steps)
        self.saved_rng = rng_of_rank(state, self.env, self.cfg.seed)
        self.resume_notes += [note] if (note := change_note(state, self.env)) else []
        self.saved_callbacks = state.get("callbacks", {})  # loaded into them when training starts
        self.callbacks_in_shards = state.get("callbacks_in_shards", [])

    def _load_model_and_optimizer(self, state: dict[str, Any], path: Path) -> None:
        """Whole state into a whole model; shards into this process's shards (DCP reshards them
        for another number of processes) or gathered into a whole model (fsdp -> ddp, one process)."""
        if state.get("sharded"):
            self.resumed_shards = path.parent / state["sharded"]
            if self.strategy.sharded:
                self.strategy.load_sharded(self.resumed_shards, self.optimizer, path)
            else:
                load_dcp_state(self.model, self.optimizer, self.resumed_shards, path)
        elif self.strategy.sharded:
            raise CheckpointError(
                f"checkpoint {path} holds its model whole (strategy {state['config'].get('strategy')}), "
                f"and strategy {self.strategy.name} resumes only from shards: resume it with a strategy "
                "that holds the whole model (single, ddp)"
            )
        else:
            load_into(self.model, state["model"], "model", path)
            load_into(self.optimizer, state["optimizer"], "optimizer", path)


def _shards_written(future: Future[Any] | None, folder: Path | None) -> Callable[[], None]:
    """A call that returns once this rank's shards of a background save are written (at once
    for a save that wrote them already), raising a refused write as the synchronous save would."""

    def wait() -> None:
        if future is not None and folder is not None:
            with writing("checkpoint shards", folder):
                future.result()

    return wait
