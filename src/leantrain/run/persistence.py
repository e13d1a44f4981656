"""The persistence part: what a checkpoint holds, where it goes, and how a run resumes from one.

Everything the next step depends on is taken at a step boundary, each part giving its own section
(``checkpoint_state`` beside the part): the weights and optimizer state (whole, or each process's
shards for a sharded strategy: written here, as they are stored together), the scheduler and loss
scale (``optimization.py``), the data position (``data.py``), the callbacks' states
(``observers.py``), every rank's random generators and unlogged losses, and the ``Progress``
counters. A checkpoint resumes on another number of processes too (see ``world_change.py``).

Resuming reads the checkpoint once, before the parts that depend on where it stopped are built:
``resume`` fills the parts that exist (weights, optimizer, optimization, progress) and returns a
``Resumed`` that the later builders take (the data's start, the callbacks' states, the
generators the loop restores last).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leantrain._version import __version__
from leantrain.adapters import check_not_adapter_checkpoint, load_adapter_weights
from leantrain.checkpoint import (
    SHARDS_SUFFIX,
    CheckpointFolder,
    capture_rng,
    check_compatible,
    checkpoint_name,
    load_checkpoint,
    load_into,
    restore_rng,
    tied_aliases,
)
from leantrain.errors import CheckpointError, StorageError
from leantrain.files import writing
from leantrain.remote import is_url
from leantrain.run.background_save import BackgroundSaves
from leantrain.run.context import RunContext
from leantrain.run.data import DataPart
from leantrain.run.mirror import MirroredCheckpoints, fetch_checkpoint
from leantrain.run.model import ModelPart
from leantrain.run.observers import Observers
from leantrain.run.optimization import Optimization
from leantrain.run.recovery import Recovery
from leantrain.run.world_change import change_note, rng_of_rank
from leantrain.strategies.sharded_state import load_dcp_extra, load_dcp_state

CALLBACKS_IN_SHARDS = "callbacks"  # the shards' entry for callbacks saved with the model


@dataclass
class Progress:
    """Counters carried across the processes of a run (``--resume``): every checkpoint holds them."""

    train_seconds: float = 0.0  # in the training loop (log windows, compiling left out)
    final_train_loss: float = math.nan  # the last logged step's
    skipped_steps: int = 0  # without an update: fp16 overflows, non-finite steps skipped
    nonfinite_steps: int = 0
    nan_origin: str | None = None  # where the run's first non-finite value came from
    # In the earlier processes of the run; this process's are added when saved or summed up.
    wall_seconds: float = 0.0
    checkpoint_blocked_seconds: float = 0.0
    compile_seconds: float = 0.0

    def load(self, saved: dict[str, float]) -> None:
        """A checkpoint's counters (one written before a counter existed leaves it as it is)."""
        for name, value in saved.items():
            if hasattr(self, name):
                setattr(self, name, value)


@dataclass(frozen=True)
class Resumed:
    """Where the run starts: what the parts built after resuming need of the checkpoint."""

    step: int = 0  # the optimizer steps already done
    rng: dict[str, Any] | None = None  # this rank's generators: the loop restores them last
    callbacks: dict[str, Any] = field(default_factory=dict)  # the callbacks' states, by key
    callbacks_in_shards: list[str] = field(default_factory=list)  # those saved with the shards
    shards: Path | str | None = None  # the checkpoint's shard folder (or URL), if it has one
    notes: list[str] = field(default_factory=list)  # for the run log
    data: dict[str, Any] | None = None  # the streams' and a mixture's position (``DataPart``)
    spikes: dict[str, Any] | None = None  # the spike rule's history and the rollbacks (``recovery.py``)

    def restore_rng(self) -> None:
        if self.rng is not None:
            restore_rng(self.rng)

    def callback_from_shards(self, key: str, template: dict[str, Any]) -> dict[str, Any] | None:
        """A callback's state from the shards (``template``: its current state, filled in place), or
        None when they hold none of it."""
        if self.shards is None or key not in self.callbacks_in_shards:
            return None
        load_dcp_extra({CALLBACKS_IN_SHARDS: {key: template}}, self.shards)
        return template


