"""Data-parallel throughput on the CPU: one process against two, and what the all-reduce costs.

Two measurements, both with one intra-op thread per process (``OMP_NUM_THREADS=1``):

1. Throughput. ``leantrain fit`` (one process) and ``leantrain launch --nproc-per-node 2 fit``
   (two processes, DDP over gloo) train the same task with the same micro-batch and
   accumulation per process; samples/s is read from the per-window rows of ``metrics.csv``,
   the first window (warm-up) dropped. One process with two threads is a reference row: on a
   two-core machine it is the other way to use both cores.
2. Communication. A probe, this file started by torchrun with ``--comm-probe``, wraps the same
   models in ``DistributedDataParallel`` and times optimizer steps in three modes, interleaved:
   every micro-batch under ``no_sync()`` (no communication at all: the compute-only reference),
   ``no_sync()`` on all but the final micro-batch (leantrain's way: one all-reduce per step),
   and no ``no_sync()`` (an all-reduce after every micro-batch). The exposed communication time
   of a mode is its step time minus the compute-only step time of the same round. A bare
   ``dist.all_reduce`` of a flat fp32 tensor with the model's parameter count is timed too.

Runs are repeated and interleaved in a rotating order, and the probe runs a few rounds after
every repetition, so that slow drift of a noisy machine hits every configuration alike; the
tables give medians.

    python benchmarks/ddp.py            # full run (about 5 minutes on 2 cores); writes results/ddp.md
    python benchmarks/ddp.py --quick    # smoke run; prints the tables only
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, TensorDataset, default_collate

import leantrain as lt
from _common import add_output_options, load_now, output_path, publish
from leantrain.examples.charlm import CharLMTask

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "ddp.md"
MICRO_BATCH = 16
ACCUMULATIONS = (4, 1)
# Every run does the same number of micro-batches per process and window, whatever the
# accumulation, so that windows last about as long (half a second here) in every row. It
# must be a multiple of every accumulation.
MICRO_BATCHES_PER_WINDOW = 8
SEED = 0
PROBE_NPROC = 2

# The probe's modes: which micro-batches of an optimizer step run with gradient sync.
LOCAL, ONCE, EVERY = "local", "once", "every"
MODE_TEXT = {
    LOCAL: "no communication (every micro-batch under no_sync; reference only)",
    ONCE: "no_sync on non-final micro-batches (leantrain)",
    EVERY: "without no_sync (all-reduce after every micro-batch)",
}


# ---------------------------------------------------------------------------------------
# Tasks: importable as ``ddp:CharLM`` and ``ddp:WideMLP`` with benchmarks/ on PYTHONPATH


class CharLM:
    """leantrain's ``charlm`` example at its default size, without validation data.

    The example validates once at the end of each run; that costs seconds per run and is no
    part of the training throughput measured here, so this task leaves ``val_data`` out.
    """

    def __init__(self) -> None:
        self.inner = CharLMTask()

    def model(self) -> nn.Module:
        return self.inner.model()

    def train_data(self) -> Dataset:
        return self.inner.train_data()

    def loss(self, model: nn.Module, batch: Any) -> lt.LossSum:
        return self.inner.loss(model, batch)

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.inner.optimizer(params)


class WideMLP:
    """A wide MLP on random features: many parameters for little compute per sample.

    charlm spends its time in attention and small matrix products on 64 positions per sample
    and has few parameters, so its all-reduce is cheap next to its compute. Here every weight
    is used once per sample: the gradient to all-reduce is about 22 times larger while a
    micro-batch computes about as long, so communication takes a large share of the step.
    """

    FEATURES, HIDDEN, CLASSES, SAMPLES = 256, 4096, 10, 4096

    def model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(self.FEATURES, self.HIDDEN),
            nn.ReLU(),
            nn.Linear(self.HIDDEN, self.HIDDEN),
            nn.ReLU(),
            nn.Linear(self.HIDDEN, self.CLASSES),
        )

    def train_data(self) -> Dataset:
        generator = torch.Generator().manual_seed(1234)
        features = torch.randn(self.SAMPLES, self.FEATURES, generator=generator)
        labels = torch.randint(0, self.CLASSES, (self.SAMPLES,), generator=generator)
        return TensorDataset(features, labels)

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        features, labels = batch
        return F.cross_entropy(model(features), labels)

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)


@dataclass(frozen=True)
class ModelSpec:
    title: str
    task: str  # the --task argument
    factory: Callable[[], Any]


MODELS = {
    "charlm": ModelSpec("charlm (example default: 4 layers, width 128, AdamW)", "ddp:CharLM", CharLM),
    "wide-mlp": ModelSpec("wide MLP 256-4096-4096-10 (SGD with momentum)", "ddp:WideMLP", WideMLP),
}


def parameter_count(model: nn.Module) -> int:
    # parameters() lists tied weights once (charlm ties its embedding and output head),
    # which is also what DDP all-reduces.
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------
# Throughput: leantrain runs as subprocesses


@dataclass(frozen=True)
class Config:
    model: str
    processes: int
    threads: int  # intra-op threads per process
    accumulation: int

    @property
    def global_batch(self) -> int:
        return MICRO_BATCH * self.accumulation * self.processes

    @property
    def steps_per_window(self) -> int:
        return MICRO_BATCHES_PER_WINDOW // self.accumulation

    def label(self) -> str:
        return f"{self.model} {self.processes}p x {self.threads}t {MICRO_BATCH}x{self.accumulation}"


def configs() -> list[Config]:
    rows = []
    for model in MODELS:
        rows += [
            Config(model, 1, 1, 4),
            Config(model, 2, 1, 4),
            Config(model, 1, 2, 4),  # the reference: both cores in one process
            Config(model, 1, 1, 1),
            Config(model, 2, 1, 1),
        ]
    return rows


def fit_arguments(config: Config, out_dir: Path, windows: int) -> list[str]:
    """The leantrain command line after the program name."""
    fit = [
        "fit",
        "--task",
        MODELS[config.model].task,
        "--global-batch-size",
        str(config.global_batch),
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--max-steps",
        str(windows * config.steps_per_window),
        "--log-every-n-steps",
        str(config.steps_per_window),
        "--device",
        "cpu",
        "--seed",
        str(SEED),
        "--progress",
        "none",
        "--logger",
        "none",
        "--out",
        str(out_dir),
    ]
    launcher = ["launch", "--nproc-per-node", str(config.processes)] if config.processes > 1 else []
    return [*launcher, *fit]


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    # Set explicitly for every run: torchrun sets OMP_NUM_THREADS=1 only when it is unset and
    # starts several processes, and a plain `leantrain fit` would use every core.
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    # The tasks are this module, imported as `ddp` by leantrain's --task loader.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR), env.get("PYTHONPATH")) if p)
    return env


def run_checked(command: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"{what} failed with exit status {done.returncode}:\n{tail}")


def window_speeds(metrics_csv: Path) -> list[float]:
    """samples/s of each log window, the first (imports, allocator and thread-pool warm-up) dropped."""
    with metrics_csv.open(newline="") as file:
        rows = [row["samples_per_second"] for row in csv.DictReader(file)]
    # The final validation, when a task has one, writes a row without samples_per_second.
    return [float(speed) for speed in rows if speed][1:]


def run_leantrain(config: Config, scratch: Path, windows: int, run_index: int) -> float:
    """One leantrain run; the median samples/s over its windows."""
    out_dir = scratch / f"run-{run_index}"
    command = [sys.executable, "-m", "leantrain", *fit_arguments(config, out_dir, windows)]
    run_checked(command, child_env(config.threads), f"leantrain run {config.label()}")
    speeds = window_speeds(out_dir / "metrics.csv")
    if len(speeds) != windows - 1:
        raise RuntimeError(f"{config.label()}: expected {windows - 1} timed windows, got {len(speeds)}")
    return statistics.median(speeds)


# ---------------------------------------------------------------------------------------
# Communication: the probe, run by torchrun in PROBE_NPROC processes


def backward_term(loss: torch.Tensor | lt.LossSum) -> torch.Tensor:
    # leantrain scales the gradients of a LossSum once per step, after one more (scalar)
    # all-reduce of the counts; the scaling does not change what is timed here.
    return loss.sum if isinstance(loss, lt.LossSum) else loss


def timed_step(
    ddp: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    task: Any,
    batches: Sequence[Any],
    mode: str,
) -> float:
    """Seconds of one optimizer step on this rank: forward and backward per micro-batch, update."""
    # Both ranks start the step together, so that one rank's wait for the other in the
    # all-reduce is a cost of the step, not of the step before.
    dist.barrier()
    started = time.perf_counter()
    last = len(batches) - 1
    for index, batch in enumerate(batches):
        sync = mode == EVERY or (mode == ONCE and index == last)
        # As in leantrain, forward and backward are both inside no_sync.
        with nullcontext() if sync else ddp.no_sync():
            backward_term(task.loss(ddp, batch)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def slowest_rank(local: list[float]) -> list[float]:
    """Per entry, the maximum over ranks: a data-parallel step lasts as long as its slowest rank."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return [max(values) for values in zip(*gathered, strict=True)]


