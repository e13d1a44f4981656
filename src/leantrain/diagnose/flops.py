"""Model FLOPs utilisation: the FLOPs a step needs against what the device can do.

The FLOPs of a step come from ``torch.utils.flop_counter`` (matrix multiplications,
convolutions and attention, forward and backward; element-wise work is not counted, as
usual for MFU). The peak is a datasheet number for known GPUs (dense, no sparsity) and is
measured on the CPU and on unknown accelerators: the best rate of a large matrix
multiplication in the step's compute type, with the threads the run uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

# Dense peak FLOP/s by GPU name fragment (the first match wins: more specific names first),
# for fp32 (no TF32), tf32, bf16 and fp16 tensor cores. From the vendors' datasheets.
_DATASHEET = (
    ("H200", {"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12}),
    ("H100 PCIe", {"float32": 51e12, "tf32": 378e12, "bfloat16": 756e12, "float16": 756e12}),
    ("H100", {"float32": 67e12, "tf32": 495e12, "bfloat16": 989e12, "float16": 989e12}),
    ("A100", {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12}),
    ("L40S", {"float32": 91.6e12, "tf32": 183e12, "bfloat16": 362e12, "float16": 362e12}),
    ("L4", {"float32": 30.3e12, "tf32": 60e12, "bfloat16": 121e12, "float16": 121e12}),
    ("A10", {"float32": 31.2e12, "tf32": 62.5e12, "bfloat16": 125e12, "float16": 125e12}),
    ("V100", {"float32": 15.7e12, "tf32": 15.7e12, "float16": 125e12}),
    ("T4", {"float32": 8.1e12, "tf32": 8.1e12, "float16": 65e12}),
)

_MEASURE_SIZE = 1024
_MEASURE_SECONDS = 0.3


@dataclass(frozen=True)
class PeakFlops:
    flops_per_second: float
    dtype: str  # "float32", "bfloat16", ...
    source: str  # "datasheet: NVIDIA H100 80GB HBM3", or "measured: 1024^3 matmul, 2 threads"


def compute_dtype(precision: str) -> torch.dtype:
    """The type the matrix units work in under a precision setting."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def count_flops(step: Callable[[], Any]) -> int:
    """The FLOPs ``step()`` runs (forward and backward, if it calls backward)."""
    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> PeakFlops:
    """The device's peak for ``dtype``: a datasheet value for known GPUs, else measured."""
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        key = "tf32" if name == "float32" and torch.get_float32_matmul_precision() != "highest" else name
        for fragment, peaks in _DATASHEET:
            if fragment in gpu and key in peaks:
                return PeakFlops(peaks[key], name, f"datasheet: {gpu}")
    return _measured_peak(device, dtype)


def _measured_peak(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    """The best rate of repeated ``n x n @ n x n`` products over a short measurement."""
    n = _MEASURE_SIZE
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(device, dtype)
    b = torch.randn(n, n, generator=generator).to(device, dtype)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: kernel selection, page faults
    synchronize()
    best = 0.0
    deadline = time.perf_counter() + _MEASURE_SECONDS
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize()
        best = max(best, 2 * n**3 / (time.perf_counter() - started))
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return PeakFlops(best, str(dtype).removeprefix("torch."), f"measured: {n}^3 matmul{threads}")


def at_least(peak: PeakFlops, reached: float) -> PeakFlops:
    """``peak``, unless it was measured and a run's own steps reached more (``reached`` FLOP/s):
    then the measurement was slowed by other work on the machine, and the steps' rate is the
    better lower bound of the device's peak (so MFU stays a share, at most 1)."""
    if peak.source.startswith("datasheet") or reached <= peak.flops_per_second:
        return peak
    return PeakFlops(reached, peak.dtype, f"{peak.source}; raised to the rate the timed steps reached")


def mfu(flops_per_step: float, seconds_per_step: float, peak: PeakFlops) -> float:
    """The share of the peak a step's counted FLOPs reach (0 when nothing was measured)."""
    if seconds_per_step <= 0 or peak.flops_per_second <= 0:
        return 0.0
    return flops_per_step / seconds_per_step / peak.flops_per_second