class Persistence:
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        keep, mirror = ctx.cfg.keep_checkpoints, ctx.mirror
        self.checkpoints = (
            CheckpointFolder(ctx.run_dir / "checkpoints", keep)
            if mirror is None
            else MirroredCheckpoints(mirror, keep)
        )
        self.saves = BackgroundSaves(ctx.cfg.async_checkpoint)
        self.progress = Progress()

    def wall_seconds(self) -> float:
        """The run's time, in this process and the earlier ones."""
        return self.progress.wall_seconds + time.perf_counter() - self.ctx.started

    def checkpoint_blocked_seconds(self) -> float:
        """Training time lost to saving, in this process and the earlier ones of the run."""
        return self.progress.checkpoint_blocked_seconds + self.saves.blocked_seconds

    def recovery(self) -> str:
        """After a write the storage refused: what of the run is safe, and how to go on."""
        if not self.ctx.cfg.saves_checkpoints:
            return "no checkpoint is kept (checkpoint_every never): the run must start again"
        try:
            saved = self.checkpoints.files()  # complete files only: a save in progress is not listed
        except StorageError:  # a store that refuses the write may refuse the listing too
            return "the checkpoints already written stay where they are: restore access, then --resume auto"
        if not saved:
            return "no checkpoint was written yet: free space or restore write access, then start again"
        return (
            f"the last good checkpoint is {self.checkpoints.describe(saved[-1])}: free space or restore "
            "write access, then continue with --resume auto"
        )

    def publish(self) -> None:
        """A run folder at a URL: upload the run's files that changed (rank 0; the others write none)."""
        if self.ctx.mirror is not None and self.ctx.env.is_main:
            self.ctx.mirror.push_run_files()

    # -- saving -----------------------------------------------------------------------------

    def save(self, done: int, model: ModelPart, optimization: Optimization, data: DataPart,
             observers: Observers, recovery: Recovery) -> Path:  # fmt: skip
        """Everything the next step depends on, taken at this step boundary; rank 0 writes it
        (on a thread, with ``async_checkpoint``: ``saves.wait()`` waits for it)."""
        with self.saves.blocking():
            self.saves.settle()  # at most one save in flight: the previous one ends first
            path = self._save(done, model, optimization, data, observers, recovery)
            # Here, not on the save's thread: the log files are whole between steps.
            self.publish()
            return path

    def _save(self, done: int, model: ModelPart, optimization: Optimization, data: DataPart,
              observers: Observers, recovery: Recovery) -> Path:  # fmt: skip
        strategy, env = model.strategy, self.ctx.env
        # Each rank's generators and unlogged losses: they differ by rank.
        per_rank = strategy.gather(
            {"rng": capture_rng(), **optimization.rank_state(), **data.rank_state(done)}
        )
        spikes = recovery.checkpoint_state(done, strategy.gather, strategy.sharded)
        path = self.checkpoints.folder / checkpoint_name(done)
        callbacks, in_shards = observers.checkpoint_state(strategy.sharded)
        shards, written = None, None
        shards_name = checkpoint_name(done).replace(".pt", SHARDS_SUFFIX)
        if strategy.sharded:  # every rank writes its shards first; the file below comes last
            shards = self.checkpoints.shard_folder(done)
            with writing("checkpoint shards", shards):
                written = strategy.save_sharded(
                    shards, optimization.optimizer, {CALLBACKS_IN_SHARDS: in_shards}, self.saves.enabled,
                    model.frozen_names,
                )  # fmt: skip
        shards_written = _shards_written(written, shards)
        if not env.is_main:
            if written is not None:  # this rank's shards are written on DCP's thread
                self.saves.submit(lambda _: shards_written(), None)  # errors surface at the next wait
            return path
        progress = dataclasses.asdict(self.progress) | {
            "wall_seconds": self.wall_seconds(),
            "checkpoint_blocked_seconds": self.checkpoint_blocked_seconds(),
            "compile_seconds": self.progress.compile_seconds + observers.compiler.seconds,
        }
        state = {
            **data.checkpoint_state(done, per_rank),
            "model": None if shards else _trained_state(model),
            "frozen": None if model.frozen is None else model.frozen.checkpoint_state(),
            "optimizer": None if shards else optimization.optimizer.state_dict(),
            "sharded": None if shards is None else shards_name,
            "tied": tied_aliases(model.model),  # `leantrain export` of shards: each gathered apart
            **optimization.checkpoint_state(),
            "rng": [rank["rng"] for rank in per_rank],
            "losses": [rank["losses"] for rank in per_rank],
            "progress": progress,
            "callbacks": callbacks,
            "callbacks_in_shards": list(in_shards),
            "spikes": spikes,
            "config": self.ctx.cfg.to_dict(),
            "world_size": env.world_size,
            "leantrain_version": __version__,
        }

        def write(staged: dict[str, Any]) -> None:
            shards_written()  # the file comes last: it exists only once every rank's shards do
            self.checkpoints.save(done, staged)

        self.saves.submit(write, state)
        return path

    # -- resuming ---------------------------------------------------------------------------

    def resume(self, model: ModelPart, optimization: Optimization, dataset_size: int | None,
               total_steps: int) -> Resumed:  # fmt: skip
        """Load the checkpoint that ``cfg.resume`` names, if any, into the parts built so far."""
        found = self._checkpoint_to_resume()
        if found is None:
            return Resumed()
        path, state = found
        cfg, env = self.ctx.cfg, self.ctx.env
        check_compatible(state, path, cfg.to_dict(), dataset_size)
        if model.frozen is None:
            check_not_adapter_checkpoint(state, path)
        else:
            model.frozen.check(state.get("frozen"), path)
        shards = _load_weights_and_optimizer(model, optimization, state, path, self.checkpoints)
        optimization.restore(state, path, env)
        self.progress.load(state["progress"])
        return Resumed(
            step=min(state["step"], total_steps),
            rng=rng_of_rank(state, env, cfg.seed, self.ctx.dims.seed_rank(env.rank)),
            callbacks=state.get("callbacks", {}),
            callbacks_in_shards=state.get("callbacks_in_shards", []),
            shards=shards,
            notes=[note] if (note := change_note(state, env)) else [],
            data=state.get("data_position"),
            spikes=state.get("spikes"),
        )

    def _checkpoint_to_resume(self) -> tuple[Path, dict[str, Any]] | None:
        resume = self.ctx.cfg.resume
        if resume is None:
            return None
        if resume == "auto":  # the newest complete checkpoint; None: nothing saved yet, start fresh
            return self.checkpoints.newest_valid(warn=lambda text: print(f"leantrain: {text}"))
        path = fetch_checkpoint(resume, self.ctx.run_dir / ".resume") if is_url(resume) else Path(resume)
        return path, load_checkpoint(path)


