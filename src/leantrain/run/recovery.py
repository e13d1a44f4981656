"""The recovery part (``--on-spike``): judge every step's loss, keep a snapshot, roll back past a spike.

At each log point the window's per-step losses (reduced over the ranks: every rank judges the same
numbers, so every rank decides the same without another collective) go through the ``SpikeDetector``
(``spikes.py``). ``warn`` says so; ``rollback`` restores the newest ``HostSnapshot`` (``snapshot.py``,
taken every ``snapshot_every`` steps at a log point, after the steps before it were judged) and the run
goes on *after* the detecting step: the global batches from the snapshot's step to it are skipped (their
updates undone), the data order stays the run's (position = step), so nothing else has to be rewritten.
A non-finite loss or gradient is a spike too, found at its own step.

Reproducible: the detector's history, the rollbacks and, in a checkpoint taken between snapshot steps,
the snapshot itself are in the checkpoint (``checkpoint_state``), so a rerun, or a kill and ``--resume``
at any step, makes the same decisions and ends bit-identical to the run that was not interrupted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leantrain.config import TrainConfig
from leantrain.errors import SpikeError
from leantrain.run.hooks import state_key
from leantrain.run.model import ModelPart
from leantrain.run.observers import Observers
from leantrain.run.optimization import Optimization
from leantrain.run.snapshot import HostSnapshot, TrainingState
from leantrain.run.spikes import Spike, SpikeDetector

# The sample indices of the steps after the first through the second (1-based; None for a stream).
Samples = Callable[[int, int], list[int] | None]
# The run's parts whose state a snapshot holds.
Parts = tuple[ModelPart, Optimization, Observers]


class Recovery:
    def __init__(self, cfg: TrainConfig) -> None:
        self.mode = cfg.on_spike
        self.detector = SpikeDetector(cfg.spike_threshold, cfg.spike_window)
        self.every = cfg.snapshot_steps
        self.max_rollbacks = cfg.max_rollbacks
        self.snapshot: HostSnapshot | None = None  # the newest good state (rollback only)
        self.rollbacks: list[dict[str, Any]] = []  # as summary.json lists them
        self.spikes = 0  # spikes found (warned about or rolled back)

    @property
    def rolls_back(self) -> bool:
        return self.mode == "rollback"

    def judge(self, step_losses: tuple[tuple[int, float], ...]) -> Spike | None:
        """The first spike among a log window's (step index, loss) pairs, if any."""
        if self.mode == "off":
            return None
        spike = self.detector.first_spike(step_losses, accept=not self.rolls_back)
        self.spikes += spike is not None
        return spike

    def snapshot_due(self, done: int) -> bool:
        return self.rolls_back and done % self.every == 0

    def take(self, done: int, parts: Parts) -> None:
        """The state after step ``done`` into host memory (it replaces the previous snapshot)."""
        self.snapshot = None  # the old copy goes first: two never sit in memory together
        self.snapshot = HostSnapshot.capture(done, _training_state(*parts))

    def roll_back(self, spike: Spike, done: int, parts: Parts, samples: Samples) -> dict[str, Any]:
        """Restore the snapshot; the record of it (``samples(after, through)``: the skipped steps'
        sample indices, None for a stream). Past ``max_rollbacks``, a ``SpikeError`` instead."""
        assert self.snapshot is not None, "a snapshot is taken when training starts"
        restored = self.snapshot.step
        record = {
            "step": spike.step,
            "loss": spike.loss,
            "restored_step": restored,
            "skipped_steps": [restored + 1, done],
            "skipped_samples": samples(restored, done),
        }
        if spike.origin is not None:
            record["nan_origin"] = spike.origin
        if len(self.rollbacks) >= self.max_rollbacks:
            every = [*self.rollbacks, record]
            raise SpikeError(_too_many(every, self.max_rollbacks), every)
        self.snapshot.restore(_training_state(*parts))
        parts[1].tracker.clear()  # the undone steps' losses are not logged
        self.rollbacks.append(record)
        return record

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_state(
        self, done: int, gather: Callable[[Any], list[Any]], sharded: bool
    ) -> dict[str, Any]:
        """What a resume needs to decide as this run would (call on every rank: ``gather`` is a
        collective). Between snapshot steps the snapshot goes too: each rank's under a sharded strategy,
        else rank 0's with every rank's generators."""
        snapshot = None
        if self.rolls_back and self.snapshot is not None and self.snapshot.step != done:
            local = self.snapshot.state_dict()
            if sharded:
                snapshot = {"ranks": gather(local)}
            else:
                snapshot = {"ranks": [local], "rng": gather(local["rng"])}
        return {
            "detector": self.detector.state_dict(),
            "rollbacks": self.rollbacks,
            "spikes": self.spikes,
            "snapshot": snapshot,
        }

    def load(self, state: dict[str, Any] | None, rank: int, world_size: int) -> str | None:
        """A resumed checkpoint's section (None: one written before spikes were judged); a note when its
        snapshot cannot be used on this number of processes."""
        if state is None:
            return None
        self.detector.load_state_dict(state["detector"])
        self.rollbacks, self.spikes = list(state["rollbacks"]), state["spikes"]
        saved = state["snapshot"]
        if saved is None or not self.rolls_back:
            return None
        ranks = saved["ranks"]
        rngs = saved.get("rng", [None] * len(ranks))
        if max(len(ranks), len(rngs)) != world_size:
            return (
                f"the checkpoint's rollback snapshot was taken on {len(rngs)} process(es): the first "
                "snapshot is taken at the resumed step"
            )
        local = ranks[rank if len(ranks) > 1 else 0]
        self.snapshot = HostSnapshot.from_state_dict(local | ({"rng": rngs[rank]} if rngs[rank] else {}))
        return None


def _training_state(model: ModelPart, optimization: Optimization, observers: Observers) -> TrainingState:
    """What a snapshot copies; the objects it restores through ``load_state_dict`` by a stable name."""
    stateful: dict[str, Any] = {"precision": model.precision}
    if optimization.scheduler is not None:
        stateful["scheduler"] = optimization.scheduler
    for callback in observers.callbacks:
        if hasattr(callback, "state_dict") and hasattr(callback, "load_state_dict"):
            stateful[f"callback {state_key(callback)}"] = callback
    return TrainingState(
        model.model, optimization.optimizer, optimization.params, model.frozen_names, stateful
    )


def _too_many(rollbacks: list[dict[str, Any]], limit: int) -> str:
    spikes = ", ".join(f"step {r['step']} (loss {r['loss']:.4g})" for r in rollbacks)
    skipped = ", ".join(f"{a}-{b}" for a, b in (r["skipped_steps"] for r in rollbacks))
    return (
        f"the training loss spiked {len(rollbacks)} times, more than max_rollbacks={limit}: {spikes}; "
        f"skipped steps {skipped} (summary.json and the checkpoint list their samples); the data or the "
        "learning rate needs a look (raise --max-rollbacks to go on)"
    )
