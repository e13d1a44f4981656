"""The model part: the model as this process runs it (its strategy, precision, recomputation).

Built by ``builders.build_model_part``. The weights it holds are saved and restored with the
optimizer state, by ``persistence.py`` (a sharded strategy writes both into one set of shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from leantrain.adapters import FrozenBase, write_peft_folder
from leantrain.checkpoint import export_weights, tied_aliases
from leantrain.step.batch_norm import split_statistics_warning
from leantrain.step.batching import BatchSplit
from leantrain.step.precision import Precision
from leantrain.strategies.base import Strategy


@dataclass(frozen=True)
class ModelPart:
    strategy: Strategy  # built, with the model wrapped or cut as it runs
    frozen: FrozenBase | None  # an adapter model's base: left out of checkpoints and weight files
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
            selective = "selective" in (self.recompute or "").split(",")
            how = ", op by op: their matrix products kept" if selective else ""
            lines.append(f"activation checkpointing: {len(self.recomputed)} blocks ({shown}){how}")
        return lines + self.notes + self.strategy.notes

    @property
    def frozen_names(self) -> frozenset[str]:
        return frozenset() if self.frozen is None else self.frozen.names

    def write_weights(self, path: Path, is_main: bool, adapter_folder: Path | None = None) -> None:
        """The trained weights into ``path`` (call on every rank: sharded, it is a collective); an
        adapter model's are the adapter's, also written in PEFT's format into ``adapter_folder``."""
        weights = self.strategy.trained_weights(self.precision, self.frozen_names)
        if not is_main:
            return
        export_weights(weights, path, tied_aliases(self.model))
        if self.frozen is not None and adapter_folder is not None:
            write_peft_folder(self.model, weights, adapter_folder)

    def batch_norm_warning(self, split: BatchSplit) -> str | None:
        """Once per split: BatchNorm layers whose statistics follow it, with the remedies."""
        can_sync = self.strategy.can_sync_batch_norm(self.strategy.device)
        return split_statistics_warning(self.batch_norms, split, can_sync)
