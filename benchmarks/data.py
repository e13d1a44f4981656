"""Training throughput of leantrain's data-loading options on the data-bound ``slowdata`` example.

``slowdata`` spends about 2 ms of NumPy per item (12 random affine warps of a 48x48 image)
on a model that needs microseconds per sample: the training speed is the loading speed.
``leantrain.Trainer.fit`` trains it with each loader setting side by side:

- ``num_workers=0`` (the baseline: what a default ``DataLoader`` does, loading in the main process),
- ``num_workers="auto"`` (one worker per CPU this process may use),
- ``num_workers="tune"`` (candidate counts timed on the first micro-batches; the fastest kept),
- ``cache=DIR`` with ``num_workers=0``, with ``"auto"`` (which picks 0 with a cache) and with as
  many workers as auto gives without one; DIR built once before the timed rounds by
  ``leantrain cache --example slowdata --out DIR`` (its build is timed separately),
- ``"auto"`` again with torch's default intra-op thread count in the main process (every other
  row uses ``torch.set_num_threads(1)``),
- ``num_workers=0`` a second time: the noise floor.

An ``on_step`` callback stamps every optimizer step; a run's speed is the samples of the steps
after a warm-up divided by the time they took (a mean rate over the window: workers hand out
batches in bursts, so a median step gap would mislead). Start-up (model, loader, tune's trials,
worker start, first batch) is reported apart. The same loaders are also iterated alone, without
training, to separate loading speed from training. All rows run interleaved in one process,
several rounds in a rotating order; medians over rounds, ratios to ``num_workers=0`` of the same
round with their range. Each window also records the CPU time of this process and its worker
processes and of the whole machine (``/proc/stat``): what other processes took is the first
suspect when workers fall short of the core count. The script waits for a quiet machine before
each run and redoes a run that other processes disturbed, within limits (``--max-others``,
``--quiet-wait``, ``--retries``, ``--patience``).

    python benchmarks/data.py            # full run (about 6 min on 2 cores); writes results/data.md
    python benchmarks/data.py --quick    # smoke run (under a minute); prints the table only
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

import leantrain as lt
import leantrain.data.build as data_build
from _common import add_output_options, cpu_model, load_now, output_path, publish
from _common import ranged as common_ranged
from leantrain.data.cache import prepare_cache, task_source
from leantrain.data.loader import build_loader
from leantrain.data.sampler import GlobalBatchSampler
from leantrain.data.workers import (
    auto_prefetch,
    auto_workers,
    available_cpus,
    cgroup_cpu_quota,
    tune_candidates,
)
from leantrain.examples.slowdata import SlowDataTask
from leantrain.step.batching import BatchSplit

DEFAULT_THREADS = torch.get_num_threads()  # torch's own choice, read before anything changes it
THREADS = 1
BATCH_SIZE = 32  # global batch, one micro-batch per step
SEED = 0
LOG_EVERY = 100_000  # more than the steps of a run: the only log point is the last step
TARGET_AUTO, TARGET_CACHE = 1.8, 5.0  # the issue's targets, times num_workers=0's samples/s
CLK_TCK = os.sysconf("SC_CLK_TCK")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "data.md"
# torch warns when a loader has more workers than it suggests for the machine; tune's choice can.
WORKER_WARNING = "This DataLoader will create"

BASELINE, NOISE_FLOOR = "num_workers=0", "num_workers=0, again"
AUTO, TUNE = "num_workers=auto", "num_workers=tune"
# Workers per process that auto gives without the cache (with it, auto loads in the main process).
SHARE = auto_workers(1)
CACHE0, CACHE_AUTO = "cache, num_workers=0", "cache, num_workers=auto"
CACHE_N = f"cache, num_workers={SHARE}"
AUTO_THREADS = f"num_workers=auto, {DEFAULT_THREADS} torch threads"
LOAD0, LOAD_AUTO = "loader alone, num_workers=0", "loader alone, num_workers=auto"
LOAD_CACHE0, LOAD_CACHE_N = "loader alone, cache, num_workers=0", f"loader alone, cache, num_workers={SHARE}"


@dataclass
class Setting:
    name: str
    workers: int | str  # TrainConfig.num_workers
    cache: bool = False
    train: bool = True  # False: the DataLoader iterated alone
    threads: int = THREADS  # torch.set_num_threads in the main process
    # One entry per round:
    rates: list[float] = field(default_factory=list)  # samples/s over the window after warm-up
    fit_rates: list[float] = field(default_factory=list)  # FitResult.samples_per_second
    startups: list[float] = field(default_factory=list)  # seconds from fit() to the first step
    used: list[int] = field(default_factory=list)  # the worker count in force
    cpu_ms: list[float] = field(default_factory=list)  # CPU ms per sample, this process + workers
    main: list[float] = field(default_factory=list)  # cores used by this process alone
    ours: list[float] = field(default_factory=list)  # cores used by this process + workers
    others: list[float] = field(default_factory=list)  # cores used by every other process
    tune_seconds: list[float] = field(default_factory=list)  # time in tune_workers
    tune_rates: list[dict[int, float]] = field(default_factory=list)  # loader-alone rate by candidate
    retried: int = 0  # runs done again because other processes took more than --max-others cores


def settings() -> list[Setting]:
    return [
        Setting(BASELINE, 0),
        Setting(AUTO, "auto"),
        Setting(TUNE, "tune"),
        Setting(CACHE0, 0, cache=True),
        Setting(CACHE_AUTO, "auto", cache=True),
        Setting(CACHE_N, SHARE, cache=True),  # what auto chose with the cache before 08de5a3
        Setting(AUTO_THREADS, "auto", threads=DEFAULT_THREADS),
        Setting(LOAD0, 0, train=False),
        Setting(LOAD_AUTO, "auto", train=False),
        Setting(LOAD_CACHE0, 0, cache=True, train=False),
        Setting(LOAD_CACHE_N, SHARE, cache=True, train=False),
        # The baseline once more (an A/A test): its ratio is the noise floor of the machine.
        Setting(NOISE_FLOOR, 0),
    ]


def min_tune_steps() -> int:
    """Steps a tune run needs: its largest candidate's warm-up batches plus 8 timed ones.

    With fewer micro-batches than its largest candidate count, tune fails with a bare
    StopIteration (see the README); with fewer than that plus 8, the larger counts are timed
    on fewer batches than the others.
    """
    return max(tune_candidates(available_cpus(), 1)) + 8


def make_task() -> SlowDataTask:
    """The slowdata example as the CLI builds it, with validation left out.

    ``val_data`` is switched off on the instance, not in a subclass: a cache's fingerprint
    names the task's class, so a subclass could not read the cache ``leantrain cache
    --example slowdata`` builds.
    """
    task = SlowDataTask()
    task.val_data = None  # type: ignore[method-assign,assignment]  # leantrain validates only if callable
    return task


# ---------------------------------------------------------------------------------------
# CPU accounting (Linux /proc)


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    main: float  # CPU seconds of this process (every thread)
    ours: float  # the same plus its live child processes (the workers)
    machine: float  # busy CPU seconds of the whole machine


def machine_busy_seconds() -> float:
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values[:8]) - idle) / CLK_TCK  # user .. steal; guest time is inside user


def child_cpu_seconds() -> float:
    total = 0.0
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    return total


def snapshot() -> CpuSnapshot:
    main = time.process_time()
    return CpuSnapshot(time.perf_counter(), main, main + child_cpu_seconds(), machine_busy_seconds())


class StepClock:
    """leantrain callback: a stamp per step, CPU snapshots at the window's start and end."""

    def __init__(self, steps: int, warmup: int) -> None:
        self.steps, self.warmup = steps, warmup
        self.stamps: list[float] = []
        self.window: list[CpuSnapshot] = []

    def on_step(self, stats: Any = None) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) in (self.warmup + 1, self.steps):
            self.window.append(snapshot())  # the workers are alive at both points


