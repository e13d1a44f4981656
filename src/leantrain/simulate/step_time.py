"""A model of one training step's time on a cluster: compute at a stated efficiency, collectives over
stated bandwidths. It is a model, not a measurement: every figure it rests on is in ``assumptions``.

Compute: the step's FLOPs on one rank / (``mfu`` x the GPU's dense peak): bf16 for 16-bit steps, else
fp32 without tensor cores (PyTorch's default ``float32_matmul_precision("highest")``), or tf32 when
``tf32=True``. The FLOPs are what the step runs, as counted by ``torch.utils.flop_counter`` (the
doctor's counter): with activation checkpointing they include the recomputed forward, so ``mfu`` is
then a hardware-FLOPs utilisation, higher than the MFU published runs report (which leave recomputation
out). ``DEFAULT_MFU`` is chosen from torchtitan's Llama 3.1 runs on H100s: see its comment.

Communication: each collective as a ring (the NCCL algorithm for large messages), whose every rank sends
``(g-1)/g x bytes`` for an all-gather, reduce-scatter or all-to-all, ``2(g-1)/g x bytes`` for an
all-reduce (``bytes`` the full tensor), and ``bytes`` for a broadcast (pipelined) or a point-to-point
send, at the GPU's intra-node bandwidth when the group stays in a node, else its inter-node one; plus a
latency of NCCL's own model.

Overlap: collectives that run beside compute (FSDP's prefetched all-gathers, its reduce-scatters during
backward) are hidden up to ``overlap x compute``; those that the next operation waits for (tensor
parallelism's, pipeline sends: ``overlaps_compute=False``) are all exposed. A step lasts compute plus
exposed communication.

Rank order (``leantrain.strategies.dims``): the model-parallel group (``tp`` or ``pp``) is ``t``
consecutive ranks, the data-parallel group takes one rank of each (stride ``t``), and a node holds
``gpus_per_node`` consecutive ranks. ``group_crosses_nodes`` says whether a group leaves its node.
(Leantrain has at most one of ``tp`` and ``pp`` above 1.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from leantrain.simulate.hardware import ClusterSpec

# torchtitan's Llama 3.1 8B, FSDP on 8 H100s, bf16, no torch.compile, selective (op) checkpointing:
# 5,762 tokens/s per GPU, 33.7 % MFU against 989 TFLOP/s (benchmarks/llama3_h100_202412_torchtitan.md;
# 6,667 and 39.0 % with torch.compile). Counting the recomputed matmuls too, as our FLOP counter does,
# that run reached about 37 % of the peak; its GPUs were power-capped at 500 W, below an H100 SXM's 700 W
# peak, so a full-power GPU does somewhat better. 0.35 stays on the safe side of those: a plan's step
# time is rather too long than too short.
DEFAULT_MFU = 0.35
# The share of compute time during which overlappable communication can run hidden. Not 1: the step's
# first all-gather and last reduce-scatter wait or are waited for, and NCCL's kernels take SMs from the
# matmuls they run beside.
DEFAULT_OVERLAP = 0.8
# NCCL's latency model for its ring algorithm with the Simple protocol (the one for large messages):
# a base latency per collective and one per ring step, over NVLink or the network
# (src/graph/tuning.cc, baseLat and hwLat, NCCL 2.x).
BASE_LATENCY_S = 8.4e-6
STEP_LATENCY_S = {False: 5.7e-6, True: 6.6e-6}  # keyed by crosses_nodes

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send", "all_to_all", "broadcast")


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS ("send": point-to-point)
    # The full (unsharded, gathered) tensor's bytes for all_gather, reduce_scatter, all_reduce and
    # all_to_all; the payload for send.
    bytes: int
    group_size: int
    crosses_nodes: bool
    overlaps_compute: bool = True  # False when compute waits for it (tensor parallelism, pipeline sends)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown collective {self.kind!r}; known: {', '.join(KINDS)}")

    def bytes_sent(self) -> float:
        """What each rank of the ring sends (and receives)."""
        g = self.group_size
        if self.kind == "send":
            return float(self.bytes)
        if g <= 1:
            return 0.0
        if self.kind == "broadcast":  # a pipelined ring: every rank but the last forwards the whole tensor
            return float(self.bytes)
        share = (g - 1) / g
        return 2 * share * self.bytes if self.kind == "all_reduce" else share * self.bytes

    def steps(self) -> int:
        """The ring's sequential steps, each paying a hop's latency."""
        if self.kind == "send":
            return 1
        return 2 * (self.group_size - 1) if self.kind == "all_reduce" else self.group_size - 1


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    step_s: float
    tokens_per_s_per_gpu: float | None  # None when the step's tokens are unknown
    assumptions: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "assumptions": list(self.assumptions)}


def collective_time(collective: Collective, cluster: ClusterSpec) -> float:
    """Seconds one collective takes on ``cluster``'s GPUs: its ring's bytes over the link, plus latency."""
    if collective.kind != "send" and collective.group_size <= 1:
        return 0.0
    gpu = cluster.gpu
    crosses = collective.crosses_nodes
    bandwidth = gpu.inter_node_bytes_per_s if crosses else gpu.intra_node_bytes_per_s
    latency = BASE_LATENCY_S + collective.steps() * STEP_LATENCY_S[crosses]
    return collective.bytes_sent() / bandwidth + latency


def step_time(
    flops_per_rank: float,
    sixteen_bit: bool,
    collectives: Sequence[Collective],
    cluster: ClusterSpec,
    mfu: float = DEFAULT_MFU,
    overlap: float = DEFAULT_OVERLAP,
    tokens_per_rank: int | None = None,
    tf32: bool = False,
) -> StepTime:
    """The modelled time of one optimizer step on each rank of ``cluster`` (see the module's docstring).

    ``flops_per_rank``: the FLOPs one rank runs in the step (all its micro-batches); ``collectives``:
    every collective one rank takes part in during the step; ``tokens_per_rank``: the tokens one rank
    trains on in the step (for tokens/s per GPU; the ranks of a tensor-parallel group share theirs, so
    pass the group's tokens / its size)."""
    if not 0 < mfu <= 1 or not 0 <= overlap <= 1:
        raise ValueError(f"mfu must be in (0, 1] and overlap in [0, 1], not {mfu} and {overlap}")
    gpu = cluster.gpu
    precision, peak = _peak(cluster, sixteen_bit, tf32)
    compute = flops_per_rank / (mfu * peak)
    hidden = sum(collective_time(c, cluster) for c in collectives if c.overlaps_compute)
    waited = sum(collective_time(c, cluster) for c in collectives if not c.overlaps_compute)
    exposed = waited + max(0.0, hidden - overlap * compute)
    step = compute + exposed
    tokens = tokens_per_rank / step if tokens_per_rank is not None and step > 0 else None
    intra, inter = gpu.intra_node_bytes_per_s, gpu.inter_node_bytes_per_s
    assumptions = (
        f"a model, not a measurement: compute at {mfu:.0%} of {gpu.name}'s dense {precision} peak "
        f"({peak / 1e12:,.1f} TFLOP/s; source: {gpu.source})",
        f"collectives as rings: {intra / 1e9:,.0f} GB/s per GPU one way within a node, {inter / 1e9:,.0f} "
        f"GB/s between nodes (a {inter * 8 / 1e9:.0f} Gb/s NIC per GPU assumed); peaks, no protocol overhead",
        f"latency (NCCL's model) per collective {BASE_LATENCY_S * 1e6:.1f} us + per ring step "
        f"{STEP_LATENCY_S[False] * 1e6:.1f} us within a node, {STEP_LATENCY_S[True] * 1e6:.1f} us between",
        f"data-parallel collectives hidden behind up to {overlap:.0%} of compute; tensor-parallel and "
        "pipeline ones exposed; pipeline bubbles are not modelled here",
    ) + ((f"{gpu.name}: {gpu.note}",) if gpu.note else ())
    return StepTime(compute, hidden + waited, exposed, step, tokens, assumptions)


def _peak(cluster: ClusterSpec, sixteen_bit: bool, tf32: bool) -> tuple[str, float]:
    """The dense peak the step's matmuls run at, and its name for the assumptions."""
    gpu = cluster.gpu
    if sixteen_bit:
        return "bf16", gpu.bf16_flops
    if tf32:
        return "tf32", gpu.tf32_flops
    return "fp32 without tensor cores", gpu.fp32_flops


def group_crosses_nodes(group_size: int, stride: int, cluster: ClusterSpec) -> bool:
    """Whether some group of ``group_size`` ranks, ``stride`` apart, spans two of ``cluster``'s nodes
    (each ``gpus_per_node`` consecutive ranks). The groups of one mesh dimension tile blocks of
    ``group_size x stride`` consecutive ranks, and a block that a node boundary cuts holds a group on
    both sides of it: so no group crosses exactly when every node holds a whole number of blocks.
    A tensor-parallel group: ``(tp, 1)``; a pipeline: ``(pp, 1)``; a data-parallel group: ``(dp, tp)``."""
    if group_size <= 1 or cluster.nodes == 1:
        return False
    # A block longer than a node leaves a remainder too: n % span == n.
    return cluster.gpus_per_node % (group_size * stride) != 0
