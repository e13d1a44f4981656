"""``leantrain plan --cluster``: what a job on a real cluster uses per GPU, simulated on this machine.

One rank of the cluster's world is simulated (``rank_step.py``): the strategy ``fit`` would use, its
real sharding and plan, one optimizer step on fake tensors. Every rank of a data-parallel and
tensor-parallel layout holds the same shapes, so rank 0 stands for all of them.

Memory per GPU: the peak of live tensors by kind (parameters, gradients, optimizer state,
activations, temporaries, communication buffers), and what the CUDA caching allocator reserves for it,
modelled as a share on top (``ALLOCATOR_OVERHEAD``), plus the CUDA context, which no allocator counts.
Time: the step's FLOPs on this rank and its collectives, priced by ``step_time.py`` on the cluster's
GPUs and links (a model: its assumptions are listed with every plan).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leantrain.config import TrainConfig
from leantrain.data.hf import torch_rows
from leantrain.data.loader import collate
from leantrain.errors import ConfigError
from leantrain.memory.accountant import MemoryBreakdown
from leantrain.memory.estimate import first_items
from leantrain.simulate.fake_world import fake_world
from leantrain.simulate.hardware import ClusterSpec
from leantrain.simulate.rank_step import RankStep, simulate_rank_step
from leantrain.simulate.step_time import Collective, StepTime, step_time
from leantrain.simulate.traffic import Sent
from leantrain.step.batching import configured_micro_batch
from leantrain.strategies.registry import check_config

# The caching allocator reserves whole blocks (2 MiB segments for small tensors, 20 MiB and up for
# large ones) and keeps freed ones: what it reserves exceeds the live tensors' peak. Assumed, not
# measured here (no GPU): torchtitan's published runs show reserved 5-15 % above active.
ALLOCATOR_OVERHEAD = 0.10
# The CUDA context and its kernels' modules: in nvidia-smi's figure, in no allocator's.
CUDA_CONTEXT_BYTES = 600 * 2**20


@dataclass(frozen=True)
class Layout:
    """How the job is laid out: what ``leantrain launch`` would be given."""

    strategy: str
    tp: int
    micro_batch_size: int
    activation_checkpointing: str | None
    precision: str
    compile: str = "none"  # planned eagerly (see ``report.plan_notes``), kept in the launch line

    def fit_flags(self) -> list[str]:
        flags = ["--strategy", self.strategy, "--micro-batch-size", str(self.micro_batch_size)]
        flags += ["--precision", self.precision]
        if self.tp > 1:
            flags += ["--tp", str(self.tp)]
        if self.activation_checkpointing is not None:
            flags += ["--activation-checkpointing", self.activation_checkpointing]
        if self.compile != "none":
            flags += ["--compile", self.compile]
        return flags


@dataclass(frozen=True)
class ClusterPlan:
    cluster: ClusterSpec
    layout: Layout
    dp: int
    accumulation: int
    memory: MemoryBreakdown  # the accountant's, per rank: what the run's summary.json will give
    peak: dict[str, int]  # live bytes by kind at the peak, per rank, and "Total"
    time: StepTime
    traffic: dict[str, int]  # bytes each rank's collectives move per step, by kind (whole tensors)

    @property
    def reserved_bytes(self) -> int:
        """What the caching allocator is modelled to reserve at the peak."""
        return int(self.peak.get("Total", 0) * (1 + ALLOCATOR_OVERHEAD))

    @property
    def fits(self) -> bool:
        return self.reserved_bytes + CUDA_CONTEXT_BYTES <= self.cluster.memory_bytes

    def command(self, fit_flags: Sequence[str] = ()) -> str:
        """The ``leantrain launch`` line of each node (``fit_flags``: the job's own, task and batch)."""
        launch = ["leantrain", "launch", "--nnodes", str(self.cluster.nodes)]
        launch += ["--nproc-per-node", str(self.cluster.gpus_per_node), "fit", *fit_flags]
        return shlex.join([*launch, *self.layout.fit_flags()])

    def slurm_command(self, fit_flags: Sequence[str] = ()) -> str:
        """The ``leantrain slurm`` line that submits the job (one task per node runs the launch)."""
        slurm = ["leantrain", "slurm", "--nodes", str(self.cluster.nodes)]
        slurm += ["--gpus-per-node", str(self.cluster.gpus_per_node), "fit", *fit_flags]
        return shlex.join([*slurm, *self.layout.fit_flags()])

    def as_dict(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "cluster": str(self.cluster),
            "world_size": self.cluster.world_size,
            "strategy": layout.strategy,
            "dp": self.dp,
            "tp": layout.tp,
            "micro_batch_size": layout.micro_batch_size,
            "accumulation": self.accumulation,
            "activation_checkpointing": layout.activation_checkpointing,
            "precision": layout.precision,
            **{f"accounted_{name}": value for name, value in self.memory.as_dict().items()},
            "peak_bytes_by_kind": self.peak,
            "peak_bytes": self.peak.get("Total", 0),
            "reserved_bytes": self.reserved_bytes,
            "cuda_context_bytes": CUDA_CONTEXT_BYTES,
            "gpu_memory_bytes": self.cluster.memory_bytes,
            "fits": self.fits,
            "traffic_bytes": self.traffic,
            **{f"time_{name}": value for name, value in self.time.as_dict().items()},
            "command": self.command(),
            "slurm_command": self.slurm_command(),
        }


def first_item(task: Any) -> Any:
    """The task's first training item: the data of a job on a cluster is not read beyond it."""
    return first_items(torch_rows(task.train_data(), "train_data"), 1)[0]


def sample_batch(task: Any, micro_batch_size: int, item: Any = None) -> Any:
    """A micro-batch of the task's shapes, collated as ``fit`` collates it, from one real item (the
    first, or ``item``) repeated. Items of different shapes (documents without packing) are planned at
    that one's."""
    item = first_item(task) if item is None else item
    return collate([item] * micro_batch_size, range(micro_batch_size), "train_data")


def tokens_of(batch: Any) -> int | None:
    """The tokens of a micro-batch: the elements of its first integer tensor (a language model's ids)."""
    found: list[torch.Tensor] = []
    torch.utils._pytree.tree_map_only(torch.Tensor, found.append, batch)
    ids = next((t for t in found if not t.is_floating_point() and t.dim() >= 2), None)
    return None if ids is None else ids.numel()


def collectives_of(sent: list[Sent], cluster: ClusterSpec, tp: int) -> list[Collective]:
    """The time model's collectives: the group's nodes from its ranks; a tensor-parallel group's
    collectives hold up the next operation, the data-parallel ones overlap compute."""
    priced = []
    for one in sent:
        nodes = {rank // cluster.gpus_per_node for rank in one.ranks}
        tensor_parallel = tp > 1 and len(one.ranks) == tp and one.ranks[-1] - one.ranks[0] == tp - 1
        collective = Collective(one.kind, one.bytes, len(one.ranks), len(nodes) > 1, not tensor_parallel)
        priced += [collective] * one.count
    return priced


def plan_cluster(
    task: Any, cfg: TrainConfig, cluster: ClusterSpec, mfu: float | None = None, item: Any = None
) -> ClusterPlan:
    """Simulate rank 0 of ``cfg``'s job on ``cluster`` and price its step (``item``: the task's first
    training item, when read already)."""
    world = cluster.world_size
    strategy = check_config(cfg, world)
    if not strategy.simulated:
        reason = "plan --cluster does not simulate its ranks yet: plan ddp or fsdp (with --tp)"
        raise ConfigError("strategy", strategy.name, reason)
    dims = strategy.dims(cfg, world)
    micro = configured_micro_batch(cfg, dims.dp)
    accumulation = cfg.global_batch_size // (dims.dp * micro)
    batch = sample_batch(task, micro, item)
    with fake_world(world, rank=0):
        step: RankStep = simulate_rank_step(task, cfg, strategy, dims, batch, accumulation)
    tokens = tokens_of(batch)
    per_rank_tokens = None if tokens is None else tokens * accumulation // dims.tp
    extra = {} if mfu is None else {"mfu": mfu}
    timing = step_time(
        step.flops, cfg.precision != "32", collectives_of(step.sent, cluster, dims.tp), cluster,
        tokens_per_rank=per_rank_tokens, **extra,
    )  # fmt: skip
    traffic: dict[str, int] = {}
    for one in step.sent:
        traffic[one.kind] = traffic.get(one.kind, 0) + one.bytes * one.count
    layout = Layout(strategy.name, dims.tp, micro, cfg.activation_checkpointing, cfg.precision, cfg.compile)
    return ClusterPlan(cluster, layout, dims.dp, accumulation, step.memory, step.peak, timing, traffic)
