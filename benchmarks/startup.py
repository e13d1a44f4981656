"""Start-up time of the ``leantrain`` command against ``python -c "import torch"``.

Every CLI command pays the start-up once before it does anything: the interpreter, torch's
import, leantrain's own imports and the argument parser. So does every process of a
``leantrain launch`` (each worker is a fresh interpreter that imports leantrain). The goal
under test (issue 22): ``leantrain --help`` and ``leantrain fit --help`` start within 1.2x of
``python -c "import torch"``, the floor that any torch program pays.

Each command runs as a fresh process, its output to ``/dev/null``, timed the way a user feels
it: the wall clock (``time.perf_counter()``) around ``subprocess.run``, fork and exec
included. The child's user + system CPU time (``resource.getrusage(RUSAGE_CHILDREN)`` before
and after) is reported beside it: other work on the cores stretches the wall time, much less
the CPU time. The commands run interleaved, several rounds, the order rotating each round,
after one untimed run of each (file cache); a command's ratio to the reference is taken
within each round, side by side, and only those ratios are meant to be compared across
machines or runs. ``python -c "import torch"`` runs twice per round: its second copy's ratio
is the noise floor.

    python benchmarks/startup.py            # full run (about 3 minutes on 2 cores); writes results/startup.md
    python benchmarks/startup.py --quick    # smoke run (3 rounds); prints the table only

Standard library only: nothing this process imports competes with the children it times.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from _common import add_output_options, cpu_model, git_state, load_now, output_path, publish, ranged

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "startup.md"
TARGET = 1.2  # the command's wall time / `python -c "import torch"`'s, at most (median of rounds)
REFERENCE, NOISE_FLOOR = 'python -c "import torch"', 'python -c "import torch", again'
GOAL_COMMANDS = ("leantrain --help", "leantrain fit --help")


@dataclass
class Command:
    name: str
    argv: list[str]
    wall: list[float] = field(default_factory=list)  # seconds, one per round
    cpu: list[float] = field(default_factory=list)  # the child's user + system seconds, one per round


def console_script() -> Path:
    """The ``leantrain`` command installed beside this interpreter (the venv's ``bin/``)."""
    path = Path(sys.executable).parent / "leantrain"
    if not path.is_file():
        raise SystemExit(f"no leantrain command at {path}: install the package (pip install -e .)")
    return path


def commands() -> list[Command]:
    leantrain = str(console_script())
    return [
        Command(REFERENCE, [sys.executable, "-c", "import torch"]),
        Command("leantrain --help", [leantrain, "--help"]),
        Command("leantrain fit --help", [leantrain, "fit", "--help"]),
        Command("leantrain examples", [leantrain, "examples"]),
        Command('python -c "import leantrain"', [sys.executable, "-c", "import leantrain"]),
        # The reference once more (an A/A test): its ratio is the noise floor of the machine.
        Command(NOISE_FLOOR, [sys.executable, "-c", "import torch"]),
    ]


# ---------------------------------------------------------------------------------------
# Measuring


def children_cpu() -> float:
    """User + system seconds of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(command: Command) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh process of ``command``; a failed run raises."""
    cpu_before = children_cpu()
    start = time.perf_counter()
    done = subprocess.run(
        command.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wall = time.perf_counter() - start
    cpu = children_cpu() - cpu_before
    if done.returncode != 0:
        raise RuntimeError(f"{command.name} exited with {done.returncode}: {' '.join(command.argv)}")
    return wall, cpu


def measure(timed: list[Command], rounds: int) -> None:
    # One untimed run of each first: the interpreter, torch's shared libraries and the
    # .pyc files into the file cache, so that round 1's first command is not the one to pay.
    for command in timed:
        run_once(command)
    for round_index in range(rounds):
        # Rotate the order: no command is always first or always right after another.
        shift = round_index % len(timed)
        for command in timed[shift:] + timed[:shift]:
            wall, cpu = run_once(command)
            command.wall.append(wall)
            command.cpu.append(cpu)
            print(
                f"round {round_index + 1}/{rounds}  {command.name:<32} wall {wall:6.3f} s  cpu {cpu:6.3f} s",
                file=sys.stderr,
                flush=True,
            )


def ratios(command: Command, reference: Command, cpu: bool = False) -> list[float]:
    """Per round, the command's time over the reference's in the same round."""
    mine, base = (command.cpu, reference.cpu) if cpu else (command.wall, reference.wall)
    return [m / b for m, b in zip(mine, base, strict=True)]


# ---------------------------------------------------------------------------------------
# Report


def versions() -> str:
    parts = []
    for name in ("torch", "leantrain"):
        try:
            parts.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def render(timed: list[Command], rounds: int, load_before: str, minutes: float, git: str) -> str:
    reference = timed[0]
    floor = next(c for c in timed if c.name == NOISE_FLOOR)
    noise = statistics.median(ratios(floor, reference))
    lines = [
        '# Start-up time: the `leantrain` command vs `python -c "import torch"`',
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPU cores visible, Python {platform.python_version()}; "
        f"load average before / after: {load_before} / {load_now()}; the full run took {minutes:.1f} min",
        f"- Code measured: commit {git}; versions: {versions()}",
        f"- Commands: as named in the table; `leantrain` is the console script beside the interpreter "
        f"(`{console_script()}`), `python` that interpreter (`{sys.executable}`)",
        "- Method: each command a fresh process, stdin, stdout and stderr on `/dev/null` (no terminal); "
        "*wall*: `time.perf_counter()` around `subprocess.run` (fork, exec, interpreter start, imports, "
        "the command's work, exit); *CPU*: the child's user + system time (`getrusage(RUSAGE_CHILDREN)` "
        f"before and after). One untimed run of each, then {rounds} rounds, every command once per "
        "round in an order rotating each round. *Wall (s)*: median [min to max] over rounds. "
        "*vs import torch*: per round, the command's wall time over the reference's in the same round; "
        "median [min to max] over rounds. *+ ms*: the median per-round difference. *CPU (s)* and "
        "*CPU vs import torch*: the same from the CPU time.",
        "- The machine is shared and noisy: read the ratios, not the absolute times. "
        f"*{NOISE_FLOOR}* runs the reference a second time: its ratio is the noise floor.",
        "",
        "| Command | Wall (s) | vs import torch | + ms | CPU (s) | CPU vs import torch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for command in timed:
        wall_ratios = ratios(command, reference)
        extra = statistics.median(m - b for m, b in zip(command.wall, reference.wall, strict=True))
        lines.append(
            f"| {command.name} | {ranged(command.wall, 3)} | {ranged(wall_ratios, 3)} | {extra * 1e3:+.0f} "
            f"| {ranged(command.cpu, 3)} | {ranged(ratios(command, reference, cpu=True), 3)} |"
        )
    lines += ["", f"Goal (issue 22): wall time / `{REFERENCE}` <= {TARGET} (median over rounds):", ""]
    by_name = {c.name: c for c in timed}
    for name in GOAL_COMMANDS:
        wall_ratios = ratios(by_name[name], reference)
        ratio = statistics.median(wall_ratios)
        verdict = "met" if ratio <= TARGET else "NOT met"
        within = sum(r <= TARGET for r in wall_ratios)
        lines.append(
            f"- `{name}`: {verdict}, {ratio:.3f} (noise floor {noise:.3f}; "
            f"{within} of {len(wall_ratios)} rounds within {TARGET})"
        )
    lines += [
        "",
        "Every round (wall seconds of the reference; the others as ratios to it, the round's first "
        "command marked *):",
        "",
        "| Round | " + " | ".join(c.name for c in timed) + " |",
        "|---:|" + "---:|" * len(timed),
    ]
    for round_index in range(rounds):
        first = timed[round_index % len(timed)].name
        cells = []
        for command in timed:
            value = command.wall[round_index] / (1.0 if command is reference else reference.wall[round_index])
            cells.append(f"{value:.3f}{'*' if command.name == first else ''}")
        lines.append(f"| {round_index + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of all commands (default 10)")
    add_output_options(parser, "smoke run: 3 rounds; writes only with --out", DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 3
    args.out = output_path(args, DEFAULT_OUT)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = load_now()
    git = git_state()
    started = time.perf_counter()
    timed = commands()
    measure(timed, args.rounds)
    minutes = (time.perf_counter() - started) / 60
    publish(render(timed, args.rounds, load_before, minutes, git), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
