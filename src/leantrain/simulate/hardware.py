"""GPU kinds and the clusters made of them, for ``leantrain plan --cluster``.

Each kind holds datasheet figures (dense, no sparsity), with the datasheet named in ``source``. They are
peaks: a training step reaches a share of the FLOP/s (see ``step_time``), and a collective reaches a
share of the link's bandwidth. ``memory_bytes`` is what the card has; CUDA shows somewhat less (the
driver and ECC keep some: ``nvidia-smi`` shows 81,559 MiB of an H100 80GB's 81,920), and the caching
allocator's overhead comes on top of what tensors hold.

Bandwidths are per GPU, one direction, the rate a ring collective's each step can send at:
``intra_node_bytes_per_s`` over NVLink / Infinity Fabric (or PCIe where the card has no such link
between all GPUs of a node), ``inter_node_bytes_per_s`` over the network, assuming one NIC per GPU:
400 Gb/s (InfiniBand NDR or RoCE, 50 GB/s) for H100/H200/B200/MI300X clusters, 200 Gb/s (HDR, 25 GB/s)
for A100 and L40S clusters.

Cluster text (case-insensitive, ``x`` between the parts)::

    GPUSxGPU            8xH100      one node when GPUS <= 8, else nodes of 8 (256xH100 = 32 nodes x 8)
    NODESxGPUSxGPU      2x8xH100    nodes x GPUs per node x GPU
    GPU is KIND         h100, H100-SXM, mi300x, ... (``KINDS`` and ``ALIASES``)
        or MEMORY       80GiB       a GPU of that memory; its FLOP/s and bandwidths are an H100 SXM's
        or KIND-MEMORY  H100-95GiB  that kind with another memory (the 96 GB H100s of torchtitan's tables)
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from leantrain.errors import ConfigError
from leantrain.units import format_bytes, parse_bytes

GiB = 2**30
GB = 10**9
TERA = 1e12

# A network of one 400 Gb/s NIC per GPU (InfiniBand NDR, RoCE): 400e9 / 8 bytes per second.
NDR_400G = 50 * GB
# One 200 Gb/s NIC per GPU (InfiniBand HDR), as in a DGX A100.
HDR_200G = 25 * GB

# Below this, a "memory size" is a typo (``2x8x80`` meaning 80 bytes), not a GPU.
MIN_GPU_MEMORY = GiB
# A node of a GPUSxKIND cluster larger than one node: an HGX/DGX/OAM board of 8.
DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class GpuKind:
    name: str
    memory_bytes: int  # what the card has; CUDA can use slightly less (see the module's docstring)
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s
    tf32_flops: float  # dense tf32 tensor-core peak (fp32 matmuls with float32_matmul_precision "high")
    fp32_flops: float  # fp32 without tensor cores: PyTorch's default ("highest") for fp32 matmuls
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per GPU, one direction, within a node
    inter_node_bytes_per_s: float  # per GPU, one direction, between nodes (an assumption: see module)
    source: str
    note: str = ""


H100_SXM = GpuKind(
    "h100-sxm", 80 * GiB, bf16_flops=989 * TERA, tf32_flops=495 * TERA, fp32_flops=67 * TERA,
    hbm_bytes_per_s=3.35e12, intra_node_bytes_per_s=450 * GB, inter_node_bytes_per_s=NDR_400G,
    source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column), https://www.nvidia.com/en-us/data-center/h100/",
    note="NVLink 4: 900 GB/s per GPU both directions together, 450 one way",
)  # fmt: skip

KINDS: dict[str, GpuKind] = {
    kind.name: kind
    for kind in (
        H100_SXM,
        GpuKind(
            "h100-pcie", 80 * GiB, bf16_flops=756 * TERA, tf32_flops=378 * TERA, fp32_flops=51 * TERA,
            hbm_bytes_per_s=2.0e12, intra_node_bytes_per_s=64 * GB, inter_node_bytes_per_s=NDR_400G,
            source="NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column), https://www.nvidia.com/en-us/data-center/h100/",
            note="a ring of 8 cards runs at PCIe Gen5 x16 (64 GB/s one way): NVLink bridges join pairs only",
        ),
        GpuKind(
            "h200", 141 * GiB, bf16_flops=989 * TERA, tf32_flops=495 * TERA, fp32_flops=67 * TERA,
            hbm_bytes_per_s=4.8e12, intra_node_bytes_per_s=450 * GB, inter_node_bytes_per_s=NDR_400G,
            source="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column), https://www.nvidia.com/en-us/data-center/h200/",
            note="nvidia-smi shows 143,771 MiB (140.4 GiB); NVLink 4 as the H100 SXM",
        ),
        GpuKind(
            "a100-80gb", 80 * GiB, bf16_flops=312 * TERA, tf32_flops=156 * TERA, fp32_flops=19.5 * TERA,
            hbm_bytes_per_s=2.039e12, intra_node_bytes_per_s=300 * GB, inter_node_bytes_per_s=HDR_200G,
            source="NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column), https://www.nvidia.com/en-us/data-center/a100/",
            note="NVLink 3: 600 GB/s both directions, 300 one way; network: a DGX A100's 200 Gb/s per GPU",
        ),
        GpuKind(
            "a100-40gb", 40 * GiB, bf16_flops=312 * TERA, tf32_flops=156 * TERA, fp32_flops=19.5 * TERA,
            hbm_bytes_per_s=1.555e12, intra_node_bytes_per_s=300 * GB, inter_node_bytes_per_s=HDR_200G,
            source="NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM column), https://www.nvidia.com/en-us/data-center/a100/",
            note="NVLink 3 as the A100 80GB; network as a DGX A100",
        ),
        GpuKind(
            "l40s", 48 * GiB, bf16_flops=362 * TERA, tf32_flops=183 * TERA, fp32_flops=91.6 * TERA,
            hbm_bytes_per_s=864 * GB, intra_node_bytes_per_s=32 * GB, inter_node_bytes_per_s=HDR_200G,
            source="NVIDIA L40S datasheet, https://www.nvidia.com/en-us/data-center/l40s/",
            note="GDDR6, not HBM; no NVLink: PCIe Gen4 x16 (32 GB/s one way); network: 200 Gb/s per GPU",
        ),
        GpuKind(
            "b200", 180 * GB, bf16_flops=2250 * TERA, tf32_flops=1125 * TERA, fp32_flops=75 * TERA,
            hbm_bytes_per_s=8e12, intra_node_bytes_per_s=900 * GB, inter_node_bytes_per_s=NDR_400G,
            source="NVIDIA HGX B200 specifications (8-GPU figures / 8, sparse / 2), https://www.nvidia.com/en-us/data-center/hgx/",
            note="HGX B200: 1.4 TB for 8 GPUs (180 GB each); NVLink 5: 1.8 TB/s both directions, 900 one way",
        ),
        GpuKind(
            "mi300x", 192 * GB, bf16_flops=1307.4 * TERA, tf32_flops=653.7 * TERA, fp32_flops=163.4 * TERA,
            hbm_bytes_per_s=5.3e12, intra_node_bytes_per_s=448 * GB, inter_node_bytes_per_s=NDR_400G,
            source="AMD Instinct MI300X datasheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
            note="Infinity Fabric: 7 links x 64 GB/s one way to the other 7 GPUs (RCCL rings use them all)",
        ),
    )
}  # fmt: skip

ALIASES: dict[str, str] = {
    "h100": "h100-sxm",
    "h100sxm": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "h100pcie": "h100-pcie",
    "h200-sxm": "h200",
    "a100": "a100-80gb",
    "a100-80g": "a100-80gb",
    "a100-40g": "a100-40gb",
    "mi300": "mi300x",
}


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    gpus_per_node: int
    gpu: GpuKind
    memory_bytes: int  # per GPU: the kind's, or the one the cluster text names

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}x{self.gpu.name} ({format_bytes(self.memory_bytes)} each)"


def gpu_kind(name: str) -> GpuKind | None:
    """The kind a (case-insensitive) name or alias names; None when unknown."""
    key = name.strip().lower()
    return KINDS.get(ALIASES.get(key, key))


_ACCEPTED = (
    "expected GPUSxGPU (8xH100: one node up to 8, else nodes of 8) or NODESxGPUSxGPU (2x8xH100), "
    "GPU a kind, a memory size (80GiB: H100 SXM speeds) or KIND-MEMORY (H100-95GiB); kinds: "
    + ", ".join(KINDS)
)


def parse_cluster(text: str) -> ClusterSpec:
    """``8xH100``, ``256xH100``, ``2x8xH100``, ``2x8x80GiB``, ``8xH100-95GiB`` -> a ClusterSpec
    (the grammar is in the module's docstring); a one-line ConfigError naming ``cluster`` otherwise."""
    parts = re.split(r"x", text.strip(), maxsplit=2, flags=re.IGNORECASE) if isinstance(text, str) else []
    if len(parts) == 3 and not _count(parts[1]):
        # "8xmi300x" splits as 8 / mi300 / "": the kind's own "x" was taken for a separator.
        parts = [parts[0], "x".join(parts[1:])]
    counts = [_count(part) for part in parts[:-1]]
    gpu = _gpu(parts[-1]) if len(parts) in (2, 3) else None
    if gpu is None or None in counts:
        raise ConfigError("cluster", text, _ACCEPTED)
    kind, memory = gpu
    if len(counts) == 2:
        return ClusterSpec(counts[0], counts[1], kind, memory)
    gpus = counts[0]
    if gpus <= DEFAULT_GPUS_PER_NODE:
        return ClusterSpec(1, gpus, kind, memory)
    if gpus % DEFAULT_GPUS_PER_NODE:
        raise ConfigError("cluster", text, f"more than 8 GPUs come in nodes of 8; {_ACCEPTED}")
    return ClusterSpec(gpus // DEFAULT_GPUS_PER_NODE, DEFAULT_GPUS_PER_NODE, kind, memory)


def _count(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _gpu(text: str) -> tuple[GpuKind, int] | None:
    """KIND, MEMORY or KIND-MEMORY -> (kind, memory per GPU); None when it is none of them."""
    kind = gpu_kind(text)
    if kind is not None:
        return kind, kind.memory_bytes
    memory = _memory(text)
    if memory is not None:
        note = f"an unnamed GPU of {format_bytes(memory)}: FLOP/s and bandwidths assumed an H100 SXM's"
        name = f"gpu-{text.strip().lower()}"
        return dataclasses.replace(H100_SXM, name=name, memory_bytes=memory, note=note), memory
    name, _, size = text.rpartition("-")
    kind, memory = gpu_kind(name), _memory(size)
    if kind is None or memory is None:
        return None
    return dataclasses.replace(kind, memory_bytes=memory), memory


def _memory(text: str) -> int | None:
    """A memory size with its unit (``80GiB``, ``141GB``); a bare number is no memory size."""
    if not re.search(r"[a-z]", text, flags=re.IGNORECASE):
        return None
    memory = parse_bytes(text)
    return memory if memory is not None and memory >= MIN_GPU_MEMORY else None