def _load_weights_and_optimizer(
    model: ModelPart, optimization: Optimization, state: dict[str, Any], path: Path, folder: CheckpointFolder
) -> Path | str | None:
    """Whole state into a whole model; shards into this process's shards (DCP reshards them for
    another number of processes) or gathered into a whole model (fsdp -> ddp, one process).
    Returns the checkpoint's shard folder (a URL for a run folder in object storage), if it has one."""
    strategy, optimizer, frozen = model.strategy, optimization.optimizer, model.frozen_names
    if state.get("sharded"):
        shards = folder.shards_of(path, state["sharded"])
        if strategy.sharded:
            strategy.load_sharded(shards, optimizer, path, frozen)
        else:
            load_dcp_state(model.model, optimizer, shards, path, frozen)
        return shards
    if strategy.sharded:
        raise CheckpointError(
            f"checkpoint {path} holds its model whole (strategy {state['config'].get('strategy')}), "
            f"and strategy {strategy.name} resumes only from shards: resume it with a strategy "
            "that holds the whole model (single, ddp)"
        )
    if model.frozen is None:
        load_into(model.model, state["model"], "model", path)
    else:
        load_adapter_weights(model.model, state["model"], model.frozen, f"checkpoint {path}")
    load_into(optimizer, state["optimizer"], "optimizer", path)
    return None


def _trained_state(model: ModelPart) -> dict[str, Any]:
    """The model's state dict, but for an adapter model's frozen base."""
    state = model.model.state_dict()
    return state if model.frozen is None else model.frozen.without_frozen(state)


def _shards_written(future: Future[Any] | None, folder: Path | str | None) -> Callable[[], None]:
    """A call that returns once this rank's shards of a background save are written (at once
    for a save that wrote them already), raising a refused write as the synchronous save would."""

    def wait() -> None:
        if future is not None and folder is not None:
            with writing("checkpoint shards", folder):
                future.result()

    return wait
