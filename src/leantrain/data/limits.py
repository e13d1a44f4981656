"""Upper bounds, from this machine's CPUs and memory, on the data counts that start processes or hold buffers.

Past these bounds loading gets no faster; the machine is taken instead. Every DataLoader
worker is a process with its own memory (``--num-workers 1000`` took 15 GiB and 75 s on a
2-core machine before its first step; a 20-digit count started workers until the machine
stopped answering signals), and every batch a worker loads ahead is held in shared memory
(torch's loader queues ``workers x prefetch_factor`` batches at start, so a 20-digit
``prefetch_factor`` never returns). PyTorch only warns. So these counts are refused before the
first worker starts, in one line that gives the bound and points to ``auto``/``tune``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from leantrain.data.workers import available_cpus, cpus_per_process
from leantrain.errors import ConfigError
from leantrain.units import format_bytes

# More workers than this per CPU only queue for the CPUs: loading that waits on storage or the
# network overlaps well within 4 processes per core.
MAX_WORKERS_PER_CPU = 4
# The least a worker adds to the machine's memory: the pages a forked process copies (measured:
# 11 MiB private per worker of the digits example after 10 batches; 15 MiB each with 1000 workers).
# A dataset that keeps more per worker (open files, decoded samples) adds to it.
WORKER_BYTES = 16 * 2**20
# Workers and the batches they hold ahead may take this share of the memory still available.
MEMORY_SHARE = 0.5
# A batch in flight takes one page of shared memory at the very least.
PAGE_BYTES = 4096


def available_memory(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this process may still allocate: the kernel's MemAvailable, capped by a cgroup's limit."""
    available = _meminfo_available()
    try:
        limit = (cgroup_root / "memory.max").read_text().strip()
        used = int((cgroup_root / "memory.current").read_text())
        if limit != "max":
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # macOS and friends


def max_workers(
    processes_per_node: int, cpus: int | None = None, memory: int | None = None
) -> tuple[int, str]:
    """The most DataLoader workers one training process may start, and why (for the error line)."""
    share = cpus_per_process(processes_per_node, available_cpus() if cpus is None else cpus)
    memory = available_memory() if memory is None else memory
    by_cpus = MAX_WORKERS_PER_CPU * share
    by_memory = max(1, math.floor(memory * MEMORY_SHARE / WORKER_BYTES / max(processes_per_node, 1)))
    if by_memory < by_cpus:
        return by_memory, (
            f"{format_bytes(memory)} of memory available, at least {format_bytes(WORKER_BYTES)} per worker"
        )
    per = "CPU" if processes_per_node == 1 else "CPU of this process's share"
    return by_cpus, f"{MAX_WORKERS_PER_CPU} per {per}, {share} CPU(s)"


def check_num_workers(num_workers: int | str, processes_per_node: int = 1) -> None:
    """ConfigError when a number of workers is more than this machine can run."""
    if not isinstance(num_workers, int):
        return  # auto and tune stay within the CPUs by construction
    bound, why = max_workers(processes_per_node)
    if num_workers > bound:
        raise ConfigError(
            "num_workers",
            num_workers,
            f"at most {bound} on this machine ({why}); auto picks a share of the CPUs, tune measures",
        )


def check_prefetch(
    prefetch_factor: int | None, workers: int, batch_bytes: int = PAGE_BYTES, memory: int | None = None
) -> None:
    """ConfigError when ``workers x prefetch_factor`` batches of ``batch_bytes`` cannot be held ahead."""
    if prefetch_factor is None or workers == 0:
        return
    memory = available_memory() if memory is None else memory
    held = max(batch_bytes, PAGE_BYTES)
    room = max(memory * MEMORY_SHARE - workers * WORKER_BYTES, 0)
    bound = max(1, math.floor(room / (workers * held)))
    if prefetch_factor > bound:
        size = "at least a 4 KiB page" if held == PAGE_BYTES else format_bytes(held)
        raise ConfigError(
            "prefetch_factor",
            prefetch_factor,
            f"at most {bound} here: {workers} worker(s) x {bound} micro-batches of {size} ahead fill "
            f"half of the {format_bytes(memory)} of memory available; leave it unset (two optimizer "
            "steps' worth with auto/tune, else 2)",
        )


def item_bytes(item: Any) -> int:
    """Bytes of the tensors and arrays in one dataset item (0 for an item without any)."""
    total = 0
    for leaf in tree_leaves(item):
        if isinstance(leaf, torch.Tensor):
            total += leaf.nelement() * leaf.element_size()
        elif hasattr(leaf, "nbytes") and isinstance(leaf.nbytes, int):  # NumPy arrays
            total += leaf.nbytes
    return total