def probe_model(spec: ModelSpec, rounds: int) -> dict[str, Any]:
    task = spec.factory()
    torch.manual_seed(SEED)
    model = task.model()
    ddp = DistributedDataParallel(model)
    optimizer = task.optimizer(model.parameters())
    params = parameter_count(model)
    data = task.train_data()
    rank = dist.get_rank()
    # Fixed micro-batches, different on each rank (as the data-parallel split gives them).
    per_rank = MICRO_BATCH * max(ACCUMULATIONS)
    micro_batches = [
        default_collate([data[rank * per_rank + start + i] for i in range(MICRO_BATCH)])
        for start in range(0, per_rank, MICRO_BATCH)
    ]
    result: dict[str, Any] = {"params": params, "steps": {}}
    for accumulation in ACCUMULATIONS:
        batches = micro_batches[:accumulation]
        # With one micro-batch per step, "once" and "every" are the same thing.
        modes = [LOCAL, ONCE, EVERY] if accumulation > 1 else [LOCAL, ONCE]
        for mode in modes:  # untimed: first allocations, DDP's first-iteration bookkeeping
            timed_step(ddp, optimizer, task, batches, mode)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for round_index in range(rounds):
            shift = round_index % len(modes)  # rotate: no mode always runs first
            for mode in modes[shift:] + modes[:shift]:
                times[mode].append(timed_step(ddp, optimizer, task, batches, mode))
        result["steps"][str(accumulation)] = {mode: slowest_rank(values) for mode, values in times.items()}
    flat = torch.zeros(params)
    bare: list[float] = []
    for _ in range(max(rounds, 5)):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(flat)
        bare.append(time.perf_counter() - started)
    result["bare_all_reduce"] = slowest_rank(bare)
    return result


