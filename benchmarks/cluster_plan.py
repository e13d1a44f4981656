"""``leantrain plan --cluster`` against torchtitan's published Llama 3.1 runs on H100s (issue 38).

Each published row with a memory figure that leantrain can express is planned through the real
CLI (``leantrain plan --cluster ... --json``, a subprocess, the product's defaults otherwise) with the
row's configuration as ``results/cluster_plan.md`` ("Published references") reads it: the GPUs
(``NxH100-95GiB``: torchtitan's H100s showed 95.0 GiB), FSDP and TP degrees, sequence length 8192
(``Llama31Task``'s default), the local batch as the micro-batch (global = local x dp), the
activation checkpointing and bf16-mixed (FSDP params in bf16, reductions in fp32, as torchtitan's).

- torchtitan's "selective" is its ``op`` policy, which keeps the outputs of every matrix product but
  every second one; leantrain's ``--activation-checkpointing selective`` keeps all of them. Each 8B
  row is planned twice: with leantrain's ``selective`` (what a user types), and with the task
  ``Llama31_8B_torchtitan_op`` (``llama_tasks.py``: torchtitan's own policy applied in ``model()``,
  no ``--activation-checkpointing``), the like-for-like prediction.
- torchtitan's "full" is every decoder layer checkpointed: ``--activation-checkpointing
  LlamaDecoderLayer``; its tensor parallelism is ``llama_tasks.py``'s ``tp_plan`` (sequence parallel,
  as torchtitan's ``apply_tp``).
- ``compile`` rows are planned with ``--compile blocks`` (torchtitan compiles each block); the plan
  does not model compilation (its figures are those of the eager row).
- Float8 is not in leantrain: the 8B Float8 rows are skipped (their bf16 twins are planned); the
  only 70B row with memory (70-1) is Float8, planned in bf16 and labelled not like-for-like, with the
  tokens/s of A25's bf16 row of the same layout (70-3) beside it. Context parallelism (8B table 2),
  async TP and pipelines (405B) are not simulated: skipped.

Per row: the predicted peak of live bytes (``peak_bytes``) and what the allocator is modelled to reserve
(``reserved_bytes``, peak + 10 %, no CUDA context), each against the published figure (most likely
torchtitan's peak *reserved*, GiB), the predicted tokens/s per GPU against the published, the plan's
wall time and the plan process's peak RSS (the plan counts attention's FLOPs: the CPU flash kernel of
its fake step by its CUDA twin's formula). Then one ``--search`` for
the 8B on 8 GPUs: its wall time, the layouts it tried and its five fastest.

    python benchmarks/cluster_plan.py          # every row and the search (about 12 min on 2 cores)
    python benchmarks/cluster_plan.py --quick  # rows 8-1 and 70-1, no search; prints only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _common import add_output_options, cpu_model, git_state, load_now, output_path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
DEFAULT_OUT = BENCH_DIR / "results" / "cluster_plan.md"
SECTION = "## Predictions against published rows"
GIB = 2**30
SEQ_LEN = 8192
MFU = 0.35  # step_time.DEFAULT_MFU: the plans below use the default
H100_BF16 = 989e12  # hardware.py's h100-sxm dense bf16 peak
PLAN_TIMEOUT_S = 900
SEARCH_TIMEOUT_S = 1500
TARGET_PLAN_S = 120
TARGET_SEARCH_S = 600
MIN_LAYOUTS = 50


@dataclass(frozen=True)
class Row:
    """A published row and the flags that plan it."""

    row: str  # the id in "Published references"
    size: str  # 8b or 70b
    gpus: int
    tp: int
    local_batch: int
    checkpointing: str  # torchtitan's words
    compiled: bool
    memory_gib: float
    tps: float
    tps_note: str = ""
    like_for_like: str = "bf16"  # what the published figure was measured in, where not bf16
    quick: bool = False

    @property
    def dp(self) -> int:
        return self.gpus // self.tp


ROWS = (
    Row("8-1", "8b", 8, 1, 2, "selective op", False, 82.4, 5762, quick=True),
    Row("8-2", "8b", 8, 1, 2, "selective op", True, 77.0, 6667),
    Row("8-8", "8b", 128, 1, 2, "selective op", False, 67.0, 5605),
    Row("8-9", "8b", 128, 1, 2, "selective op", True, 62.0, 6514),
    Row("8-14/8-15", "8b", 8, 1, 1, "selective op", True, 47.65, 6150, "6150 (AO median), 5760 (PR808)"),
    Row(
        "70-1", "70b", 256, 8, 16, "full", True, 71.9, 597.3, "597.3: 70-3, bf16 vanilla TP (A25)",
        like_for_like="Float8 (70-1); planned in bf16: not like-for-like", quick=True,
    ),
)  # fmt: skip
SKIPPED = (
    ("8-3, 8-10", "Float8 (leantrain has none); their bf16 twins 8-2, 8-9 are planned"),
    ("8-4 .. 8-7", "context parallelism and Float8 (neither in leantrain); table 2 is disputed (#1344)"),
    ("8-11 .. 8-13, 70-3 .. 70-5", "no memory figure (70-3's bf16 tokens/s stands beside 70-1)"),
    ("70-2", "Float8 with async TP (neither in leantrain)"),
    ("405-1 .. 405-6", "pipeline stages (plan --cluster does not simulate them yet), Float8"),
)


@dataclass(frozen=True)
class Variant:
    """How torchtitan's checkpointing is asked of leantrain."""

    name: str
    task_suffix: str
    flags: tuple[str, ...]