@dataclass
class Window:
    rate: float  # samples/s
    cpu_ms: float  # CPU ms per sample, ours
    main: float  # cores, this process alone
    ours: float  # cores, with the workers
    others: float  # cores


def window_of(clock: StepClock) -> Window:
    if len(clock.stamps) != clock.steps or len(clock.window) != 2:
        raise RuntimeError(f"ran {len(clock.stamps)} steps, expected {clock.steps}")
    start, end = clock.window
    seconds = end.wall - start.wall
    samples = (clock.steps - clock.warmup - 1) * BATCH_SIZE
    ours = end.ours - start.ours
    machine = end.machine - start.machine
    main = end.main - start.main
    return Window(
        samples / seconds,
        ours / samples * 1e3,
        main / seconds,
        ours / seconds,
        max(machine - ours, 0.0) / seconds,
    )


# ---------------------------------------------------------------------------------------
# tune's own time: a pass-through wrapper around the function leantrain calls


tune_log: list[tuple[float, Any]] = []
_tune_workers = data_build.tune_workers


def timed_tune_workers(*args: Any, **kwargs: Any) -> Any:
    started = time.perf_counter()
    result = _tune_workers(*args, **kwargs)
    tune_log.append((time.perf_counter() - started, result))
    return result


data_build.tune_workers = timed_tune_workers


# ---------------------------------------------------------------------------------------
# Runs