def comm_probe(rounds: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = {name: probe_model(spec, rounds) for name, spec in MODELS.items()}
        if dist.get_rank() == 0:
            out.write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def probe_command(rounds: int, out: Path) -> list[str]:
    return [
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(PROBE_NPROC)),
        str(Path(__file__).resolve()),
        *("--comm-probe", "--rounds", str(rounds), "--probe-out", str(out)),
    ]


def run_probe(rounds: int, scratch: Path) -> dict[str, Any]:
    out = scratch / "probe.json"
    out.unlink(missing_ok=True)
    run_checked([sys.executable, *probe_command(rounds, out)], child_env(1), "communication probe")
    return json.loads(out.read_text())


@dataclass
class ProbeSummary:
    """The probe's medians for one model and accumulation (seconds)."""

    step: dict[str, float]  # median step time per mode
    comm: dict[str, float]  # median over rounds of (mode - local) per mode
    spread: dict[str, tuple[float, float]]  # first and third quartile of (mode - local)

    def comm_is_noise(self, mode: str) -> bool:
        """Whether the middle half of the paired differences includes zero.

        A small all-reduce (charlm's 3 MB) costs a few milliseconds, less than the
        round-to-round jitter of a step of a few hundred: its median can even come out negative.
        """
        low, high = self.spread[mode]
        return low <= 0 <= high


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    first, _, third = statistics.quantiles(values, n=4)
    return first, third


