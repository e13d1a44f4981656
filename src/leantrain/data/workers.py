"""How many DataLoader worker processes: ``auto`` from the CPUs this process may use, ``tune`` by measuring.

``auto`` gives every training process on the node an equal share of the CPUs it may run
on (its affinity mask, capped by a cgroup CPU quota, as in a container), because the
loader is the first bottleneck of a CPU-heavy ``__getitem__`` and idle workers cost
little. ``tune`` loads the run's first micro-batches with a few candidate counts and keeps
the fastest; it measures loading alone, so it suits data-bound runs best.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import DataLoader

# Workers per process are capped: beyond this, start-up time and memory grow for little gain.
MAX_AUTO_WORKERS = 16
# Each worker keeps this many micro-batches in flight at least (torch's default).
MIN_PREFETCH = 2
# tune times at least this many micro-batches per worker count, after the warm-up.
MIN_TIMED = 2
# tune keeps the smallest worker count whose throughput is within this share of the best.
TIE = 0.05


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup's quota (v2 ``cpu.max`` or v1 ``cfs_quota_us``); None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(cpus, 1)


def cpus_per_process(processes_per_node: int, cpus: int | None = None) -> int:
    """Each training process's share of the node's CPUs, at least 1."""
    cpus = available_cpus() if cpus is None else cpus
    return max(1, cpus // max(processes_per_node, 1))


def auto_workers(processes_per_node: int, cpus: int | None = None) -> int:
    """Each training process's share of the node's CPUs, at most MAX_AUTO_WORKERS."""
    return min(MAX_AUTO_WORKERS, cpus_per_process(processes_per_node, cpus))


def auto_prefetch(workers: int, accumulation_steps: int) -> int:
    """Micro-batches each worker loads ahead, so that two optimizer steps' worth are in flight."""
    return max(MIN_PREFETCH, math.ceil(2 * accumulation_steps / max(workers, 1)))


@dataclass(frozen=True)
class TuneResult:
    workers: int  # the fastest count
    samples_per_second: dict[int, float]  # by candidate

    def report(self) -> str:
        table = ", ".join(f"{n}: {rate:,.0f}" for n, rate in self.samples_per_second.items())
        return f"num_workers tune: {self.workers} is fastest (samples/s by worker count: {table})"


def tune_candidates(cpus: int, processes_per_node: int) -> list[int]:
    """0, then powers of two up to this process's share of the CPUs, and the share itself.

    Not more: on CPU-bound items, workers beyond the CPUs only take turns (a trial may still time
    one faster by chance), and torch warns against more workers than CPUs. Items that wait on
    storage or the network can use more: ``--num-workers N`` sets them."""
    share = cpus_per_process(processes_per_node, cpus)
    candidates, count = [0], 1
    while count < share:
        candidates.append(count)
        count *= 2
    return [*candidates, share]


def tune_workers(
    make_loader: Callable[[int, list[list[int]]], DataLoader],
    micro_batches: Sequence[list[int]],
    candidates: Sequence[int],
    batches_per_trial: int = 8,
) -> TuneResult | None:
    """Time loading ``batches_per_trial`` micro-batches with each worker count; the fastest wins.

    ``make_loader(workers, batches)`` builds the loader to measure. Each trial first loads
    one micro-batch per worker, untimed, so worker start-up is not counted: persistent
    workers start once per run. The smallest count within ``TIE`` of the best wins: fewer
    processes use less memory, and timings this short are noisy. A count is only tried when
    the run has enough micro-batches to time at least ``MIN_TIMED`` after its warm-up; None
    when none can be.
    """
    rates: dict[int, float] = {}
    for workers in candidates:
        warmup = max(workers, 1)
        if len(micro_batches) < warmup + MIN_TIMED:
            continue
        batches = list(micro_batches[: warmup + batches_per_trial])
        with warnings.catch_warnings():
            # torch warns about more workers than CPUs: trying more is the point here.
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            iterator = iter(make_loader(workers, batches))
        for _ in range(warmup):
            next(iterator)
        started = time.perf_counter()
        for _ in iterator:
            pass
        samples = sum(len(indices) for indices in batches[warmup:])  # a collated batch's len() is its fields
        rates[workers] = samples / max(time.perf_counter() - started, 1e-9)
        del iterator  # shuts the trial's workers down
    if not rates:
        return None
    fastest = max(rates.values())
    best = min(n for n, rate in rates.items() if rate >= (1 - TIE) * fastest)
    return TuneResult(best, rates)