@dataclass
class Outcome:
    window: Window
    startup: float
    used: int
    fit_rate: float | None = None
    tune: tuple[float, Any] | None = None


def train(task: SlowDataTask, setting: Setting, steps: int, warmup: int, cache: Path) -> Outcome:
    clock = StepClock(steps, warmup)
    tune_log.clear()
    with tempfile.TemporaryDirectory(prefix="leantrain-data-bench-") as scratch:
        config = lt.TrainConfig(
            global_batch_size=BATCH_SIZE,
            max_steps=steps,
            seed=SEED,
            device="cpu",
            num_workers=setting.workers,  # type: ignore[arg-type]
            cache=str(cache) if setting.cache else None,
            out_dir=str(Path(scratch) / "run"),
            log_every_n_steps=LOG_EVERY,
            progress="none",
            logger="none",
        )
        started = time.perf_counter()
        result = lt.Trainer(config, callbacks=[clock]).fit(task)
    return Outcome(
        window_of(clock),
        clock.stamps[0] - started,
        result.num_workers,
        result.samples_per_second,
        tune_log[-1] if tune_log else None,
    )


def load_alone(dataset: Any, setting: Setting, steps: int, warmup: int) -> Outcome:
    """The loader fit builds (leantrain's sampler, item wrapper and prefetch), iterated without training."""
    workers = auto_workers(1) if setting.workers == "auto" else int(setting.workers)
    plan = BatchSplit(BATCH_SIZE, BATCH_SIZE, 1)
    sampler = GlobalBatchSampler(len(dataset), plan, steps, seed=SEED)
    prefetch = auto_prefetch(workers, plan.accumulation_steps) if workers else None
    clock = StepClock(steps, warmup)
    started = time.perf_counter()
    loader = build_loader(
        dataset, "train_data", batch_sampler=sampler, num_workers=workers, prefetch_factor=prefetch, seed=SEED
    )
    iterator = iter(loader)
    for _ in iterator:
        clock.on_step()
    del iterator  # stops the workers
    return Outcome(window_of(clock), clock.stamps[0] - started, workers)


def run_once(
    setting: Setting,
    task: SlowDataTask,
    datasets: dict[bool, Any],
    args: argparse.Namespace,
    cache: Path,
    steps: int | None = None,
) -> Outcome:
    gc.collect()
    torch.set_num_threads(setting.threads)
    try:
        full_steps, warmup = (
            (args.cache_steps, args.cache_warmup) if setting.cache else (args.steps, args.warmup)
        )
        steps = steps or full_steps
        warmup = min(warmup, steps - 2)
        if setting.train:
            return train(task, setting, steps, warmup, cache)
        return load_alone(datasets[setting.cache], setting, steps, warmup)
    finally:
        torch.set_num_threads(THREADS)


def wait_for_quiet(max_others: float, max_wait: float) -> float:
    """Wait until the machine's other processes use at most ``max_others`` cores over a second.

    Called between runs, when this process and its workers are idle, so the machine's busy
    time is the other processes'. Gives up after ``max_wait`` seconds; returns the seconds waited.
    """
    started = time.perf_counter()
    while True:
        before, busy_before = time.perf_counter(), machine_busy_seconds()
        time.sleep(0.3)
        busy = (machine_busy_seconds() - busy_before) / (time.perf_counter() - before)
        waited = time.perf_counter() - started
        if busy <= max_others or waited >= max_wait:
            return waited


waits: list[float] = []  # seconds spent waiting for a quiet machine before each timed run
redone: list[float] = []  # seconds of the runs done again (their results dropped)


