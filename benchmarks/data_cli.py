"""What a user gets from ``--num-workers auto`` on the data-bound ``slowdata`` example, through the CLI.

``benchmarks/data.py`` measures loader settings through the Python API in one process, with
``torch.set_num_threads(1)`` forced in the main process: users do not do that. leantrain now
lowers the main process's compute threads itself when loader workers run beside it, so this
script measures what a user gets with leantrain's defaults (issue 19: ``--num-workers auto``
>= 1.8x ``--num-workers 0`` through the CLI, and the benchmark's rows equal the CLI's within
noise). Every run is a fresh process, nothing set but the step count, the worker count, the run
folder and no progress output:

- *CLI*: ``python -m leantrain fit --example slowdata --max-steps N --num-workers W
  --out-dir DIR --progress none``, for W in ``auto`` and ``0``;
- *API*: ``python -c`` code that calls ``lt.Trainer(lt.TrainConfig(max_steps=N, num_workers=W,
  out_dir=DIR, progress="none")).fit(load_example("slowdata"))``, with no thread setting.

A run's speed is ``samples_per_second`` from its ``summary.json`` (samples over the training
loop's time: neither interpreter start, imports nor the final validation count); the worker
count and compute threads it used come from there too. The rows run interleaved, every row once
per round in an order rotating each round; the table gives medians and ranges over rounds, and
the auto / 0 ratio of the CLI pair and of the API pair, taken within each round. The threading
variables that override leantrain's choice (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``) are
removed from the runs' environment: with them set, the runs would measure the shell, not
leantrain's defaults.

    python benchmarks/data_cli.py            # full run (about 5 min on 2 cores); writes results/data_cli.md
    python benchmarks/data_cli.py --quick    # smoke run (20 steps, 1 round); prints the table only

Standard library only: nothing this process imports competes with the runs it starts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _common import add_output_options, cpu_model, git_state, load_now, output_path, publish, ranged, rotated

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "data_cli.md"
TARGET = 1.8  # the issue's target: auto's samples/s over num_workers 0's, through the CLI
EXAMPLE = "slowdata"
# Variables that make leantrain keep the user's thread count (runtime.user_chose_threads).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
STDERR_TAIL = 3000  # characters of a failed run's stderr put into the error

# The Python-API run: the same task and defaults as the CLI's, no thread setting.
API_CODE = """\
import sys
import leantrain as lt
from leantrain.examples import load_example
steps, workers, out_dir, example = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
config = lt.TrainConfig(
    max_steps=steps,
    num_workers=workers if workers in ("auto", "tune") else int(workers),
    out_dir=out_dir,
    progress="none",
)
lt.Trainer(config).fit(load_example(example))
"""


@dataclass
class Row:
    name: str
    via: str  # "CLI" or "API"
    workers: str  # the --num-workers / num_workers value asked for
    # One entry per round:
    rates: list[float] = field(default_factory=list)  # samples_per_second from summary.json
    used: list[int] = field(default_factory=list)  # num_workers from summary.json (auto resolved)
    threads: list[int] = field(default_factory=list)  # compute_threads from summary.json
    walls: list[float] = field(default_factory=list)  # seconds of the whole process, start to exit

    def command(self, steps: int, out_dir: Path) -> list[str]:
        if self.via == "CLI":
            return [
                sys.executable, "-m", "leantrain", "fit", "--example", EXAMPLE,
                "--max-steps", str(steps), "--num-workers", self.workers,
                "--out-dir", str(out_dir), "--progress", "none",
            ]  # fmt: skip
        return [sys.executable, "-c", API_CODE, str(steps), self.workers, str(out_dir), EXAMPLE]


CLI_AUTO, CLI_ZERO = "CLI, --num-workers auto", "CLI, --num-workers 0"
API_AUTO, API_ZERO = "API, num_workers=auto", "API, num_workers=0"


def rows() -> list[Row]:
    return [
        Row(CLI_AUTO, "CLI", "auto"),
        Row(CLI_ZERO, "CLI", "0"),
        Row(API_AUTO, "API", "auto"),
        Row(API_ZERO, "API", "0"),
    ]


# ---------------------------------------------------------------------------------------
# Running


def run_environment() -> dict[str, str]:
    """This process's environment without the variables that would pin the runs' thread count."""
    return {key: value for key, value in os.environ.items() if key not in THREAD_VARIABLES}


def run_once(row: Row, steps: int) -> tuple[dict[str, Any], float]:
    """One fresh process of ``row``: its ``summary.json`` and the process's wall seconds.

    The run folder and the working directory are a fresh temporary folder, so nothing of one run
    (a checkpoint to resume from, a cache) reaches the next, and nothing lands in the repository.
    """
    with tempfile.TemporaryDirectory(prefix="leantrain-data-cli-") as scratch:
        out_dir = Path(scratch) / "run"
        command = row.command(steps, out_dir)
        started = time.perf_counter()
        done = subprocess.run(
            command,
            cwd=scratch,
            env=run_environment(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(
                f"{row.name} exited with {done.returncode}: {' '.join(command)}\n"
                f"stderr (last {STDERR_TAIL} characters):\n{done.stderr[-STDERR_TAIL:]}"
            )
        summary_path = out_dir / "summary.json"
        if not summary_path.is_file():
            raise RuntimeError(f"{row.name} wrote no {summary_path}: {' '.join(command)}")
        return json.loads(summary_path.read_text()), wall


def record(row: Row, summary: dict[str, Any], wall: float, steps: int) -> None:
    if summary.get("steps") != steps:
        raise RuntimeError(f"{row.name} ran {summary.get('steps')} steps, expected {steps}")
    row.rates.append(float(summary["samples_per_second"]))
    # Older summaries lack these keys; -1 shows "unknown" in the table rather than failing.
    row.used.append(int(summary.get("num_workers", -1)))
    row.threads.append(int(summary.get("compute_threads", -1)))
    row.walls.append(wall)


def warm_up() -> None:
    """One short untimed CLI run: the interpreter, torch's libraries and the .pyc files into the
    file cache, so that round 1's first row does not pay for them."""
    summary, _ = run_once(Row("warm-up", "CLI", "0"), 2)
    if "samples_per_second" not in summary:
        raise RuntimeError(f"summary.json has no samples_per_second; its keys: {sorted(summary)}")


