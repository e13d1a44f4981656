"""Pieces the benchmark scripts share: machine description, peak-memory probes, number
formatting, command-line output options and writing the results.

The scripts run as ``python benchmarks/NAME.py``, which puts this folder on ``sys.path``:
they import this module as ``_common`` (so do the subprocesses they start of themselves).
Standard library only, so that importing it costs nothing next to torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------
# The machine


def git_state() -> str:
    """The commit measured, and whether src/ differs from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *command], cwd=root, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("diff", "--quiet", "HEAD", "--", "src").returncode
    return f"{head}, src/ {'with uncommitted changes' if dirty else 'clean'}"


def load_now() -> str:
    """The 1-minute load average: other work on the machine is the first suspect of noise."""
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, or what ``platform`` knows where there is none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------------
# Peak process memory (Linux /proc)


def current_rss_kib() -> int:
    """The process's resident set now, in KiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def peak_rss_kib() -> int:
    """The process's peak resident set since exec (or the last reset): VmHWM, in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset the high-water mark to the current RSS (Linux >= 4.0), so set-up peaks do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError as error:
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)") from error


def run_probe_script(script: str | Path, arguments: Sequence[str], out: Path) -> dict[str, Any]:
    """Run ``script`` in a fresh Python process with ``arguments``; the JSON it wrote to ``out``.

    A fresh process is what a peak-memory measurement needs: nothing of the caller's heap,
    thread pools or caches counts. A failed run raises with the probe's output.
    """
    command = [sys.executable, str(script), *arguments]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"RSS probe {' '.join(command[1:])} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------
# Report


def ranged(values: Sequence[float], digits: int, thousands: bool = False) -> str:
    """The median of ``values``, and their range in brackets where it shows at ``digits`` decimals.

    ``thousands`` groups the integer part by thousands (``12,345.6``).
    """
    spec = f"{',' if thousands else ''}.{digits}f"
    middle = statistics.median(values)
    if len(values) == 1 or max(values) - min(values) < 0.5 * 10**-digits:
        return f"{middle:{spec}}"
    return f"{middle:{spec}} [{min(values):{spec}} to {max(values):{spec}}]"


def rotated(items: Sequence[Any], round_index: int) -> list[Any]:
    """``items`` starting at the ``round_index``-th (wrapping): run in this order, no row is always
    first, or always right after the same other row."""
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]


# ---------------------------------------------------------------------------------------
# Command line and output


def add_output_options(parser: argparse.ArgumentParser, quick_help: str, default_out: Path) -> None:
    """``--quick`` (a smoke run, described by ``quick_help``) and ``--out`` (the Markdown file)."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=None, help=f"Markdown output (default {default_out})")


def output_path(args: argparse.Namespace, default_out: Path) -> Path | None:
    """Where the results go: ``--out``, else ``default_out`` for a full run.

    A smoke run (``--quick``) must not overwrite the full results unless asked to: without
    ``--out`` it writes nothing.
    """
    if args.out is None and not args.quick:
        return default_out
    return args.out


def publish(table: str, out: Path | None) -> None:
    """Print the Markdown ``table``, and write it to ``out`` when there is one."""
    print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
        print(f"written to {out}", file=sys.stderr)