def measure(
    timed: list[Setting], task: SlowDataTask, datasets: dict[bool, Any], args: argparse.Namespace, cache: Path
) -> None:
    # One short untimed run of each first: the process's first fit pays about a second of lazy
    # initialisation, which would otherwise land in round 1's first row.
    for setting in timed:
        run_once(setting, task, datasets, args, cache, steps=min_tune_steps())
    for round_index in range(args.rounds):
        shift = round_index % len(timed)  # no row always first or last
        for setting in timed[shift:] + timed[:shift]:
            for attempt in range(args.retries + 1):
                left = args.patience - sum(waits) - sum(redone)
                if left > 0:
                    waits.append(wait_for_quiet(args.max_others, min(args.quiet_wait, left)))
                attempt_started = time.perf_counter()
                outcome = run_once(setting, task, datasets, args, cache)
                if outcome.window.others <= args.max_others:
                    break
                if attempt < args.retries and sum(waits) + sum(redone) < args.patience:
                    redone.append(time.perf_counter() - attempt_started)
                    setting.retried += 1
                    print(
                        f"round {round_index + 1}/{args.rounds}  {setting.name:<38} other processes took "
                        f"{outcome.window.others:.2f} cores: run again",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    break
            setting.rates.append(outcome.window.rate)
            setting.cpu_ms.append(outcome.window.cpu_ms)
            setting.main.append(outcome.window.main)
            setting.ours.append(outcome.window.ours)
            setting.others.append(outcome.window.others)
            setting.startups.append(outcome.startup)
            setting.used.append(outcome.used)
            if outcome.fit_rate is not None:
                setting.fit_rates.append(outcome.fit_rate)
            if outcome.tune is not None:
                seconds, result = outcome.tune
                setting.tune_seconds.append(seconds)
                setting.tune_rates.append(dict(result.samples_per_second))
            print(
                f"round {round_index + 1}/{args.rounds}  {setting.name:<38} {outcome.window.rate:9,.0f} "
                f"samples/s  {outcome.used} workers  start-up {outcome.startup:5.2f} s  "
                f"others {outcome.window.others:4.2f} cores",
                file=sys.stderr,
                flush=True,
            )


# ---------------------------------------------------------------------------------------
# The cache, built once by the CLI


@dataclass
class Build:
    wall: float  # the `leantrain cache` command, interpreter start included
    seconds: dict[str, float]  # build_seconds of each split, from its cache.json
    mib: dict[str, float]
    items: dict[str, int]
    workers: int


def build_cache(folder: Path) -> Build:
    command = [sys.executable, "-m", "leantrain", "cache", "--example", "slowdata", "--out", str(folder)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{done.stdout}\n{done.stderr}")
    manifests = {split: json.loads((folder / split / "cache.json").read_text()) for split in ("train", "val")}
    return Build(
        wall,
        {split: m["build_seconds"] for split, m in manifests.items()},
        {split: m["bytes"] / 2**20 for split, m in manifests.items()},
        {split: m["fingerprint"]["size"] for split, m in manifests.items()},
        auto_workers(1),  # the CLI's --num-workers default is auto
    )


# ---------------------------------------------------------------------------------------
# Report


def ranged(values: Sequence[float], digits: int) -> str:
    """The median and range of ``values``, thousands grouped: samples/s run into the tens of thousands."""
    return common_ranged(values, digits, thousands=True)


def counts(values: Sequence[int]) -> str:
    """Worker counts over rounds: "2", or "4 (3x), 2 (2x)" when they differ."""
    tally = {value: values.count(value) for value in sorted(set(values), key=values.count, reverse=True)}
    if len(tally) == 1:
        return str(values[0])
    return ", ".join(f"{value} ({times}x)" for value, times in tally.items())


def ratios(setting: Setting, base: Setting) -> list[float]:
    return [mine / ref for mine, ref in zip(setting.rates, base.rates, strict=True)]


def quiet_ratios(setting: Setting, base: Setting, limit: float) -> list[float]:
    """The ratios of the rounds where other processes stayed under ``limit`` cores in both windows."""
    return [
        ratio
        for ratio, mine, ref in zip(ratios(setting, base), setting.others, base.others, strict=True)
        if mine <= limit and ref <= limit
    ]


def quiet_text(values: list[float], rounds: int, digits: int = 2) -> str:
    if not values:
        return f"no round of {rounds} was quiet"
    return f"{statistics.median(values):.{digits}f}x in the {len(values)} quiet round(s) of {rounds}"


def render(
    timed: list[Setting], build: Build, args: argparse.Namespace, load_before: str, minutes: float
) -> str:
    by_name = {s.name: s for s in timed}
    base = by_name[BASELINE]
    speed = {s.name: ratios(s, base) for s in timed}
    quota = cgroup_cpu_quota()
    lines = [
        "# Data loading: worker counts and the cache on the data-bound `slowdata` example",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPU cores visible, {available_cpus()} available to this process "
        f"(affinity mask{'' if quota is None else f', cgroup quota {quota:g}'}), Python "
        f"{platform.python_version()}; load average before / after: {load_before} / {load_now()}; "
        f"the full run took {minutes:.1f} min",
        f"- Versions: torch {torch.__version__}, NumPy {np.__version__}, leantrain {lt.__version__}",
        f"- Threads: `torch.set_num_threads({THREADS})` in the main process for every row but "
        f'"{AUTO_THREADS}" (torch\'s default here, {DEFAULT_THREADS}); DataLoader workers always run '
        "one torch thread (torch sets it in each worker)",
        "- Work: the `slowdata` example as `leantrain fit --example slowdata` builds it (`SlowDataTask()`: "
        "4,096 items, each a 48x48 float32 image warped by 12 random affine resamplings in NumPy, about "
        "2 ms of CPU, and a label; AvgPool-Linear-ReLU-Linear model, AdamW), validation left out "
        "(`val_data = None` on the instance); "
        f"`leantrain.Trainer(TrainConfig(global_batch_size={BATCH_SIZE}, max_steps=..., seed={SEED}, "
        f'device="cpu", num_workers=..., cache=..., log_every_n_steps={LOG_EVERY:_}, progress="none", '
        'logger="none", out_dir=<fresh temporary folder>)).fit(task)`; one micro-batch per step. '
        f"{args.steps} steps per run without the cache, {args.cache_steps} with it (it is so fast that "
        "a run of the same length would last a fraction of a second).",
        f"- Cache: built once before the timed rounds by `leantrain cache --example slowdata --out DIR` "
        f"(`--num-workers auto`: {build.workers} workers), "
        f"{build.wall:.1f} s for the command (interpreter and imports included): train "
        f"{build.items['train']:,} items, {build.mib['train']:.1f} MiB in {build.seconds['train']:.1f} s; "
        f"val {build.items['val']:,} items, {build.mib['val']:.1f} MiB in {build.seconds['val']:.1f} s "
        "(from each `cache.json`). Every cached run reads DIR/train; none rebuilds it.",
        "- *Samples/s*: an `on_step` callback stamps `time.perf_counter()` after every step; the samples of "
        f"the steps after the first {args.warmup} ({args.cache_warmup} with the cache) divided by the "
        "time they took: a mean rate over the window, not a median step (workers hand out batches in "
        "bursts). Median over rounds, range in brackets. *vs num_workers=0*: per round, the ratio to "
        "`num_workers=0`'s samples/s in the same round; median and range. "
        f'"{NOISE_FLOOR}" runs the baseline a second time: its ratio is the noise floor.',
        "- *FitResult samples/s*: `FitResult.samples_per_second`, over the whole training loop, so it also "
        "counts the first step's wait for the workers to start and the prefetch to fill. *Start-up*: "
        "from calling `fit` to the first step's end (model, loader, worker start, first batch; for tune, "
        "its trials too). *tune*: the time in `tune_workers` (a pass-through wrapper around the function "
        "leantrain calls, `leantrain.data.build.tune_workers`), which is before the first step and in "
        "no samples/s figure. *Workers*: `FitResult.num_workers` (the count auto or tune chose).",
        f"- Other load: before each timed run the script waits (at most {args.quiet_wait:g} s) until "
        f"other processes use at most {args.max_others:g} cores over 0.3 s, and a run during which they "
        f"took more is done again, at most {args.retries} time(s); the last attempt is kept whatever its "
        f"load. No more waiting or redoing once {args.patience:g} s have gone into them. This run waited "
        f"{sum(waits):.0f} s in all, spent {sum(redone):.0f} s on runs it dropped, and redid "
        + (", ".join(f"{s.name} {s.retried}x" for s in timed if s.retried) or "no run")
        + f"; runs kept with more than {args.max_others:g} cores of other load: "
        + (
            ", ".join(
                f"{s.name} {sum(o > args.max_others for o in s.others)}"
                for s in timed
                if any(o > args.max_others for o in s.others)
            )
            or "none"
        )
        + ".",
        "- *Loader alone*: the loader `fit` builds (`build_loader` with leantrain's `GlobalBatchSampler`, "
        "the same worker count and prefetch) iterated without training, timed the same way per batch.",
        "- *CPU per sample*: CPU time of this process and its live worker processes over the window "
        "(`time.process_time()` plus each worker's `/proc/PID/stat`), per sample. *Cores*: CPU time over "
        "the window divided by its length, for this process alone (*main*), with its workers (*ours*), "
        "and for every other process on the machine (*others*: `/proc/stat`'s busy time less ours).",
        "",
        "| Setting | Workers | Samples/s | vs num_workers=0 | FitResult samples/s | Start-up (s) "
        "| CPU per sample (ms) | Cores: main | Cores: ours | Cores: others |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in timed:
        fit_rate = ranged(s.fit_rates, 0) if s.fit_rates else "-"
        startup = ranged(s.startups, 2)
        if s.tune_seconds:
            startup += f"; in tune: {ranged(s.tune_seconds, 2)}"
        lines.append(
            f"| {s.name} | {counts(s.used)} | {ranged(s.rates, 0)} | {ranged(speed[s.name], 2)} | {fit_rate} "
            f"| {startup} | {ranged(s.cpu_ms, 3)} | {ranged(s.main, 2)} | {ranged(s.ours, 2)} "
            f"| {ranged(s.others, 2)} |"
        )
    tune = by_name[TUNE]
    if tune.tune_rates:
        candidates = sorted({n for rates in tune.tune_rates for n in rates})

        def trial(n: int) -> str:
            return ranged([rates[n] for rates in tune.tune_rates if n in rates], 0)

        lines += [
            "",
            "tune's own trials: `TuneResult.samples_per_second` (what tune logs), the loader alone by "
            "candidate worker count, median over rounds; it keeps the smallest count within 5% of the "
            "fastest.",
            "",
            "| Candidate workers | " + " | ".join(str(n) for n in candidates) + " |",
            "|---|" + "---:|" * len(candidates),
            "| samples/s | " + " | ".join(trial(n) for n in candidates) + " |",
        ]
    auto = statistics.median(speed[AUTO])
    cache0, cache_auto = statistics.median(speed[CACHE0]), statistics.median(speed[CACHE_AUTO])
    quiet_auto = quiet_ratios(by_name[AUTO], base, args.max_others)
    quiet_cache = quiet_ratios(by_name[CACHE0], base, args.max_others)
    lines += [
        "",
        f"Targets (median ratio over rounds; noise floor {statistics.median(speed[NOISE_FLOOR]):.2f}): "
        f"auto >= {TARGET_AUTO}x num_workers=0: **{'met' if auto >= TARGET_AUTO else 'NOT met'}**, "
        f"{auto:.2f}x [{min(speed[AUTO]):.2f} to {max(speed[AUTO]):.2f}] "
        f"({quiet_text(quiet_auto, args.rounds)}); cache >= {TARGET_CACHE:g}x: "
        f"**{'met' if cache0 >= TARGET_CACHE else 'NOT met'}** with num_workers=0, {cache0:.1f}x "
        f"({quiet_text(quiet_cache, args.rounds, 1)}); {'met' if cache_auto >= TARGET_CACHE else 'NOT met'} "
        f"with auto, {cache_auto:.1f}x. A quiet round: other processes took at most {args.max_others:g} "
        "cores in both the row's and the baseline's window.",
        "",
        "## Reading the results",
        "",
        *interpretation(by_name, speed, build, args.max_others),
    ]
    return "\n".join(lines) + "\n"


def interpretation(
    by_name: dict[str, Setting], speed: dict[str, list[float]], build: Build, max_others: float
) -> list[str]:
    """Sentences derived from this run's numbers, so that a re-run stays truthful."""

    def med(values: Sequence[float]) -> float:
        return statistics.median(values)

    def rate(name: str) -> float:
        return med(by_name[name].rates)

    def ratio(name: str) -> float:
        return med(speed[name])

    noise = max(abs(ratio(NOISE_FLOOR) - 1), 0.02) + max(speed[NOISE_FLOOR]) - min(speed[NOISE_FLOOR])
    base, auto, tune, threads = by_name[BASELINE], by_name[AUTO], by_name[TUNE], by_name[AUTO_THREADS]
    cores = available_cpus()
    load_ms = med(by_name[LOAD0].cpu_ms)  # CPU per sample of loading alone, in one process
    train_ms = med(by_name[CACHE0].cpu_ms)  # training + reading the cache: the main process's share
    ceiling = cores / (load_ms + train_ms) * 1e3  # every core busy, nothing else running
    ceiling_ratio = ceiling / rate(BASELINE)
    others = med(auto.others)
    extra_cpu = med(auto.cpu_ms) / med(base.cpu_ms)
    cpu_noise = abs(med(by_name[NOISE_FLOOR].cpu_ms) / med(base.cpu_ms) - 1)
    lines = [
        f"- The baseline is data-bound: `num_workers=0` trains {rate(BASELINE):,.0f} samples/s at "
        f"{med(base.cpu_ms):.2f} ms of CPU per sample, of which training (measured from the cache: the "
        f"same model, nothing to compute per item) is {train_ms:.3f} ms, "
        f"{100 * train_ms / med(base.cpu_ms):.0f}%. "
        f"The loader alone with 0 workers reads {rate(LOAD0):,.0f} samples/s.",
        f"- Ceiling on {cores} cores: loading costs {load_ms:.2f} ms of CPU per sample, training "
        f"{train_ms:.3f} ms; with every core on this run's work and nothing lost in hand-offs, at most "
        f"{cores} / {load_ms + train_ms:.2f} ms = {ceiling:,.0f} samples/s, {ceiling_ratio:.2f}x the "
        f"baseline. The {TARGET_AUTO}x target asks for {100 * TARGET_AUTO / ceiling_ratio:.0f}% of that "
        "ceiling: little room for other load on the machine or for the cost of worker processes.",
        f"- auto chose {counts(auto.used)} worker(s) and trained at {ratio(AUTO):.2f}x "
        f"[{min(speed[AUTO]):.2f} to {max(speed[AUTO]):.2f}] ({rate(AUTO):,.0f} samples/s, "
        f"{100 * rate(AUTO) / ceiling:.0f}% of the ceiling); the loader alone with the same workers read "
        f"{ratio(LOAD_AUTO):.2f}x. Over auto's windows this process and its workers kept "
        f"{med(auto.ours):.2f} cores busy (the main process {med(auto.main):.2f}), other processes "
        f"{others:.2f}. CPU per sample: {med(auto.cpu_ms):.2f} ms against {med(base.cpu_ms):.2f} ms with "
        f"`num_workers=0`, {100 * (extra_cpu - 1):+.0f}% ("
        + (
            "what running in worker processes adds: each batch copied into a shared-memory segment "
            "by its worker, its handle sent through a queue, the segment mapped by the main process"
            if abs(extra_cpu - 1) > 2 * cpu_noise
            else "within the noise"
        )
        + f"; the baseline's second copy differs from the first by {100 * cpu_noise:.0f}%).",
    ]
    quiet = quiet_ratios(auto, base, max_others)
    if ratio(AUTO) < TARGET_AUTO:
        per_core = ratio(AUTO) / (med(auto.ours) / med(base.ours))
        lines.append(
            f"- auto misses the target over all rounds. Other processes took {others:.2f} of the {cores} "
            f"cores during auto's windows (median): the workers can only use what is free. Per core of CPU "
            f"this run got ({med(auto.ours):.2f} against {med(base.ours):.2f} for the baseline), auto's "
            f"speed-up is {per_core:.2f}x. "
            + (
                f"In the rounds where the machine stayed quiet, auto reached {med(quiet):.2f}x "
                f"[{min(quiet):.2f} to {max(quiet):.2f}] ({len(quiet)} round(s))."
                if quiet
                else "No round was quiet: re-run on an idle machine before judging auto itself."
            )
        )
    elif quiet and min(quiet) < TARGET_AUTO:
        lines.append(
            f"- auto meets the target on the median, but not in every quiet round ({min(quiet):.2f}x at "
            f"worst): with {100 * TARGET_AUTO / ceiling_ratio:.0f}% of the ceiling to reach, a little "
            "noise is enough to fall under."
        )
    thread_gap = ratio(AUTO) - ratio(AUTO_THREADS)
    if thread_gap > noise:
        thread_text = (
            f"costs {100 * (1 - ratio(AUTO_THREADS) / ratio(AUTO)):.0f}% of auto's speed: the main "
            f"process kept {med(threads.main):.2f} cores busy against {med(auto.main):.2f} with one thread, "
            "for the same tiny model. That is OpenMP's spin-wait: after each parallel region torch's "
            "extra intra-op thread keeps spinning for a while instead of sleeping, on the cores the "
            "workers need (in a separate test, `OMP_WAIT_POLICY=passive` brought the main process back "
            "to the CPU of one thread, see benchmarks/README.md). With workers loading on every core, "
            "the main process should run one thread (`torch.set_num_threads(1)`, or "
            "`OMP_WAIT_POLICY=passive`)"
        )
    else:
        thread_text = (
            f"makes no difference beyond the noise ({ratio(AUTO_THREADS):.2f}x against {ratio(AUTO):.2f}x; "
            f"main process {med(threads.main):.2f} cores against {med(auto.main):.2f})"
        )
    lines.append(
        f"- torch's default {DEFAULT_THREADS} intra-op threads in the main process instead of 1, with auto's "
        f"workers: {thread_text}."
    )
    more = max(tune.used) > cores
    tune_seconds = med(tune.tune_seconds) if tune.tune_seconds else 0.0
    paired = [t / a for t, a in zip(tune.rates, auto.rates, strict=True)]
    versus = (
        f"{'faster' if med(paired) > 1 else 'slower'} than auto by {100 * abs(med(paired) - 1):.0f}% "
        f"(per round {min(paired):.2f} to {max(paired):.2f}x auto)"
        if abs(med(paired) - 1) > noise
        else f"as fast as auto within the noise ({med(paired):.2f}x auto)"
    )
    lines.append(
        f"- tune chose {counts(tune.used)} worker(s) and trained at {ratio(TUNE):.2f}x "
        f"[{min(speed[TUNE]):.2f} to {max(speed[TUNE]):.2f}], {versus}. Its trials took "
        f"{tune_seconds:.1f} s before the first step (start-up {med(tune.startups):.1f} s against "
        f"auto's {med(auto.startups):.2f} s): at "
        f"{rate(TUNE):,.0f} samples/s that is {tune_seconds * rate(TUNE):,.0f} samples of training, paid "
        "once per run (and again on every resume). "
        + (
            f"It picked more workers than the {cores} cores in {sum(n > cores for n in tune.used)} of "
            f"{len(tune.used)} rounds: it times loading alone, with the main process "
            "idle, and its candidates go up to twice the CPU count; torch then warns about the worker "
            "count on every such run (silenced in this script)."
            if more
            else ""
        )
    )
    build_seconds = build.seconds["train"]
    saved_per_sample = 1 / rate(BASELINE) - 1 / rate(CACHE0)
    lines.append(
        f"- The cache: {ratio(CACHE0):.1f}x with `num_workers=0` ({rate(CACHE0):,.0f} samples/s); auto "
        f"chose {counts(by_name[CACHE_AUTO].used)} worker(s) with it ({ratio(CACHE_AUTO):.1f}x); "
        f"{SHARE} workers, auto's share without the cache, {ratio(CACHE_N):.1f}x. Once an item "
        f"costs microseconds (the loader alone reads {rate(LOAD_CACHE0):,.0f} samples/s in the main process, "
        f"{rate(LOAD_CACHE_N):,.0f} through {SHARE} workers), handing each batch from a worker to the main "
        + (
            "process costs more than reading it: with a cache, `num_workers=0` is the faster choice here. "
            if rate(CACHE_N) < rate(CACHE0)
            else "process costs about as much as reading it. "
        )
        + "The train split's build "
        f"({build_seconds:.1f} s with {build.workers} workers) pays for itself against `num_workers=0` "
        f"after about {build_seconds / saved_per_sample:,.0f} samples "
        f"({build_seconds / saved_per_sample / build.items['train']:.1f} epochs of this data). A cache "
        "stores the items as loaded once: augmentation drawn at random per epoch is frozen in it unless it "
        "moves to `Task.augment` (slowdata's items are deterministic per index, so here the cache is exact)."
    )
    return lines


# ---------------------------------------------------------------------------------------
# Orchestration


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=120, help="steps per run without the cache (default 120)"
    )
    parser.add_argument(
        "--cache-steps", type=int, default=1000, help="steps per run from the cache (default 1000)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="first steps dropped (default 10)")
    parser.add_argument(
        "--cache-warmup", type=int, default=100, help="first steps dropped from the cache (default 100)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all rows (default 5)")
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.15,
        help="CPU cores other processes may take during a run before it is done again (default 0.15)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="times a run disturbed by other processes is done again (default 2)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        help="seconds to wait at most, before each run, for other processes to go quiet (default 30)",
    )
    parser.add_argument(
        "--patience",
        type=float,
        default=150.0,
        help="seconds in all for waiting and runs done again; then every run is kept (default 150)",
    )
    add_output_options(
        parser,
        "smoke run: 24 steps (240 from the cache), 2 rounds, no retries; writes only with --out",
        DEFAULT_OUT,
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.cache_steps, args.warmup, args.cache_warmup, args.rounds = 24, 240, 4, 24, 2
        args.retries, args.quiet_wait, args.patience = 0, 3.0, 10.0
    args.out = output_path(args, DEFAULT_OUT)
    if args.steps <= args.warmup + 1 or args.cache_steps <= args.cache_warmup + 1:
        parser.error("--steps must exceed --warmup + 1, and --cache-steps --cache-warmup + 1")
    if args.steps < min_tune_steps():
        parser.error(f"--steps must be at least {min_tune_steps()} here (num_workers=tune's trials)")
    if args.rounds < 1 or min(args.retries, args.quiet_wait, args.max_others, args.patience) < 0:
        parser.error("--rounds must be at least 1; --retries, --quiet-wait, --max-others, --patience >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path("/proc/stat").exists():
        raise SystemExit("data.py reads /proc for its CPU figures: Linux only")
    started = time.perf_counter()
    load_before = load_now()
    torch.set_num_threads(THREADS)
    warnings.filterwarnings("ignore", message=WORKER_WARNING)
    task = make_task()
    timed = settings()
    with tempfile.TemporaryDirectory(prefix="leantrain-data-cache-") as scratch:
        cache = Path(scratch) / "slowdata"
        build = build_cache(cache)
        print(f"cache built: {build.wall:.1f} s for the command, train split {build.seconds['train']:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
        # The cached dataset for the loader-alone rows, opened as fit opens it (the build is reused).
        cached, rebuilt = prepare_cache(
            task.train_data(), cache / "train", task_source(task, "train"), "train_data"
        )
        if rebuilt is not None:
            raise RuntimeError("the cache built by `leantrain cache` was rebuilt: its fingerprint differs")
        datasets = {False: task.train_data(), True: cached}
        measure(timed, task, datasets, args, cache)
        del cached, datasets
    minutes = (time.perf_counter() - started) / 60
    table = render(timed, build, args, load_before, minutes)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