def summarize_probe(steps: dict[str, list[float]]) -> ProbeSummary:
    local = steps[LOCAL]
    # Paired per round: the mode's step minus the compute-only step of the same round.
    differences = {
        mode: [m - c for m, c in zip(values, local, strict=True)] for mode, values in steps.items()
    }
    return ProbeSummary(
        step={mode: statistics.median(values) for mode, values in steps.items()},
        comm={mode: statistics.median(values) for mode, values in differences.items()},
        spread={mode: quartiles(values) for mode, values in differences.items()},
    )


# ---------------------------------------------------------------------------------------
# Orchestration and report


@dataclass
class Measured:
    config: Config
    speeds: list[float] = field(default_factory=list)  # one median samples/s per run

    @property
    def speed(self) -> float:
        return statistics.median(self.speeds)


def merge_probe(total: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """Append one probe run's timings to the previous ones (the rounds stay paired by index)."""
    if total is None:
        return part
    for name, result in part.items():
        for accumulation, steps in result["steps"].items():
            for mode, values in steps.items():
                total[name]["steps"][accumulation][mode] += values
        total[name]["bare_all_reduce"] += result["bare_all_reduce"]
    return total


def measure(
    repetitions: int, windows: int, rounds: int, scratch: Path
) -> tuple[list[Measured], dict[str, Any]]:
    """The leantrain rows and the probe's timings, ``repetitions`` interleaved passes of both."""
    measured = [Measured(config) for config in configs()]
    probe: dict[str, Any] | None = None
    run_index = 0
    for repetition in range(repetitions):
        # Rotate by a step that is not a multiple of a model's row count, so that over the
        # repetitions each row sits next to different neighbours.
        shift = (repetition * 3) % len(measured)
        for entry in measured[shift:] + measured[:shift]:
            run_index += 1
            speed = run_leantrain(entry.config, scratch, windows, run_index)
            entry.speeds.append(speed)
            print(
                f"repetition {repetition + 1}/{repetitions}  {entry.config.label():<32} "
                f"{speed:9.1f} samples/s",
                file=sys.stderr,
                flush=True,
            )
        # A few probe rounds per repetition rather than all at the end: the machine's speed
        # drifts over minutes, and the probe's step times should see the same drift as the rows.
        print(f"repetition {repetition + 1}/{repetitions}  communication probe", file=sys.stderr, flush=True)
        probe = merge_probe(probe, run_probe(rounds, scratch))
    assert probe is not None
    return measured, probe


def speed_cell(entry: Measured) -> str:
    if len(entry.speeds) == 1:
        return f"{entry.speed:.0f}"
    return f"{entry.speed:.0f} [{min(entry.speeds):.0f}-{max(entry.speeds):.0f}]"


def render(
    measured: list[Measured],
    probe: dict[str, Any],
    repetitions: int,
    windows: int,
    probe_rounds: int,
    load_before: str,
    minutes: float,
) -> str:
    summaries = {
        (name, int(acc)): summarize_probe(steps)
        for name, result in probe.items()
        for acc, steps in result["steps"].items()
    }
    baseline = {
        (m.config.model, m.config.accumulation): m.speed
        for m in measured
        if m.config.processes == 1 and m.config.threads == 1
    }
    example = Config("charlm", 2, 1, 4)
    example_command = shlex.join(["leantrain", *fit_arguments(example, Path("DIR"), windows)])
    probe_line = shlex.join(["python", *probe_command(probe_rounds, Path("probe.json"))]).replace(
        str(BENCH_DIR.parent) + os.sep, ""
    )
    lines = [
        "# Data-parallel throughput on the CPU: 1 process vs 2 (DDP, gloo)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} CPU cores visible, Python {platform.python_version()}; "
        f"load average before / after: {load_before} / {load_now()}; the full run took {minutes:.1f} min",
        f"- Versions: torch {torch.__version__}, leantrain {lt.__version__}",
        "- Models: "
        + "; ".join(
            f"**{name}**: {spec.title}, {probe[name]['params']:,} parameters "
            f"({probe[name]['params'] * 4 / 1e6:.1f} MB of fp32 gradients per all-reduce)"
            for name, spec in MODELS.items()
        ),
        f"- Threads: `OMP_NUM_THREADS=1` per process (the fair comparison on {os.cpu_count()} cores: "
        "1 core against 2); the row *1 x 2 threads* is one process using both cores, for reference.",
        f"- Batches: micro-batch {MICRO_BATCH} per process; *micro x acc* is per process, so the "
        "global batch is micro x acc x processes (two processes train twice the samples per step).",
        "- samples/s: `leantrain fit` / `leantrain launch --nproc-per-node 2 fit` as subprocesses, "
        f"{windows} log windows of {MICRO_BATCHES_PER_WINDOW} micro-batches per process each; a run's "
        "speed is the median of its windows' `samples_per_second` in `metrics.csv`, the first window "
        f"(warm-up) dropped. {repetitions} repetitions, all rows interleaved in a rotating order; the "
        "table gives the median over repetitions, the range in brackets. Speed-up: against 1 process x "
        "1 thread with the same model and micro x acc.",
        "- Comm: from the in-process probe (below) with the same model, micro-batch and accumulation: "
        "step time with leantrain's no_sync minus step time with no communication at all, median over "
        f"{probe_rounds * repetitions} paired rounds; share = comm / the probe's step time; "
        "*≈ 0* where the quartiles of the paired differences include zero. Example command: "
        f"`OMP_NUM_THREADS=1 PYTHONPATH=benchmarks {example_command}`",
        "",
        "| Model | Params | Processes x threads | Micro x acc | Global batch | samples/s | Speed-up "
        "| Comm s / step | Comm share of step |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for entry in measured:
        config = entry.config
        params = probe[config.model]["params"]
        if config.processes > 1:
            summary = summaries[(config.model, config.accumulation)]
            comm = summary.comm[ONCE]
            noise = " (≈ 0: within the noise)" if summary.comm_is_noise(ONCE) else ""
            comm_cells = f"{comm:.3f}{noise} | {comm / summary.step[ONCE]:.0%}"
        else:
            comm_cells = "- | -"
        speedup = entry.speed / baseline[(config.model, config.accumulation)]
        lines.append(
            f"| {config.model} | {params / 1e6:.2f} M | {config.processes} x {config.threads} "
            f"| {MICRO_BATCH} x {config.accumulation} | {config.global_batch} | {speed_cell(entry)} "
            f"| {speedup:.2f} | {comm_cells} |"
        )
    lines += [
        "",
        "## Gradient communication, in-process probe (2 processes x 1 thread, DDP over gloo)",
        "",
        f"- Command: `OMP_NUM_THREADS=1 {probe_line}`, started by `benchmarks/ddp.py` once per "
        f"repetition ({repetitions} run(s), timings pooled). Each "
        "process wraps the model in `DistributedDataParallel` (default 25 MB buckets) and times "
        "whole optimizer steps (forward + backward of every micro-batch, optimizer step, zero_grad) "
        f"after a `dist.barrier()`, the slowest rank's time per step; {probe_rounds} rounds per run, "
        "modes interleaved in a rotating order, one untimed step per mode first.",
        f"- Modes: *{MODE_TEXT[LOCAL]}*; *{MODE_TEXT[ONCE]}*; *{MODE_TEXT[EVERY]}*. Comm = the "
        "mode's step minus the no-communication step of the same round: the communication time "
        "that backward does not hide; median, and in brackets the first and third quartiles over "
        "rounds.",
        "- samples/s = global batch (micro x acc x 2) / median step time.",
        "",
        "| Model | Micro x acc | Mode | All-reduces / step | Gradient bytes / step | Step (ms) | samples/s "
        "| Comm ms / step | Comm share |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in MODELS:
        params = probe[name]["params"]
        for accumulation in ACCUMULATIONS:
            summary = summaries[(name, accumulation)]
            for mode, step in summary.step.items():
                reduces = {LOCAL: 0, ONCE: 1, EVERY: accumulation}[mode]
                low, high = summary.spread[mode]
                comm = summary.comm[mode]
                comm_cells = (
                    "- | -"
                    if mode == LOCAL
                    else f"{comm * 1e3:.1f} [{low * 1e3:.1f} to {high * 1e3:.1f}] | {comm / step:.0%}"
                )
                samples = MICRO_BATCH * accumulation * PROBE_NPROC
                lines.append(
                    f"| {name} | {MICRO_BATCH} x {accumulation} | {MODE_TEXT[mode]} | {reduces} "
                    f"| {reduces * params * 4 / 1e6:.1f} MB | {step * 1e3:.1f} | {samples / step:.0f} "
                    f"| {comm_cells} |"
                )
    lines += ["", "Bare `dist.all_reduce` of one flat fp32 tensor with the model's parameter count:", ""]
    for name in MODELS:
        params = probe[name]["params"]
        seconds = statistics.median(probe[name]["bare_all_reduce"])
        lines.append(
            f"- {name}: {params * 4 / 1e6:.1f} MB in {seconds * 1e3:.1f} ms "
            f"({params * 4 / seconds / 1e9:.2f} GB/s of gradient per second)"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=3, help="runs of every row (default 3)")
    parser.add_argument("--windows", type=int, default=6, help="log windows per run, 1 dropped (default 6)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="probe rounds per repetition, model and mode (default 3)"
    )
    add_output_options(parser, "smoke run: 1 repetition, 3 windows; writes only with --out", DEFAULT_OUT)
    # Internal: the probe's worker mode, started by torchrun.
    parser.add_argument("--comm-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repetitions, args.windows, args.rounds = 1, 3, 2
    args.out = output_path(args, DEFAULT_OUT)
    if any(MICRO_BATCHES_PER_WINDOW % accumulation for accumulation in ACCUMULATIONS):
        parser.error(
            f"MICRO_BATCHES_PER_WINDOW={MICRO_BATCHES_PER_WINDOW} must be a multiple of {ACCUMULATIONS}"
        )
    if args.windows < 2:
        parser.error("--windows must be at least 2 (the first is dropped)")
    if args.repetitions < 1 or args.rounds < 1:
        parser.error("--repetitions and --rounds must be at least 1")
    if args.comm_probe and args.probe_out is None:
        parser.error("--comm-probe needs --probe-out")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.comm_probe:
        comm_probe(args.rounds, args.probe_out)
        return 0
    started = time.perf_counter()
    load_before = load_now()
    with tempfile.TemporaryDirectory(prefix="leantrain-ddp-bench-") as scratch:
        measured, probe = measure(args.repetitions, args.windows, args.rounds, Path(scratch))
    minutes = (time.perf_counter() - started) / 60
    table = render(measured, probe, args.repetitions, args.windows, args.rounds, load_before, minutes)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
