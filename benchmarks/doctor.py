"""The doctor's overhead on a clean task: its timed step against the same step of a plain ``fit``.

``leantrain.diagnose.run_doctor`` trains warm-up steps, then timed steps (only the phase
timer's wrappers are active: a few clock reads per micro-batch), then 2 audited steps (slow,
not timed), through the same ``leantrain.Trainer`` as a plain fit. The claim under test: on
a clean, compute-bound task, the doctor's step time is within 10% of plain ``fit``'s.

Both sides train the same built-in example with the same ``TrainConfig`` and as many steps
(warm-up + timed + 2). Plain ``fit`` is timed by an ``on_step`` callback that stamps
``time.perf_counter()`` at every step end; its step ``k`` is the gap between the stamps of
steps ``k - 1`` and ``k``, exactly what the doctor's timer records for its timed steps
(``Diagnosis.step_phases``, each row's ``total``). A run's step time is the median over the
timed steps (the mean is shown too: ``Diagnosis.phases["total"]`` is a mean). Plain, doctor
and plain again (the noise floor) run interleaved in one process, several rounds in a rotating
order; only the side-by-side ratios are meant to be compared across machines.

    python benchmarks/doctor.py            # full run (about 3-4 minutes on 2 cores); writes results/doctor.md
    python benchmarks/doctor.py --quick    # smoke run (under a minute); prints the table only
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import leantrain as lt
from _common import add_output_options, cpu_model, load_now, output_path, publish, ranged
from leantrain.diagnose import Diagnosis, run_doctor
from leantrain.examples import load_example

EXAMPLES = ("charlm", "digits")  # clean, compute-bound: no host syncs, no slow data
# Timed steps per run, by example: charlm's step is about 25x digits'.
DEFAULT_STEPS = {"charlm": 14, "digits": 150}
QUICK_STEPS = {"charlm": 8, "digits": 40}
AUDITED = 2  # the doctor's audited steps after the timed ones: the plain run trains as many
THREADS = 1
SEED = 0
LOG_EVERY = 1_000_000  # more than the steps of a run: the only log point is the last step, as in the doctor
TARGET = 1.10  # the doctor's median step / plain fit's, at most
PLAIN, DOCTOR, NOISE_FLOOR = "plain fit", "doctor", "plain fit, again"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "doctor.md"


class CpuClock:
    """Replaces a task's ``loss``: stamps the process's CPU time as each forward starts.

    The doctor takes no callback of ours, so its CPU time per step is read here, the same way
    for both sides: the gap between the starts of consecutive steps' forwards (one micro-batch
    per step). CPU time is what other processes competing for the cores do not stretch.
    """

    def __init__(self, loss: Any) -> None:
        self.loss = loss
        self.stamps: list[float] = []

    def __call__(self, model: Any, batch: Any) -> Any:
        self.stamps.append(time.process_time())
        return self.loss(model, batch)

    def step_seconds(self, steps: int, warmup: int) -> list[float]:
        """CPU seconds from the start of step k to that of step k + 1, k = warmup + 1 .. warmup + steps - 1.

        All inside the timed steps: the doctor's audited modes start after step warmup + steps, and
        the gap from that step to the next also loads the next batch under them.
        """
        starts = self.stamps[warmup : warmup + steps]
        return [later - earlier for earlier, later in itertools.pairwise(starts)]


def make_task(example: str) -> tuple[Any, CpuClock]:
    """The example without validation data (no part of a step; the doctor skips it too), stamped."""
    task = load_example(example)
    task.val_data = None  # leantrain validates only when the task's val_data is callable
    clock = CpuClock(task.loss)
    task.loss = clock
    return task, clock


def make_config(total_steps: int, out_dir: str) -> lt.TrainConfig:
    """The same settings for both sides (the doctor overrides ``max_steps`` with its own schedule)."""
    return lt.TrainConfig(
        max_steps=total_steps,
        seed=SEED,
        device="cpu",
        out_dir=out_dir,
        log_every_n_steps=LOG_EVERY,
        progress="none",
        logger="none",
    )


class StepClock:
    """leantrain callback: a ``perf_counter()`` stamp at every step end, by step number (1-based)."""

    def __init__(self) -> None:
        self.stamps: dict[int, float] = {}

    def on_step(self, stats: lt.StepStats) -> None:
        self.stamps[stats.step] = time.perf_counter()


def run_plain(example: str, task: Any, steps: int, warmup: int) -> tuple[list[float], float]:
    """(seconds of steps ``warmup + 1 .. warmup + steps``, wall seconds of the whole ``fit``)."""
    clock = StepClock()
    # The run folder (metrics.csv, checkpoint, weights) goes to a scratch directory.
    with tempfile.TemporaryDirectory(prefix="leantrain-doctor-bench-") as scratch:
        config = make_config(warmup + steps + AUDITED, str(Path(scratch) / "run"))
        started = time.perf_counter()
        lt.Trainer(config, callbacks=[clock]).fit(task, name=example)
        wall = time.perf_counter() - started
    gaps = [clock.stamps[k] - clock.stamps[k - 1] for k in range(warmup + 1, warmup + steps + 1)]
    return gaps, wall


def run_diagnosis(example: str, task: Any, steps: int, warmup: int) -> tuple[list[float], float, Diagnosis]:
    """(the doctor's timed step seconds, wall seconds of ``run_doctor``, the diagnosis)."""
    with tempfile.TemporaryDirectory(prefix="leantrain-doctor-bench-") as scratch:
        config = make_config(warmup + steps + AUDITED, str(Path(scratch) / "run"))
        started = time.perf_counter()
        diagnosis = run_doctor(task, config, steps=steps, warmup=warmup, name=example)
        wall = time.perf_counter() - started
    totals = [row["total"] for row in diagnosis.step_phases]
    if len(totals) != steps:
        raise RuntimeError(f"the doctor timed {len(totals)} steps of {example}, expected {steps}")
    return totals, wall, diagnosis


# ---------------------------------------------------------------------------------------
# Measuring


@dataclass
class Side:
    name: str
    medians: list[float] = field(default_factory=list)  # wall seconds per step, one per round
    means: list[float] = field(default_factory=list)
    cpu_medians: list[float] = field(default_factory=list)  # CPU seconds per step, one per round
    walls: list[float] = field(default_factory=list)  # seconds of the whole call
    diagnosis: Diagnosis | None = None  # the doctor's last

    def series(self, kind: str) -> list[float]:
        return {"median": self.medians, "mean": self.means, "cpu": self.cpu_medians}[kind]


@dataclass
class Example:
    name: str
    steps: int
    sides: list[Side]
    parameters: int = 0
    batch: int = 0
    train_items: int = 0

    def side(self, name: str) -> Side:
        return next(side for side in self.sides if side.name == name)

    def ratios(self, name: str, kind: str = "median") -> list[float]:
        """Per round, ``name``'s step time (median, mean or cpu) over plain fit's in the same round."""
        mine, base = self.side(name).series(kind), self.side(PLAIN).series(kind)
        return [a / b for a, b in zip(mine, base, strict=True)]


def run_side(example: str, task: Any, side: str, steps: int, warmup: int) -> tuple[list[float], float, Any]:
    if side == DOCTOR:
        return run_diagnosis(example, task, steps, warmup)
    gaps, wall = run_plain(example, task, steps, warmup)
    return gaps, wall, None


def measure(entry: Example, task: Any, clock: CpuClock, rounds: int, warmup: int) -> None:
    # One short untimed run of each side first: lazy initialisation (oneDNN kernels for each
    # shape, first allocations, the doctor's imports) would otherwise land in round 1.
    for side in (PLAIN, DOCTOR):
        torch.set_num_threads(THREADS)
        run_side(entry.name, task, side, 2, 1)
    for round_index in range(rounds):
        shift = round_index % len(entry.sides)  # no side always first or last
        for side in entry.sides[shift:] + entry.sides[:shift]:
            gc.collect()
            torch.set_num_threads(THREADS)
            clock.stamps.clear()
            seconds, wall, diagnosis = run_side(entry.name, task, side.name, entry.steps, warmup)
            if len(clock.stamps) != warmup + entry.steps + AUDITED:  # one micro-batch, one loss call per step
                raise RuntimeError(
                    f"{side.name} called the loss {len(clock.stamps)} times, expected one per step"
                )
            side.medians.append(statistics.median(seconds))
            side.means.append(statistics.fmean(seconds))
            side.cpu_medians.append(statistics.median(clock.step_seconds(entry.steps, warmup)))
            side.walls.append(wall)
            if diagnosis is not None:
                side.diagnosis = diagnosis
            print(
                f"{entry.name} round {round_index + 1}/{rounds}  {side.name:<18} "
                f"median {side.medians[-1] * 1e3:8.2f} ms/step, mean {side.means[-1] * 1e3:8.2f}, "
                f"CPU {side.cpu_medians[-1] * 1e3:8.2f}, run {wall:5.1f} s",
                file=sys.stderr,
                flush=True,
            )
    torch.set_num_threads(THREADS)


def describe(entry: Example, task: Any) -> None:
    """Parameters, global batch and training items of the example, for the report."""
    entry.parameters = sum(p.numel() for p in task.model().parameters())
    entry.batch = lt.TrainConfig().global_batch_size
    entry.train_items = len(task.train_data())


# ---------------------------------------------------------------------------------------
# Report


def verdict(entry: Example) -> tuple[bool, float]:
    ratio = statistics.median(entry.ratios(DOCTOR))
    return ratio <= TARGET, ratio


def example_section(entry: Example, rounds: int, warmup: int) -> list[str]:
    plain, doctor, again = (entry.side(name) for name in (PLAIN, DOCTOR, NOISE_FLOOR))
    lines = [
        f"## `{entry.name}`",
        "",
        f"- {entry.parameters:,} parameters, global batch {entry.batch} in one micro-batch, "
        f"{entry.train_items:,} training items; {warmup} warm-up + {entry.steps} timed + {AUDITED} "
        f"more steps per run, {rounds} rounds.",
        "",
        "| Side | Median step (ms) | vs plain fit | Mean step (ms) | Mean vs plain fit "
        "| CPU per step (ms) | CPU vs plain fit | Whole call (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side in entry.sides:
        is_base = side.name == PLAIN
        ratio, mean_ratio, cpu_ratio = (
            "1.000" if is_base else ranged(entry.ratios(side.name, kind), 3)
            for kind in ("median", "mean", "cpu")
        )
        lines.append(
            f"| {side.name} | {ranged([m * 1e3 for m in side.medians], 2)} | {ratio} "
            f"| {statistics.median(side.means) * 1e3:.2f} | {mean_ratio} "
            f"| {statistics.median(side.cpu_medians) * 1e3:.2f} | {cpu_ratio} "
            f"| {statistics.median(side.walls):.2f} |"
        )
    lines += [
        "",
        "Per round (median step, ms; the order rotates each round):",
        "",
        "| Round | Plain fit | Doctor | Doctor / plain | Plain again | Plain again / plain "
        "| CPU: doctor / plain | CPU: plain again / plain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios, floors = entry.ratios(DOCTOR), entry.ratios(NOISE_FLOOR)
    cpu_ratios, cpu_floors = entry.ratios(DOCTOR, "cpu"), entry.ratios(NOISE_FLOOR, "cpu")
    for index in range(rounds):
        lines.append(
            f"| {index + 1} | {plain.medians[index] * 1e3:.2f} | {doctor.medians[index] * 1e3:.2f} "
            f"| {ratios[index]:.3f} | {again.medians[index] * 1e3:.2f} | {floors[index]:.3f} "
            f"| {cpu_ratios[index]:.3f} | {cpu_floors[index]:.3f} |"
        )
    if doctor.diagnosis is not None:
        phases = doctor.diagnosis.phases
        shown = ", ".join(
            f"{name} {seconds * 1e3:.2f}"
            for name, seconds in phases.items()
            if name != "total" and seconds > 0
        )
        lines += [
            "",
            f"The doctor's phases (last run, mean ms per timed step): {shown}; total "
            f"{phases['total'] * 1e3:.2f}. Verdict: {doctor.diagnosis.verdict}",
        ]
    met, ratio = verdict(entry)
    lines += [
        "",
        f"Target: doctor / plain fit <= {TARGET:.2f} (median step): {'met' if met else '**NOT met**'}, "
        f"{ranged(ratios, 3)} (noise floor: plain again / plain {ranged(floors, 3)}; "
        f"doctor - floor {ratio - statistics.median(floors):+.3f}). CPU time: doctor / plain "
        f"{ranged(cpu_ratios, 3)}, noise floor {ranged(cpu_floors, 3)}.",
        "",
    ]
    return lines


def render(entries: list[Example], rounds: int, warmup: int, load_before: str, minutes: float) -> str:
    lines = [
        "# The doctor's overhead on a clean task: `run_doctor` vs plain `fit`",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPU cores visible, Python {platform.python_version()}; "
        "load average before / after: "
        f"{load_before} / {load_now()}; the full run took {minutes:.1f} min",
        f"- Versions: torch {torch.__version__}, leantrain {lt.__version__}",
        f"- Threads: `torch.set_num_threads({THREADS})` for every run (stable timings on a shared machine)",
        f"- Work: the built-in examples `{'`, `'.join(EXAMPLES)}` (`leantrain.examples.load_example`), "
        "validation left out (the doctor skips it; it is no part of a step), fp32 on the CPU, "
        f'`TrainConfig(max_steps=warm-up + timed + {AUDITED}, seed={SEED}, device="cpu", '
        f'log_every_n_steps={LOG_EVERY:_}, progress="none", logger="none")` (global batch: the '
        "default), the same for both sides. *Plain fit*: `Trainer(config, callbacks=[clock]).fit(task)`, "
        "`clock.on_step` stamping `time.perf_counter()` at every step end. *Doctor*: "
        "`run_doctor(task, config, steps=timed, warmup=warm-up)`, which trains through the same "
        f"`Trainer` with its probe (phase timer only in the timed steps, then {AUDITED} audited steps, "
        "slow, not timed).",
        "- Method: the same steps on both sides, warm-up + 1 to warm-up + timed. Plain fit: the gap "
        'between the stamps of step k - 1 and step k; doctor: `Diagnosis.step_phases[i]["total"]`, '
        "which its timer measures the same way (from one step end to the next). A run's step time is "
        "the median over its timed steps. Plain fit, doctor and plain fit again run interleaved in "
        "one process, in an order rotating each round, after an untimed 2-step run of each side. "
        "*Median step*: median over rounds [range]. *vs plain fit*: median over rounds of the ratio "
        "to plain fit of the same round [range]. *Mean step* / *Mean vs plain fit*: the same from "
        'each run\'s mean step (`Diagnosis.phases["total"]` is that mean). *CPU per step*: the '
        "process's CPU time (`time.process_time()`) from one step's forward start to the next, median "
        "over the timed steps (the task's `loss` is replaced, on both sides, by a wrapper that stamps "
        "it: the doctor takes no callback of ours); other processes competing for the cores do not "
        "stretch it, unlike the wall time. The target is judged on the wall time. *Whole call*: wall "
        "seconds of `fit` / `run_doctor` (set-up, all steps, the final checkpoint; the doctor's "
        "audited steps and diagnosis), median over rounds.",
        f'- The machine is shared and noisy: compare the ratios, not the absolute times. "{NOISE_FLOOR}" '
        "is plain fit a second time: its ratio is the noise floor.",
        "",
    ]
    for entry in entries:
        lines += example_section(entry, rounds, warmup)
    summary = []
    for entry in entries:
        met, ratio = verdict(entry)
        summary.append(f"`{entry.name}` {ratio:.3f} ({'met' if met else 'NOT met'})")
    lines.append(f"Summary: doctor / plain fit, median step, target <= {TARGET:.2f}: {'; '.join(summary)}.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for example in EXAMPLES:
        parser.add_argument(
            f"--{example}-steps",
            type=int,
            default=DEFAULT_STEPS[example],
            help=f"timed steps per {example} run (default {DEFAULT_STEPS[example]})",
        )
    parser.add_argument(
        "--warmup", type=int, default=5, help="warm-up steps before the timed ones (default 5)"
    )
    parser.add_argument("--rounds", type=int, default=9, help="rounds of the three sides (default 9)")
    add_output_options(parser, "smoke run: few steps, 2 rounds; writes only with --out", DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 2
        for example in EXAMPLES:
            setattr(args, f"{example}_steps", QUICK_STEPS[example])
    args.out = output_path(args, DEFAULT_OUT)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step also counts the saved activations)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for example in EXAMPLES:
        if getattr(args, f"{example}_steps") < 2:
            parser.error(f"--{example}-steps must be at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(THREADS)
    load_before = load_now()
    started = time.perf_counter()
    entries = []
    for example in EXAMPLES:
        task, clock = make_task(example)
        entry = Example(
            example,
            getattr(args, f"{example}_steps"),
            [Side(PLAIN), Side(DOCTOR), Side(NOISE_FLOOR)],
        )
        describe(entry, task)
        measure(entry, task, clock, args.rounds, args.warmup)
        entries.append(entry)
    minutes = (time.perf_counter() - started) / 60
    publish(render(entries, args.rounds, args.warmup, load_before, minutes), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
