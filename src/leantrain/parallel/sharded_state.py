"""Checkpoints of plans whose processes hold different parts of the state (fsdp, pipeline).

``torch.distributed.checkpoint`` (DCP) writes each process's part of the model and optimizer
state into one folder, in parallel; state that several processes hold alike (data-parallel
replicas) is written once. Keys are the module's own parameter names, so the parts of
different processes do not collide, and a run resumes with each process reading its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from leantrain.checkpoint import check_shards
from leantrain.errors import CheckpointError

# Optimizer state keyed by parameter name ("state.<name>.<key>", "param_groups.<name>.<key>"):
# processes that hold different parameters (pipeline stages) then write different keys. Left
# nested, every process's "param_groups.0" would share one key, and only one would be kept.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ShardedState:
    """Mixin for a plan: ``state_module`` is what this process holds the state of."""

    sharded = True

    @property
    def state_module(self) -> nn.Module:
        return self.model  # type: ignore[attr-defined]

    def save_sharded(self, folder: Path, optimizer: torch.optim.Optimizer) -> None:
        """Every rank writes its part of the model and optimizer state into ``folder``."""
        model_state, optimizer_state = get_state_dict(self.state_module, optimizer, options=_OPTIONS)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))

    def load_sharded(self, folder: Path, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
        """Read the parts saved by ``save_sharded`` into the model and the optimizer."""
        check_shards(checkpoint, folder)
        model_state, optimizer_state = get_state_dict(self.state_module, optimizer, options=_OPTIONS)
        state = {"model": model_state, "optimizer": optimizer_state}
        try:
            dcp.load(state, checkpoint_id=str(folder))
        except Exception as error:  # DCP raises its own CheckpointException and plain errors
            reason = " ".join(str(error).split())[:300]
            raise CheckpointError(
                f"checkpoint {checkpoint}: cannot load its sharded state {folder}: {reason}"
            ) from None
        set_state_dict(
            self.state_module,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_OPTIONS,
        )
