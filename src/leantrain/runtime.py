"""The process's surroundings: device, seeding, deterministic kernels, peak memory, stop signals."""

from __future__ import annotations

import os
import random
import resource
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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


class StopSignals:
    """Catches SIGTERM and SIGUSR1 (sent by schedulers before pre-emption) during training.

    The handler only records the signal; the loop checks ``received`` after each optimizer
    step, saves a checkpoint and stops cleanly. Handlers can only be installed from the
    main thread; elsewhere the signals keep their previous behaviour.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name, None)
                if number is not None:
                    self._previous[number] = signal.signal(number, self._record)
        return self

    def _record(self, number: int, frame: Any) -> None:
        self.received = signal.Signals(number)

    def __exit__(self, *exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
