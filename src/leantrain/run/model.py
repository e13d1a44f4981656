"""The model part: the model as this process runs it (its strategy, precision, recomputation).

Built by ``builders.build_model_part``. The weights it holds are saved and restored with the
optimizer state, by ``persistence.py`` (a sharded strategy writes both into one set of shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from leantrain.checkpoint import export_weights, tied_aliases
from leantrain.step.batch_norm import split_statistics_warning
from leantrain.step.batching import BatchSplit
from leantrain.step.precision import Precision
from leantrain.strategies.base import Strategy


@dataclass(frozen=True)
class ModelPart:
    strategy: Strategy  # built, with the model wrapped or cut as it runs
    precision: Precision  # (the doctor's instruments may wrap it)
    prepared: list[nn.Parameter]  # what precision.prepare returned: the optimizer's, before wrapping
    recompute: str | None  # the activation checkpointing policy, ``auto`` resolved
    recomputed: list[str]  # the blocks it recomputes
    batch_norms: dict[str, bool]  # the model's BatchNorm layers (see ``step/batch_norm.py``)
    notes: list[str]  # set-up decisions, for the run log

    @property
    def model(self) -> nn.Module:
        """What this process holds, unwrapped: the model, or its pipeline stage."""
        return self.strategy.model

    def setup_lines(self) -> list[str]:
        """What the run log says of the model: the recomputed blocks, then the decisions taken."""
        lines = []
        if self.recomputed:
            shown = ", ".join(self.recomputed[:4]) + (", ..." if len(self.recomputed) > 4 else "")
            lines.append(f"activation checkpointing: {len(self.recomputed)} blocks ({shown})")
        return lines + self.notes + self.strategy.notes

    def write_weights(self, path: Path, is_main: bool) -> None:
        """The trained weights into ``path`` (call on every rank: sharded, it is a collective)."""
        weights = self.strategy.trained_weights(self.precision)
        if is_main:
            export_weights(weights, path, tied_aliases(self.model))

    def batch_norm_warning(self, split: BatchSplit) -> str | None:
        """Once per split: BatchNorm layers whose statistics follow it, with the remedies."""
        can_sync = self.strategy.can_sync_batch_norm(self.strategy.device)
        return split_statistics_warning(self.batch_norms, split, can_sync)