def variants(row: Row) -> list[Variant]:
    if row.checkpointing == "full":
        return [
            Variant("LlamaDecoderLayer (= full)", "", ("--activation-checkpointing", "LlamaDecoderLayer"))
        ]
    return [
        Variant("leantrain selective (every mm kept)", "", ("--activation-checkpointing", "selective")),
        Variant("torchtitan op (every 2nd mm recomputed)", "_torchtitan_op", ()),
    ]


def leantrain_command() -> list[str]:
    """The ``leantrain`` a user runs: the console script beside this Python, else ``-m leantrain``."""
    script = Path(sys.executable).parent / "leantrain"
    return [str(script)] if script.exists() else [sys.executable, "-m", "leantrain"]


def plan_arguments(row: Row, variant: Variant) -> list[str]:
    task = f"benchmarks.llama_tasks:Llama31_{row.size.upper()}{variant.task_suffix}"
    arguments = [
        "plan",
        *("--task", task),
        *("--cluster", f"{row.gpus}xH100-95GiB"),
        *("--strategy", "fsdp"),
        *(("--tp", str(row.tp)) if row.tp > 1 else ()),
        *("--global-batch-size", str(row.local_batch * row.dp)),
        *("--micro-batch-size", str(row.local_batch)),
        *("--precision", "bf16-mixed"),
        *variant.flags,
        *(("--compile", "blocks") if row.compiled else ()),
        "--json",
    ]
    return arguments


@dataclass
class Run:
    """One ``leantrain plan`` subprocess: its JSON, wall time and peak RSS."""

    command: list[str]
    result: Any = None
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    error: str = ""


def run_plan(arguments: list[str], timeout_s: float) -> Run:
    """Run ``leantrain`` with ``arguments`` from the repository root (the tasks import as ``benchmarks.``)."""
    run = Run([*leantrain_command(), *arguments])
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        child = subprocess.Popen(run.command, cwd=ROOT, stdout=out, stderr=err, text=True)
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            run.wall_s = time.perf_counter() - started
            run.error = f"timed out after {timeout_s:.0f} s"
            return run
        run.wall_s = time.perf_counter() - started
        run.peak_rss_bytes = child_peak_rss()
        out.seek(0)
        err.seek(0)
        if child.returncode != 0:
            run.error = f"exit {child.returncode}: " + " / ".join(err.read().strip().splitlines()[-3:])
            return run
        run.result = json.loads(out.read())
    return run


