"""``--compile`` on the CPU: eager against ``model`` and ``blocks``, step time and compile time (issue 15).

Three models: the ``charlm`` example with its defaults (``leantrain fit --example charlm``: 4 blocks
of width 128, 64 characters, global batch 64, one micro-batch), the same transformer with 8
blocks (``CharLMTask(layers=8)``), and charlm in ``precision="bf16-mixed"`` (autocast: on the CPU,
eager bf16 elementwise work is slow, and that is what compiling fuses). Each trains through
``leantrain.Trainer.fit`` with leantrain's defaults otherwise (compute threads included: no
thread setting), the logger off and ``checkpoint_every="never"`` to keep disk writes out of the
figures, and validation off (the task's ``val_data`` returns None: a compiled model would also
compile for evaluation, and that time would land in ``compile_seconds``). Three settings per model:

- *eager*: ``compile="none"``;
- *model*: ``compile="model"``: the whole model is one compiled unit;
- *blocks*: ``compile="blocks"``: each repeated block is compiled in place, one compilation
  serving all of them.

Every run is a fresh Python process (this script with ``--one``, which prints its figures as
JSON): torch.compile caches compiled code in the process, and on disk: each run gets a fresh,
empty ``TORCHINDUCTOR_CACHE_DIR``, so every compiled run compiles from scratch, as a first run
does. ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` are removed from the runs' environment (they
would override leantrain's thread choice). An ``on_step`` callback stamps ``time.perf_counter()``
after every step; the first ``WARMUP`` steps are the warm-up (leantrain runs step 1 eagerly, to
count saved activations, so the compiling happens in step 2). *Step time*: the median gap after
the warm-up. *Samples/s*: the global batch over that median (the median, not the mean: other work
on a shared machine stretches a few steps by seconds). *Warm-up
excess*: the time of steps 2 to ``WARMUP`` beyond as many steps at the run's median: what the
compiling cost the run's wall clock (against ``compile_seconds``, the time torch's compile
callbacks saw). The settings run interleaved, in an order rotating each round; medians and
ranges over rounds, the ratio to eager taken within each round. Last, one more fresh process
profiles charlm's operators (``torch.profiler``), eager and with its blocks compiled, to show
where the step's time goes and what compiling can shorten.

    python benchmarks/compile.py           # full run (about 12 min on 2 cores): results/compile.md
    python benchmarks/compile.py --quick   # smoke run (1 round, 20 steps); prints the table only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _common import add_output_options, cpu_model, git_state, load_now, output_path, publish, ranged, rotated

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compile.md"
TARGET = 1.10  # charlm, compile="blocks": samples/s after warm-up over eager's
WARMUP = 10  # steps dropped at the start of each run (step 2 compiles; a few after it settle)
MODES = ("none", "model", "blocks")
# name -> (CharLMTask arguments, TrainConfig fields beyond leantrain's defaults)
MODELS: dict[str, tuple[dict[str, int], dict[str, str]]] = {
    "charlm": ({}, {}),
    "charlm, 8 blocks": ({"layers": 8}, {}),
    "charlm, bf16-mixed": ({}, {"precision": "bf16-mixed"}),
}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # they pin leantrain's thread count
STDERR_TAIL = 3000  # characters of a failed run's stderr put into the error


# ---------------------------------------------------------------------------------------
# One run (a fresh process: ``--one MODEL MODE STEPS``)


def charlm(model: str) -> Any:
    """The task of ``model``: charlm with its arguments, without its validation set (a compiled
    model would compile for evaluation too, into ``compile_seconds``)."""
    from leantrain.examples.charlm import CharLMTask

    class NoValidation(CharLMTask):
        def val_data(self) -> None:
            return None

    return NoValidation(**MODELS[model][0])


def one(model: str, mode: str, steps: int) -> dict[str, Any]:
    """Train ``model`` with ``compile=mode`` for ``steps`` steps in this process; its figures."""
    import torch
    from torch._dynamo.utils import counters

    import leantrain as lt

    class Stamps:
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step(self, stats: Any) -> None:
            self.times.append(time.perf_counter())

    fields = MODELS[model][1]
    task = charlm(model)
    stamps = Stamps()
    with tempfile.TemporaryDirectory(prefix="leantrain-compile-") as scratch:
        config = lt.TrainConfig(
            max_steps=steps, compile=mode, logger="none", checkpoint_every="never", progress="none",
            out_dir=str(Path(scratch) / "run"), **fields,
        )  # fmt: skip
        result = lt.Trainer(config, callbacks=[stamps]).fit(task)
    gaps = [b - a for a, b in zip(stamps.times, stamps.times[1:], strict=False)]  # steps 2..N
    steady = gaps[WARMUP - 1 :]  # steps WARMUP+1..N
    median = statistics.median(steady)
    return {
        "step_seconds": median,
        "samples_per_second": result.global_batch_size / median,
        "window_samples_per_second": len(steady) * result.global_batch_size / sum(steady),
        "warmup_excess": sum(gaps[: WARMUP - 1]) - (WARMUP - 1) * median,
        "compile_seconds": result.compile_seconds,
        "summary_samples_per_second": result.samples_per_second,
        "peak_memory_bytes": result.peak_memory_bytes,
        "global_batch_size": result.global_batch_size,
        "micro_batch_size": result.micro_batch_size,
        "compute_threads": result.compute_threads,
        "parameters": sum(p.numel() for p in task.model().parameters()),
        "graphs": counters["stats"]["unique_graphs"],
        "events": [event.line() + f" (x{event.count})" for event in result.compiler_events],
        "torch": torch.__version__,
    }


# ---------------------------------------------------------------------------------------
# Where the eager step's time goes, and what compiling changes (``--kernels``, a fresh process)

EXTERN = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")  # compiled code calls them as eager does
PROFILED = 5  # steps profiled of each, after 3 unprofiled ones


def kernels() -> dict[str, float]:
    """charlm's operator time per step (ms), eager and with its blocks compiled, by kind.

    A plain loop over one batch of 64 (the task's loss and optimizer), ``torch.profiler``'s self
    CPU time of each operator summed by kind: matrix products, attention, the compiled code's own
    kernels and the rest (layer norms, GELU, residual adds, copies, the optimizer's updates).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    task = charlm("charlm")
    model = task.model()
    optimizer = task.optimizer(model.parameters())
    data = task.train_data()
    inputs, targets = (torch.stack(items) for items in zip(*(data[i] for i in range(64)), strict=True))

    def step() -> None:
        total, count = task.loss(model, (inputs, targets))
        (total / count).backward()
        optimizer.step()
        optimizer.zero_grad()

    def by_kind(prefix: str) -> dict[str, float]:
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(PROFILED):
                step()
        kinds = {"matmul": 0.0, "attention": 0.0, "compiled": 0.0, "other": 0.0}
        for event in profiled.key_averages():
            if event.key in EXTERN:
                kind = "matmul"
            elif "scaled_dot_product" in event.key:
                kind = "attention"
            elif event.key.startswith("## Call CompiledFxGraph"):
                kind = "compiled"
            else:
                kind = "other"
            kinds[kind] += event.self_cpu_time_total / 1000 / PROFILED
        return {f"{prefix}_{kind}": value for kind, value in kinds.items()}

    eager = by_kind("eager")
    for block in model.blocks:
        block.compile()  # what compile="blocks" does
    return {**eager, **by_kind("blocks")}


# ---------------------------------------------------------------------------------------
# Runs from the parent


@dataclass
class Row:
    model: str
    mode: str
    runs: list[dict[str, Any]] = field(default_factory=list)  # one per round

    def values(self, key: str, scale: float = 1.0) -> list[float]:
        return [run[key] * scale for run in self.runs]


def run_environment(cache: str) -> dict[str, str]:
    """This process's environment without the thread variables, with a fresh inductor cache."""
    environment = {key: value for key, value in os.environ.items() if key not in THREAD_VARIABLES}
    environment["TORCHINDUCTOR_CACHE_DIR"] = cache
    return environment


def in_fresh_process(*arguments: str) -> dict[str, Any]:
    """This script with ``arguments`` in a fresh process, with an empty inductor cache; the JSON it
    printed last."""
    command = [sys.executable, str(Path(__file__).resolve()), *arguments]
    with tempfile.TemporaryDirectory(prefix="leantrain-compile-cache-") as cache:
        done = subprocess.run(
            command, cwd=cache, env=run_environment(cache), stdin=subprocess.DEVNULL,
            capture_output=True, text=True,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(arguments)} exited with {done.returncode}: {' '.join(command)}\n"
            f"stderr (last {STDERR_TAIL} characters):\n{done.stderr[-STDERR_TAIL:]}"
        )
    # Warnings go to the log, not into the table; the profiler's start and stop lines are left out.
    said = "\n".join(line for line in done.stderr.splitlines() if "ActivityProfiler" not in line)
    if said.strip():
        print(f"  stderr of {' '.join(arguments)}:\n{said[-STDERR_TAIL:]}", file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_once(row: Row, steps: int) -> dict[str, Any]:
    return in_fresh_process("--one", row.model, row.mode, str(steps))


def measure(rows: list[Row], steps: int, rounds: int) -> list[str]:
    """Every row once per round: the models alternate, each model's modes in an order rotating each
    round; the load average at each round's start."""
    loads = []
    by_model = {name: [row for row in rows if row.model == name] for name in MODELS}
    for index in range(rounds):
        loads.append(load_now())
        for own in rotated(list(by_model.values()), index):
            for row in rotated(own, index):
                started = time.perf_counter()
                run = run_once(row, steps)
                row.runs.append(run)
                events = f"  {len(run['events'])} compiler event(s)" if run["events"] else ""
                print(
                    f"round {index + 1}/{rounds}  {row.model:16} {row.mode:6}  step "
                    f"{1000 * run['step_seconds']:6.1f} ms  {run['samples_per_second']:6.0f} samples/s  "
                    f"({run['window_samples_per_second']:4.0f} mean)  "
                    f"compile {run['compile_seconds']:5.1f} s  excess {run['warmup_excess']:5.1f} s  "
                    f"graphs {run['graphs']}  process {time.perf_counter() - started:5.1f} s{events}",
                    file=sys.stderr,
                    flush=True,
                )
    return loads


# ---------------------------------------------------------------------------------------
# Report


def versus_eager(row: Row, eager: Row) -> list[float]:
    """Per round, ``row``'s samples/s after warm-up over eager's of the same model and round."""
    mine, base = row.values("samples_per_second"), eager.values("samples_per_second")
    return [m / b for m, b in zip(mine, base, strict=True)]


def render(
    rows: list[Row], profile: dict[str, float], steps: int, rounds: int, loads: list[str], before: str,
    minutes: float,
) -> str:  # fmt: skip
    eager = {row.model: row for row in rows if row.mode == "none"}
    first = rows[0].runs[0]
    sizes = ", ".join(
        f"{name}: {next(r for r in rows if r.model == name).runs[0]['parameters']:,} parameters"
        for name in MODELS
    )
    removed = [key for key in THREAD_VARIABLES if key in os.environ]
    lines = [
        "# torch.compile on the CPU: `--compile none`, `model` and `blocks` "
        "(charlm: 4 and 8 blocks, fp32 and bf16-mixed)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}; load average "
        f"before / after: {before} / {load_now()}, at each round's start: {', '.join(loads)}; the run took "
        f"{minutes:.1f} min",
        f"- Code measured: commit {git_state()}; torch {first['torch']}",
        f"- Models: `CharLMTask()` (the `charlm` example's defaults: 4 blocks, width 128, 4 heads, 64 "
        f'characters), `CharLMTask(layers=8)`, and charlm with `precision="bf16-mixed"`; {sizes}; AdamW, '
        "fp32 unless named; validation off.",
        f'- Runs: `leantrain.Trainer(TrainConfig(max_steps={steps}, compile=MODE, logger="none", '
        'checkpoint_every="never", progress="none", out_dir=...)).fit(task)`, leantrain\'s defaults '
        f"otherwise: global batch {first['global_batch_size']}, micro-batch {first['micro_batch_size']}, "
        f"{first['compute_threads']} compute threads (leantrain's choice: no thread setting"
        + (f"; {', '.join(removed)} removed from the runs' environment" if removed else "")
        + "), `compile_mode` default. Each run a fresh process with an empty `TORCHINDUCTOR_CACHE_DIR`: "
        "every compiled run compiles cold, as a first run does.",
        f"- Method: {rounds} round(s), every row once per round, the modes of a model in an order rotating "
        f"each round. An `on_step` callback stamps the time after every step; the first {WARMUP} steps are "
        "the warm-up (step 1 runs eagerly: leantrain counts the saved activations there; step 2 "
        f"compiles). *Step*: the median step time of steps {WARMUP + 1} to {steps}. *Samples/s*: the "
        "global batch over that median step time (a median: another process on the machine stretches a "
        "few steps by up to seconds, and a mean would follow them). *vs eager*: per round, over eager's "
        "samples/s of the same model; median [min to max]. *Compile*: `FitResult.compile_seconds` "
        "(torch's compile callbacks). *Warm-up "
        f"excess*: steps 2 to {WARMUP}'s time beyond as many median steps (the wall-clock cost of "
        "compiling, as the run felt it). *summary samples/s*: `FitResult.samples_per_second` (all steps, "
        "compile time left out). *Peak*: `FitResult.peak_memory_bytes` (the process's peak resident set: "
        "compiling in the process counts). *Graphs*: the graphs Dynamo compiled.",
        "",
        "| Model | Compile | Step (ms) | Samples/s | vs eager | Compile (s) | Warm-up excess (s) "
        "| summary samples/s | Peak (MiB) | Graphs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = eager[row.model]
        ratio = "1.00" if row is base else ranged(versus_eager(row, base), 2)
        compiled = row.mode != "none"
        lines.append(
            f"| {row.model} | {row.mode} | {ranged(row.values('step_seconds', 1000), 1)} "
            f"| {ranged(row.values('samples_per_second'), 0, thousands=True)} | {ratio} "
            f"| {ranged(row.values('compile_seconds'), 1) if compiled else '-'} "
            f"| {ranged(row.values('warmup_excess'), 1)} "
            f"| {ranged(row.values('summary_samples_per_second'), 0, thousands=True)} "
            f"| {ranged(row.values('peak_memory_bytes', 2**-20), 0, thousands=True)} "
            f"| {ranged(row.values('graphs'), 0) if compiled else '-'} |"
        )
    events = sorted({event for row in rows for run in row.runs for event in run["events"]})
    lines += ["", f"Compiler events (recompilations, graph breaks): {'; '.join(events) or 'none'}.", ""]
    lines += verdicts(rows, eager)
    lines += explained(profile)
    return "\n".join(lines) + "\n"


def verdicts(rows: list[Row], eager: dict[str, Row]) -> list[str]:
    """The targets, judged on the medians over rounds."""
    by_key = {(row.model, row.mode): row for row in rows}
    speed = versus_eager(by_key["charlm", "blocks"], eager["charlm"])
    met = statistics.median(speed) >= TARGET
    lines = [
        f"- Target: charlm `--compile blocks` >= {TARGET:.2f}x eager samples/s after warm-up: "
        f"**{'met' if met else 'NOT met'}**, {ranged(speed, 2)} ({sum(s >= TARGET for s in speed)} of "
        f"{len(speed)} rounds at or above {TARGET:.2f}).",
    ]
    for name in MODELS:
        blocks = by_key[name, "blocks"].values("compile_seconds")
        whole = by_key[name, "model"].values("compile_seconds")
        share = [b / m for b, m in zip(blocks, whole, strict=True)]
        faster = statistics.median(blocks) < statistics.median(whole)
        lines.append(
            f"- Target: {name}, `blocks` compiles in less time than `model`: "
            f"**{'met' if faster else 'NOT met'}**, {ranged(blocks, 1)} s against {ranged(whole, 1)} s "
            f"(blocks / model per round {ranged(share, 2)})."
        )
    return lines


def explained(profile: dict[str, float]) -> list[str]:
    """Where charlm's step time goes, eager and with its blocks compiled (``kernels``)."""
    eager = {kind: profile[f"eager_{kind}"] for kind in ("matmul", "attention", "other")}
    blocks = {kind: profile[f"blocks_{kind}"] for kind in ("matmul", "attention", "compiled", "other")}
    total = sum(eager.values())
    replaced = eager["other"] - blocks["other"]  # eager time of the blocks' operators that compiled code runs
    return [
        "",
        "Where the time goes: charlm, one batch of 64 in a plain loop (the task's loss and AdamW), "
        f"`torch.profiler`'s self CPU time per step over {PROFILED} steps, one fresh process. Eager: "
        f"matrix products (`mm`, `addmm`) {eager['matmul']:.1f} ms, attention "
        f"(`scaled_dot_product_attention`) {eager['attention']:.1f} ms, everything else (layer norms, GELU, "
        f"residual adds, copies, the loss, AdamW's updates) {eager['other']:.1f} ms; {total:.1f} ms in all. "
        f"Blocks compiled: matrix products {blocks['matmul']:.1f} ms, attention {blocks['attention']:.1f} "
        f"ms (the compiled code calls the same ATen kernels for both), the compiled kernels "
        f"{blocks['compiled']:.1f} ms, everything else {blocks['other']:.1f} ms; "
        f"{sum(blocks.values()):.1f} ms in all. So the operators inside the blocks that compiling fuses "
        f"took {replaced:.1f} ms eager ({replaced / total:.0%} of the step) and {blocks['compiled']:.1f} ms "
        f"as compiled kernels: if they took no time at all, the step would be "
        f"{total / (total - replaced):.2f}x faster. Matrix products and attention, "
        f"{(eager['matmul'] + eager['attention']) / total:.0%} of the eager step, are out of the "
        "compiler's reach in its default mode (`max-autotune` can generate its own matrix products on the "
        "CPU: not measured here).",
    ]


# ---------------------------------------------------------------------------------------
# Command line


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--one":  # a run, in its own process
        print(json.dumps(one(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    if sys.argv[1:] == ["--kernels"]:  # the operator profile, in its own process
        print(json.dumps(kernels()))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(parser, "1 round of 20 steps; prints only", DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run (default 80)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of all rows (default 4)")
    args = parser.parse_args()
    out = output_path(args, DEFAULT_OUT)
    steps, rounds = (20, 1) if args.quick else (args.steps, args.rounds)
    if steps < WARMUP + 3 or rounds < 1:
        parser.error(f"--steps must be at least {WARMUP + 3} and --rounds at least 1")
    before, started = load_now(), time.perf_counter()
    rows = [Row(model, mode) for model in MODELS for mode in MODES]
    loads = measure(rows, steps, rounds)
    profile = in_fresh_process("--kernels")
    minutes = (time.perf_counter() - started) / 60
    publish(render(rows, profile, steps, rounds, loads, before, minutes), out)


if __name__ == "__main__":
    main()