def measure(timed: list[Row], steps: int, rounds: int) -> list[str]:
    """Run every row once per round, the order rotating; the load average at each round's start."""
    loads = []
    for round_index in range(rounds):
        loads.append(load_now())
        for row in rotated(timed, round_index):
            summary, wall = run_once(row, steps)
            record(row, summary, wall, steps)
            print(
                f"round {round_index + 1}/{rounds}  {row.name:<26} {row.rates[-1]:8,.0f} samples/s  "
                f"{row.used[-1]} workers  {row.threads[-1]} compute threads  process {wall:5.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return loads


# ---------------------------------------------------------------------------------------
# Report


def ratios(mine: Row, base: Row) -> list[float]:
    """Per round, ``mine``'s samples/s over ``base``'s in the same round."""
    return [m / b for m, b in zip(mine.rates, base.rates, strict=True)]


def counts(values: Sequence[int]) -> str:
    """A per-round count: "2", or "2 (4x), 1 (1x)" when rounds differ; "?" for unknown."""
    shown = ["?" if value < 0 else str(value) for value in values]
    tally = {value: shown.count(value) for value in sorted(set(shown), key=shown.count, reverse=True)}
    if len(tally) == 1:
        return shown[0]
    return ", ".join(f"{value} ({times}x)" for value, times in tally.items())


def versions() -> str:
    parts = []
    for name in ("torch", "numpy", "leantrain"):
        try:
            parts.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def available_cpus() -> int | str:
    """The CPUs this process may run on (its affinity mask): what auto divides among workers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "n/a"


def verdict(ratio: float) -> str:
    return "met" if ratio >= TARGET else "NOT met"


def agreement(cli: list[float], api: list[float]) -> str:
    """Whether the CLI's and the API's auto / 0 ratios agree within the rounds' spread.

    There is no A/A row; the spread of the ratios over rounds stands for the noise: they agree
    when each median lies within the other's range.
    """
    if len(cli) < 2:
        return "one round: no spread to judge agreement by"
    cli_mid, api_mid = statistics.median(cli), statistics.median(api)
    inside = min(api) <= cli_mid <= max(api) and min(cli) <= api_mid <= max(cli)
    return "agree within the rounds' spread" if inside else "DIFFER beyond the rounds' spread"


def render(timed: list[Row], args: argparse.Namespace, loads: list[str], before: str, minutes: float) -> str:
    by_name = {row.name: row for row in timed}
    cli, api = ratios(by_name[CLI_AUTO], by_name[CLI_ZERO]), ratios(by_name[API_AUTO], by_name[API_ZERO])
    cli_mid, api_mid = statistics.median(cli), statistics.median(api)
    removed = [key for key in THREAD_VARIABLES if key in os.environ]
    lines = [
        "# Data loading through the CLI: `--num-workers auto` against `0` on `slowdata`, default settings",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPU cores visible, {available_cpus()} available to this process, "
        f"Python {platform.python_version()}; load average before / after: {before} / {load_now()}, at "
        f"each round's start: {', '.join(loads)}; the run took {minutes:.1f} min",
        f"- Code measured: commit {git_state()}; versions: {versions()}",
        f"- Runs: each row a fresh process (`{sys.executable}`), its run folder and working directory a "
        f"fresh temporary folder. *CLI*: `python -m leantrain fit --example {EXAMPLE} --max-steps "
        f"{args.steps} --num-workers W --out-dir DIR --progress none`. *API*: `python -c` code calling "
        f"`lt.Trainer(lt.TrainConfig(max_steps={args.steps}, num_workers=W, out_dir=DIR, "
        f'progress="none")).fit(load_example("{EXAMPLE}"))`. Everything else default (global batch 64, '
        "device auto, validation once at the end, TensorBoard, the final checkpoint); no thread setting. "
        + (
            f"Removed from the runs' environment: {', '.join(f'`{key}`' for key in removed)} (set here; "
            "it would override leantrain's thread choice)."
            if removed
            else "`OMP_NUM_THREADS` and `MKL_NUM_THREADS` unset."
        ),
        f"- Method: one untimed 2-step CLI run first (file cache), then {args.rounds} round(s), every row "
        "once per round in an order rotating each round. *Samples/s*: `samples_per_second` from the run's "
        "`summary.json` (samples over the training loop's time), median [min to max] over rounds. "
        "*Workers* and *Compute threads*: `num_workers` and `compute_threads` from `summary.json`. "
        "*Process (s)*: the wall time of the whole process (interpreter start, imports, validation and "
        "saving included). *auto / 0*: per round, the auto row's samples/s over the 0 row's of the same "
        "round (CLI with CLI, API with API); median [min to max]. *API / CLI*: per round, the API row's "
        "samples/s over the CLI row's with the same W.",
        "",
        "| Row | Workers | Compute threads | Samples/s | API / CLI | Process (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    cli_rows = {row.workers: row for row in timed if row.via == "CLI"}
    for row in timed:
        twin = cli_rows.get(row.workers) if row.via == "API" else None
        versus = ranged(ratios(row, twin), 2) if twin is not None else "-"
        rate = ranged(row.rates, 0, thousands=True)
        lines.append(
            f"| {row.name} | {counts(row.used)} | {counts(row.threads)} | {rate} | {versus} "
            f"| {ranged(row.walls, 1)} |"
        )
    lines += [
        "",
        "| Pair | auto / 0 |",
        "|---|---:|",
        f"| CLI | {ranged(cli, 2)} |",
        f"| API | {ranged(api, 2)} |",
        "",
        f"Target (issue 19): auto >= {TARGET}x num_workers 0 through the CLI: **{verdict(cli_mid)}**, "
        f"{ranged(cli, 2)} ({sum(r >= TARGET for r in cli)} of {len(cli)} rounds at or above {TARGET}).",
        "",
        f"CLI against API: auto / 0 {cli_mid:.2f} through the CLI, {api_mid:.2f} through the API "
        f"(CLI / API {cli_mid / api_mid:.3f}): {agreement(cli, api)}.",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default 120)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all rows (default 5)")
    add_output_options(parser, "smoke run: 20 steps, 1 round; writes only with --out", DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 20, 1
    args.out = output_path(args, DEFAULT_OUT)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    before = load_now()
    started = time.perf_counter()
    timed = rows()
    warm_up()
    loads = measure(timed, args.steps, args.rounds)
    minutes = (time.perf_counter() - started) / 60
    table = render(timed, args, loads, before, minutes)
    # The comparison also goes to the terminal on its own, where a reader of the log looks first.
    print(table.rstrip().splitlines()[-1], file=sys.stderr)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
