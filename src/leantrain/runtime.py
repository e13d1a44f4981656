"""The process's surroundings: device, seeding, deterministic kernels, compute threads, peak
memory (stop signals: ``stop_signals.py``)."""

from __future__ import annotations

import os
import platform
import random
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from leantrain.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; an unavailable device is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device", name, "CUDA is not available on this machine; use auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError("device", name, f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device", name, "MPS is not available on this machine; use auto or cpu")
    return device


_MASK64 = 2**64 - 1


def derived_seed(*parts: int) -> int:
    """A 64-bit seed drawn from several integers (a run's seed and a position in it).

    SplitMix64's finaliser over the parts in turn: about 1 µs, cheap enough for every
    micro-batch (NumPy's ``SeedSequence`` takes 13 µs), and the seed's bits are well mixed.
    """
    state = 0
    for part in parts:
        state = (state ^ (part & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        state = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 31
    return state


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def host_rng_seeded(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's CPU generators seeded for the block; torch's is put back after.

    Data loading seeds them from the micro-batch's place in the run. Torch's CPU generator is
    also the training step's (CPU dropout, ``augment``): what loading draws must not shift it,
    so its state is restored (1.5 µs). Python's and NumPy's are left as the block leaves them:
    in the training process only data loading draws from them, and saving and restoring
    NumPy's state would cost about 90 µs per micro-batch. The accelerators' generators are not
    touched (``torch.manual_seed`` reseeds every device, and costs about 100x more).
    """
    saved = torch.default_generator.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.default_generator.set_state(saved)


@contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Only deterministic kernels inside the block (when enabled); the previous mode after it."""
    if not enabled:
        yield
        return
    previous = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    # cuBLAS needs a fixed workspace to be deterministic; it must be set before its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0])
        torch.backends.cudnn.benchmark = previous[1]


@contextmanager
def allocator_cap_lifted_after(device: torch.device) -> Iterator[None]:
    """The CUDA allocator's cap as it was before the block: a run's ``--memory-budget`` caps it
    for the process, and a later run or the user's own code in the same process must not inherit it."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_per_process_memory_fraction(device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)


@contextmanager
def matmul_reduction(allow_reduced: bool) -> Iterator[None]:
    """Whether CUDA's fp16/bf16 matmuls may accumulate in 16-bit (split-K) inside the block.

    Off by default in leantrain: the fp32 accumulator is one of the three remedies of 16-bit
    training (with master weights and loss scaling). Only CUDA reads the flags.
    """
    matmul = torch.backends.cuda.matmul
    previous = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_fp16_reduced_precision_reduction = allow_reduced
    matmul.allow_bf16_reduced_precision_reduction = allow_reduced
    try:
        yield
    finally:
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = (
            previous
        )


# Torch's intra-op threads when leantrain was imported: its own default (the CPUs of the
# process) unless the user changed it before. Another count at fit time is the user's choice.
_THREADS_AT_IMPORT = torch.get_num_threads()
# Set by ``leantrain launch`` beside the OMP_NUM_THREADS it chose for its ranks, which each rank
# may then lower further for its loader workers (a user's OMP_NUM_THREADS is left alone).
THREADS_FROM_LAUNCH = "LEANTRAIN_THREADS_FROM_LAUNCH"


def user_chose_threads() -> bool:
    """Whether the user set the compute threads: OMP_NUM_THREADS/MKL_NUM_THREADS, or torch.set_num_threads."""
    chosen_by_env = "OMP_NUM_THREADS" in os.environ or "MKL_NUM_THREADS" in os.environ
    return (chosen_by_env and THREADS_FROM_LAUNCH not in os.environ) or (
        torch.get_num_threads() != _THREADS_AT_IMPORT
    )


def leave_cpus_to_workers(workers: int, cpus: int) -> str | None:
    """Lower torch's intra-op threads to the CPUs that ``workers`` loader processes leave of the
    ``cpus`` of this process (at least one), unless the user chose the count; a note, or None.

    Beside busy workers, idle compute threads spin on the cores the workers need: on 2 CPUs
    with 2 workers, one compute thread trained the data-bound example 1.3x faster than two
    (benchmarks/results/data.md). Restored after the run by ``compute_threads_restored``.
    """
    before = torch.get_num_threads()
    threads = max(1, cpus - workers)
    if workers == 0 or threads >= before or user_chose_threads():
        return None
    torch.set_num_threads(threads)
    return (
        f"compute threads: {threads} (was {before}): {workers} loader worker(s) use the other CPUs of "
        f"the {cpus} this process has; OMP_NUM_THREADS or torch.set_num_threads chooses otherwise"
    )


@contextmanager
def compute_threads_restored() -> Iterator[None]:
    """Torch's intra-op thread count as it was before the block (a run may lower it)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of the run: allocated bytes on CUDA, the process's peak resident set on CPU.

    On Linux the peak comes from ``VmHWM`` in ``/proc/self/status``: ``ru_maxrss`` of a
    process started by a larger one (torchrun's agent) reports at least the parent's peak,
    because Linux keeps the high-water mark across ``exec``.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def native_16_bit(kind: str) -> bool | None:
    """Whether this CPU computes ``kind`` ("bf16" or "fp16") matrix products in hardware (x86:
    AVX512-BF16 or AMX for bf16; AVX512-FP16 or AMX-FP16 for fp16); None where it cannot tell."""
    probes = {
        "bf16": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
        "fp16": ("_is_amx_fp16_supported",),
    }[kind]
    found = [getattr(torch.cpu, probe, None) for probe in probes]
    if platform.machine().lower() not in ("x86_64", "amd64") or not all(callable(f) for f in found):
        return None  # another architecture, or a torch without these probes: not known
    if kind == "fp16" and "avx512_fp16" in _cpu_flags():
        return True
    return any(probe() for probe in found)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return {flag for line in cpuinfo if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        return set()


def emulated_precision(precision: str, device: torch.device) -> str | None:
    """Why ``precision`` would be slow on this CPU, for a warning before the run; None if it is not."""
    if device.type != "cpu" or precision == "32":
        return None
    kind = "bf16" if precision.startswith("bf16") else "fp16"
    if native_16_bit(kind) is not False:
        return None
    return (
        f"precision {precision} on this CPU, which has no {kind} matrix instructions: its 16-bit matrix "
        f"products are emulated, and training is many times slower than in 32 (charlm: 17x in bf16, "
        "21x in fp16, on an AVX2 CPU); --precision 32 is faster here"
    )
