"""``leantrain plan --cluster ... --search``: the layouts of a job on a cluster, simulated, fastest first.

A layout is a strategy (ddp or fsdp), a tensor-parallel degree (a divisor of the world that stays in
a node), an activation-checkpointing policy (none, the model's repeated blocks, ``selective``), a
micro-batch (a power of two dividing each data-parallel rank's batch) and a precision (the
configured one; a 32-bit job also tries bf16-mixed). Each is simulated as ``plan --cluster`` plans
one (``cluster_plan.py``). A layout the model cannot take (a tensor-parallel degree that does not
divide its heads) is listed with its reason. Memory grows with the micro-batch, so once one does not
fit, the larger ones of the same layout are listed as not fitting without being simulated; and a layout that
fits with less recomputation at the same micro-batch is not simulated with more (it would fit, slower).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from leantrain.blocks import block_classes
from leantrain.config import TrainConfig
from leantrain.errors import LeantrainError
from leantrain.simulate.cluster_plan import ClusterPlan, first_item, plan_cluster
from leantrain.simulate.hardware import ClusterSpec

STRATEGIES = ("ddp", "fsdp")
DOMINATED = "fits with less recomputation, which is faster"


@dataclass(frozen=True)
class Tried:
    """One layout of the search: its plan, or why it has none."""

    cfg: TrainConfig
    plan: ClusterPlan | None
    reason: str | None = None  # why there is no plan

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fits

    def sort_key(self) -> tuple[int, float]:
        """Fitting layouts first, fastest first (every layout trains the same global batch); then the
        others."""
        if self.plan is None or not self.plan.fits:
            return (1, 0.0)
        return (0, self.plan.time.step_s)

    def as_dict(self) -> dict[str, Any]:
        if self.plan is not None:
            return self.plan.as_dict()
        cfg = self.cfg
        return {
            "strategy": cfg.strategy, "tp": cfg.tp, "micro_batch_size": cfg.micro_batch_size,
            "activation_checkpointing": cfg.activation_checkpointing, "precision": cfg.precision,
            "fits": False, "reason": self.reason,
        }  # fmt: skip


def checkpointing_policies(task: Any) -> list[str | None]:
    """From the least recomputation to the most: none, op-level selective checkpointing of the model's
    repeated blocks, the whole blocks. The search skips a policy at a micro-batch that a lighter one
    fits."""
    with torch.device("meta"):
        blocks = block_classes(task.model())
    return [None, "selective", ",".join(blocks)] if blocks else [None]


def layouts(
    cfg: TrainConfig, cluster: ClusterSpec, policies: list[str | None]
) -> Iterator[list[TrainConfig]]:
    """Groups of layouts that differ in their micro-batch only, smallest first."""
    world = cluster.world_size
    precisions = [cfg.precision] + (["bf16-mixed"] if cfg.precision == "32" else [])
    for strategy in STRATEGIES:
        for tp in (t for t in range(1, cluster.gpus_per_node + 1) if world % t == 0):
            dp = world // tp
            if cfg.global_batch_size % dp:
                continue
            per_rank = cfg.global_batch_size // dp
            micros = [m for m in (2**k for k in range(per_rank.bit_length())) if per_rank % m == 0]
            for policy in policies:
                for precision in precisions:
                    yield [
                        cfg.replace(strategy=strategy, tp=tp, micro_batch_size=micro,
                                    activation_checkpointing=policy, precision=precision)
                        for micro in micros
                    ]  # fmt: skip


def search(
    task: Any,
    cfg: TrainConfig,
    cluster: ClusterSpec,
    mfu: float | None = None,
    progress: Callable[[int, Tried], None] | None = None,
) -> list[Tried]:
    """Every layout, simulated (``progress(index, tried)`` after each), fitting ones first, fastest first."""
    tried: list[Tried] = []
    item = first_item(task)  # read once: building a task's data can take seconds
    fitted: set[tuple[Any, ...]] = set()  # layouts that fit, less their recomputation
    for group in layouts(cfg, cluster, checkpointing_policies(task)):
        too_big = False
        for layout in group:
            key = (layout.strategy, layout.tp, layout.precision, layout.micro_batch_size)
            if too_big:
                one = Tried(layout, None, "a smaller micro-batch of this layout does not fit")
            elif key in fitted:  # recomputing more costs compute and saves memory it does not need
                one = Tried(layout, None, DOMINATED)
            else:
                one = _try(task, layout, cluster, mfu, item)
                too_big = one.plan is not None and not one.fits
                if one.fits:
                    fitted.add(key)
            tried.append(one)
            if progress is not None:
                progress(len(tried), one)
    return sorted(tried, key=Tried.sort_key)


def _try(task: Any, cfg: TrainConfig, cluster: ClusterSpec, mfu: float | None, item: Any) -> Tried:
    try:
        return Tried(cfg, plan_cluster(task, cfg, cluster, mfu, item))
    except (LeantrainError, ValueError, RuntimeError, torch.OutOfMemoryError) as error:
        # What this layout cannot do (a degree that does not divide the heads); the search goes on.
        return Tried(cfg, None, str(error).splitlines()[0])
