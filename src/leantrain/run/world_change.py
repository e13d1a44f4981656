"""Resuming a checkpoint on another number of processes than saved it.

The math does not depend on the split: the sample order follows the seed and the global batch
only, and every rank's gradients are reduced into the global batch's. What a checkpoint holds
per rank is therefore all that must be translated:

- **random generators**: each rank's are saved. On the same number of processes each rank gets
  its own back; on another number, every rank's are re-derived from ``(seed, rank, step)``: a
  documented, reproducible choice (dropout masks then differ from an uninterrupted run's, as
  they would with any other split). Runs that draw no random numbers while training (no
  dropout) end where an uninterrupted run ends.
- **losses not yet logged**: each rank's entries are saved. On the same number of processes
  each rank gets its own back; on another, rank 0 takes every step's total over all saved
  ranks as one entry, the others zero entries (ranks must hold as many entries each, for the
  all-reduce at the next log point), so that log point reports the same loss.
- **model and optimizer**: whole state loads on any number of processes (ddp <-> one
  process); sharded state through DCP, which reshards (fsdp on another number of processes)
  or gathers (fsdp -> one process, ddp).
"""

from __future__ import annotations

from typing import Any

import torch

from leantrain.checkpoint import capture_rng, restore_rng
from leantrain.cluster import ClusterEnv
from leantrain.runtime import derived_seed, seed_everything


def saved_world_size(state: dict[str, Any]) -> int:
    return len(state["rng"])


def rng_of_rank(state: dict[str, Any], env: ClusterEnv, seed: int, seed_rank: int) -> dict[str, Any]:
    """The generator states this rank resumes with: its own, or re-derived (see above) from its
    ``seed_rank`` (``ParallelDims.seed_rank``: shared by a tensor-parallel group)."""
    if saved_world_size(state) == env.world_size:
        return state["rng"][env.rank]
    current = capture_rng()
    seed_everything(derived_seed(seed, seed_rank, state["step"]))
    derived = capture_rng()
    restore_rng(current)  # set-up goes on with the generators it had; the derived ones come last
    return derived


def losses_of_rank(state: dict[str, Any], env: ClusterEnv) -> dict[str, Any]:
    """This rank's losses not yet logged (``LossTracker.state_dict`` form; see above)."""
    saved = state["losses"]
    if isinstance(saved, dict):  # written before each rank's were saved: rank 0's alone
        return saved
    if len(saved) == env.world_size:
        return saved[env.rank]
    steps = sorted({step for rank in saved for step in rank["steps"]})
    totals = dict.fromkeys(steps, 0.0)
    weights = dict.fromkeys(steps, 0.0)
    for rank in saved:
        for step, total, weight, is_mean in zip(
            rank["steps"], rank["totals"].tolist(), rank["weights"].tolist(), rank["is_mean"], strict=True
        ):
            totals[step] += total * weight if is_mean else total
            weights[step] += weight
    mine = env.rank == 0  # the others hold zeros: as many entries, nothing counted twice
    return {
        "steps": steps,
        "totals": torch.tensor([totals[s] if mine else 0.0 for s in steps], dtype=torch.float64),
        "weights": torch.tensor([weights[s] if mine else 0.0 for s in steps], dtype=torch.float64),
        "is_mean": [False] * len(steps),
    }


def change_note(state: dict[str, Any], env: ClusterEnv) -> str | None:
    """The log line saying what a resume on another number of processes changed, or None."""
    saved = saved_world_size(state)
    if saved == env.world_size:
        return None
    return (
        f"resumed on {env.world_size} process(es) a checkpoint saved by {saved}: the sample order and "
        "the optimisation are unchanged; each rank's random generators are re-derived from (seed, "
        "rank, step)"
    )
