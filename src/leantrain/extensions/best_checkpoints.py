"""The K best checkpoints by a validation metric, kept beside the newest ones, and the best
weights as ``best.safetensors`` (``--keep-best K --best-metric NAME``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leantrain.checkpoint import CheckpointFolder
from leantrain.extensions.metric_watch import MetricWatch


class BestCheckpoints:
    """A callback, on every process (writing weights is collective under sharding): at each
    validation whose value ranks among the K best so far, it asks for a checkpoint of that step
    (``checkpoint_at``: the loop saves once, after every callback saw the validation) and protects
    it from the newest-K rotation; a new best also rewrites the best weights. A checkpoint that
    falls out of the K best goes at the next save, unless it is among the newest."""

    def __init__(
        self, watch: MetricWatch, keep: int, folder: CheckpointFolder, write_best_weights: Callable[[], None]
    ) -> None:
        self.watch = watch
        self.keep = keep
        self.folder = folder
        self.write_best_weights = write_best_weights
        self.ranked: list[tuple[float, int]] = []  # (value, step), best first
        self.checkpoint_at: int | None = None

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        value = self.watch.value_in(metrics)
        if value is None or not self.watch.better(value, None):  # a NaN is never among the best
            return
        position = next(
            (i for i, (kept, _) in enumerate(self.ranked) if self.watch.better(value, kept)), len(self.ranked)
        )
        if position >= self.keep:
            return
        self.ranked.insert(position, (value, step))
        del self.ranked[self.keep :]
        self.folder.protected = {kept_step for _, kept_step in self.ranked}
        self.checkpoint_at = step
        if position == 0:
            self.write_best_weights()

    def state_dict(self) -> dict[str, Any]:
        return {"ranked": [list(entry) for entry in self.ranked]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ranked = [(float(value), int(step)) for value, step in state["ranked"]]
        self.folder.protected = {step for _, step in self.ranked}