def child_peak_rss() -> int:
    """The largest peak RSS of the children waited for so far (Linux: KiB): with one child at a time,
    read after each, the running maximum; each run's own figure is the larger of it and the previous."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


@dataclass
class Planned:
    row: Row
    variant: Variant
    run: Run
    rss_bytes: int = 0

    def get(self, key: str) -> Any:
        return None if self.run.result is None else self.run.result[key]


@dataclass
class Search:
    command: list[str]
    run: Run | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# Report


def gib(value: float) -> str:
    return f"{value / GIB:,.2f}"


def ratio(value: float | None, reference: float) -> str:
    if value is None:
        return "n/a"
    share = value / reference
    flag = " **miss**" if abs(share - 1) > 0.10 else ""
    return f"{share:.3f}{flag}"


def commands_block(planned: list[Planned], search: Search | None) -> list[str]:
    lines = ["```bash"]
    for one in planned:
        lines.append(shlex.join(["leantrain", *one.run.command[len(leantrain_command()) :]]))
    if search is not None:
        lines.append(shlex.join(["leantrain", *search.command[len(leantrain_command()) :]]))
    return [*lines, "```"]


def search_rows(result: Any) -> list[dict[str, Any]]:
    """Every layout ``--search --json`` tried (``layouts``: fitting ones first, fastest first)."""
    return list(result.get("layouts", [])) if isinstance(result, dict) else []


def section(planned: list[Planned], search: Search | None, started: str, load: tuple[str, str]) -> str:
    lines = [
        SECTION,
        "",
        f"Written by `benchmarks/cluster_plan.py` on {started} (UTC). Commit: {git_state()}. Machine: "
        f"{cpu_model()}, {os.cpu_count()} CPUs, {total_memory_gib()} GiB memory, no GPU; "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}. Load average "
        f"before / after: {load[0]} / {load[1]}. Each plan is one `leantrain plan --json` subprocess, "
        "one at a time; wall time includes start-up and imports; RSS is the plan process's peak.",
        "",
        "Predicted: `peak_bytes` (live tensors at the step's peak, MemTracker) and `reserved_bytes` (that "
        "+ the modelled 10 % allocator overhead; the CUDA context is not in either, nor in torchtitan's "
        "figure). Published: torchtitan's memory figure (GiB; most likely peak reserved, see above). "
        "Ratios are predicted / published; **miss**: more than 10 % off. Tokens/s per GPU at the "
        "default 35 % MFU.",
        "",
        "| row | GPUs (dp x tp) | local batch | checkpointing planned as | published in | peak GiB | "
        "reserved GiB | published GiB | peak / pub. | reserved / pub. | tok/s/GPU | published "
        "tok/s/GPU | tok/s / pub. | plan s | RSS GiB |",
        "| -- | -- | --: | -- | -- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |",
    ]
    for one in planned:
        row, run = one.row, one.run
        layout = f"{row.gpus} ({row.dp} x {row.tp})" + (", compile" if row.compiled else "")
        head = f"| {row.row} | {layout} | {row.local_batch} | {one.variant.name} | {row.like_for_like} "
        if run.result is None:
            lines.append(head + f"| {run.error} |" + " |" * 9 + f" {run.wall_s:.1f} | |")
            continue
        peak, reserved = one.get("peak_bytes"), one.get("reserved_bytes")
        tokens = one.get("time_tokens_per_s_per_gpu")
        published_tokens = row.tps_note or f"{row.tps:,.0f}"
        lines.append(
            head
            + f"| {gib(peak)} | {gib(reserved)} | {row.memory_gib:g} | {ratio(peak / GIB, row.memory_gib)} "
            f"| {ratio(reserved / GIB, row.memory_gib)} | {tokens:,.0f} "
            f"| {published_tokens} | {tokens / row.tps:.2f} "
            f"| {run.wall_s:.1f} | {one.rss_bytes / GIB:.2f} |"
        )
    lines += ["", "Not planned:", ""]
    lines += [f"- {rows}: {why}." for rows, why in SKIPPED]
    lines += ["", "Peak by kind (GB = 1e9 bytes) and fits (reserved + 600 MiB CUDA context <= 95 GiB):", ""]
    lines += ["| row | checkpointing | Parameter | Optstate | Gradient | Activation | Temp | fits |"]
    lines += ["| -- | -- | --: | --: | --: | --: | --: | -- |"]
    for one in planned:
        if one.run.result is None:
            continue
        kinds = one.get("peak_bytes_by_kind")
        cells = " | ".join(
            f"{kinds.get(kind, 0) / 1e9:,.2f}" for kind in ("Parameter", "Optstate", "Gradient")
        )
        cells += " | " + " | ".join(f"{kinds.get(kind, 0) / 1e9:,.2f}" for kind in ("Activation", "Temp"))
        lines.append(f"| {one.row.row} | {one.variant.name} | {cells} | {one.get('fits')} |")
    timing = [one for one in planned if one.row.row in ("8-1", "70-1") and one.run.result is not None]
    lines += ["", f"Time to plan (target: each under {TARGET_PLAN_S} s on this machine):", ""]
    for one in timing:
        verdict = "met" if one.run.wall_s < TARGET_PLAN_S else "missed"
        lines.append(
            f"- Llama 3.1 {one.row.size.upper()} on {one.row.gpus} GPUs ({one.variant.name}): "
            f"{one.run.wall_s:.1f} s ({verdict}), peak RSS {one.rss_bytes / GIB:.2f} GiB."
        )
    if search is not None:
        lines += ["", *search_section(search)]
    lines += ["", "Commands (from the repository root):", "", *commands_block(planned, search)]
    return "\n".join(lines) + "\n"


def search_section(search: Search) -> list[str]:
    run = search.run
    lines = [
        f"`--search`, Llama 3.1 8B on 8 GPUs (target: at least {MIN_LAYOUTS} layouts in {TARGET_SEARCH_S} s):"
    ]
    if run is None or run.result is None:
        return [
            *lines,
            "",
            f"- failed: {run.error if run else 'not run'} after {run.wall_s if run else 0:.0f} s.",
        ]
    rows = search.rows
    fitting = [layout for layout in rows if layout.get("fits")]
    simulated = [layout for layout in rows if "peak_bytes" in layout]
    reasons = Counter(layout.get("reason") for layout in rows if "peak_bytes" not in layout)
    verdict = "met" if run.wall_s < TARGET_SEARCH_S and len(rows) >= MIN_LAYOUTS else "missed"
    lines += [
        "",
        f"- wall {run.wall_s:.1f} s, peak RSS {search_rss(search) / GIB:.2f} GiB; layouts listed: "
        f"{len(rows)}, {len(simulated)} of them simulated; fitting: {len(fitting)}; target {verdict}.",
        *(f"- not simulated, {count}: {reason}" for reason, count in reasons.most_common()),
        "- the five fastest fitting layouts:",
        "",
        "| # | strategy | tp | micro-batch | checkpointing | precision | peak GiB | reserved GiB "
        "| tok/s/GPU |",
        "| --: | -- | --: | --: | -- | -- | --: | --: | --: |",
    ]
    for index, layout in enumerate(fitting[:5], 1):
        lines.append(
            f"| {index} | {layout.get('strategy')} | {layout.get('tp')} | {layout.get('micro_batch_size')} "
            f"| {layout.get('activation_checkpointing')} | {layout.get('precision')} "
            f"| {gib(layout.get('peak_bytes', 0))} | {gib(layout.get('reserved_bytes', 0))} "
            f"| {layout.get('time_tokens_per_s_per_gpu', 0):,.0f} |"
        )
    return lines


def search_rss(search: Search) -> int:
    return search.run.peak_rss_bytes if search.run else 0


def total_memory_gib() -> str:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return "n/a"
    return f"{pages / GIB:.0f}"


def save(text: str, out: Path) -> None:
    """Replace this script's section of ``out`` (or add it), keeping the rest: the published references
    before it, and any section after it (the analysis, written by hand)."""
    old = out.read_text() if out.exists() else ""
    before, found, after = old.partition(SECTION)
    rest = after[after.find("\n## ") :] if found and "\n## " in after else ""
    head = before.rstrip()
    out.write_text((head + "\n\n" if head else "") + text + (rest.rstrip() + "\n" if rest else ""))
    print(f"written to {out}", file=sys.stderr)


# ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_options(parser, "rows 8-1 and 70-1, no search; writes only with --out", DEFAULT_OUT)
    parser.add_argument("--no-search", action="store_true", help="skip the --search run")
    args = parser.parse_args(argv)
    args.out = output_path(args, DEFAULT_OUT)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")
    load_before = load_now()
    planned: list[Planned] = []
    previous_rss = 0
    for row in ROWS:
        if args.quick and not row.quick:
            continue
        for variant in variants(row):
            run = run_plan(plan_arguments(row, variant), PLAN_TIMEOUT_S)
            # RUSAGE_CHILDREN is a running maximum: a run whose peak is below an earlier one's shows
            # as "at most" that (the table gives the running maximum; the first runs are the 8B's).
            one = Planned(row, variant, run, rss_bytes=max(run.peak_rss_bytes, previous_rss))
            previous_rss = one.rss_bytes
            planned.append(one)
            said = (
                run.error
                or f"peak {gib(one.get('peak_bytes'))} GiB, {one.get('time_tokens_per_s_per_gpu'):,.0f} tok/s"
            )
            print(
                f"{row.row:<10} {variant.name:<40} {run.wall_s:6.1f} s  {said}", file=sys.stderr, flush=True
            )
    search = None
    if not args.quick and not args.no_search:
        arguments = [
            "plan", *("--task", "benchmarks.llama_tasks:Llama31_8B"), *("--cluster", "8xH100-95GiB"),
            *("--global-batch-size", "16"), *("--precision", "bf16-mixed"), "--search", "--json",
        ]  # fmt: skip
        search = Search([*leantrain_command(), *arguments])
        search.run = run_plan(arguments, SEARCH_TIMEOUT_S)
        search.rows = search_rows(search.run.result)
        print(f"search: {search.run.wall_s:.1f} s, {len(search.rows)} layouts listed", file=sys.stderr)
    text = section(planned, search, started, (load_before, load_now()))
    print(text)
    if args.out is not None:
        save(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
