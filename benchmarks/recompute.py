"""Activation checkpointing and micro-batching: the memory they save and the time they cost (charlm, CPU).

Three measurements, all with one intra-op thread (``torch.set_num_threads(1)``):

1. Activation checkpointing. The ``charlm`` example with 4 and 8 transformer blocks, with and
   without ``activation_checkpointing="Block"`` (every block recomputed in backward):
   the bytes autograd saves for backward in one micro-batch's forward, exact
   (``leantrain.memory.accountant.SavedActivations`` around ``task.loss``, and
   ``FitResult.activation_bytes``, which the engine measures the same way at its first step),
   and the step time of ``leantrain.Trainer.fit``: an ``on_step`` callback stamps every step (wall
   clock, and the process's CPU time beside it), a run's step time is the median gap, warm-up
   dropped; all settings run interleaved in one
   process, several rounds in a rotating order; each baseline runs twice per round (its second
   copy is the noise floor).
2. Micro-batching. The same global batch at 1, 4 and 16 accumulation steps: saved bytes per
   micro-batch, the most saved bytes autograd holds at once over a whole run (a
   ``saved_tensors_hooks`` pair around ``fit`` that counts each saved tensor from its pack until
   autograd drops it), the accountant's totals (``FitResult.params_bytes`` etc.), the step time
   (interleaved as above), and the peak process memory of each setting in a fresh subprocess
   (``VmHWM`` after a reset through ``/proc/self/clear_refs``, minus the resident set before ``fit``).
3. ``leantrain plan``: ``estimate_memory(task, TrainConfig(...)).rows`` (a meta-device model, fake
   tensors) next to the measured bytes of every setting above.

    python benchmarks/recompute.py            # full run (about 5 min on 2 cores); writes results/recompute.md
    python benchmarks/recompute.py --quick    # smoke run (about 1 min); prints the tables only
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

import leantrain as lt
from _common import (
    add_output_options,
    cpu_model,
    current_rss_kib,
    load_now,
    output_path,
    peak_rss_kib,
    publish,
    ranged,
    reset_peak_rss,
    run_probe_script,
)
from leantrain.blocks import BlockPolicy
from leantrain.examples.charlm import CharLMTask
from leantrain.memory.accountant import MemoryBreakdown, SavedActivations, base_tensor
from leantrain.memory.estimate import estimate_memory
from leantrain.memory.recompute import apply_activation_checkpointing

SIZE = {"block": 64, "heads": 4, "width": 128}  # charlm's defaults; the depth varies
CHECKPOINTING = "Block"  # every transformer block of charlm recomputed in backward
LAYERS = (4, 8)  # part 1
CKPT_BATCH = 16  # part 1: global batch, one micro-batch per step
ACCUM_LAYERS = 4  # part 2
ACCUM_BATCH = 64  # part 2: the global batch
ACCUMULATIONS = (1, 4, 16)  # part 2: micro-batch = ACCUM_BATCH / accumulation
BYTES_TARGET = "1 - 2/L"  # the saved bytes checkpointing must cut, at least
TIME_TARGET = 1.45  # the step time it may cost, at most (x the same model without it)
RECOMPUTE_ESTIMATE = 4 / 3  # blocks' forward + backward (1 + 2) plus a second forward (1)
PLAN_TARGET = 0.10  # the plan's activations within 10% of the measured ones
SEED = 0
THREADS = 1
LOG_EVERY = 1000  # more than the steps of a run: the only log point (a host read) is the last step
MIB = 1024 * 1024
PROBES_AT_ONCE = 2  # peak-memory subprocesses side by side (memory, unlike time, does not mind)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "memory.md"


class CharLM(CharLMTask):
    """The charlm example without validation data: validation is no part of a training step."""

    val_data = None  # leantrain validates only when the task's val_data is callable


def make_task(layers: int) -> CharLM:
    return CharLM(layers=layers, **SIZE)


class StepClock:
    """leantrain callback: one stamp per optimizer step, and the peak RSS at the last one."""

    def __init__(self, steps: int, read_rss: bool = False) -> None:
        self.steps = steps
        self.read_rss = read_rss
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []  # the process's CPU time: what other processes cannot stretch
        self.peak_kib = 0

    def on_step(self, stats: lt.StepStats) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        if self.read_rss and len(self.stamps) == self.steps:  # before the final checkpoint is written
            self.peak_kib = peak_rss_kib()


def train(
    task: CharLM,
    global_batch: int,
    micro_batch: int,
    checkpointing: str | None,
    steps: int,
    clock: StepClock,
) -> lt.FitResult:
    # The run folder (metrics.csv, checkpoint, weights) goes to a scratch directory.
    with tempfile.TemporaryDirectory(prefix="leantrain-memory-bench-") as scratch:
        config = lt.TrainConfig(
            global_batch_size=global_batch,
            micro_batch_size=micro_batch,
            max_steps=steps,
            seed=SEED,
            device="cpu",
            activation_checkpointing=checkpointing,
            out_dir=str(Path(scratch) / "run"),
            log_every_n_steps=LOG_EVERY,
            progress="none",
            logger="none",
        )
        return lt.Trainer(config, callbacks=[clock]).fit(task)


# ---------------------------------------------------------------------------------------
# Exact bytes


def first_batch(task: CharLM, size: int) -> Any:
    data = task.train_data()
    return default_collate([data[i] for i in range(size)])


def saved_bytes(task: CharLM, micro_batch: int, checkpointing: str | None) -> int:
    """What autograd saves for backward in one training forward of ``micro_batch`` samples."""
    torch.manual_seed(SEED)
    model = task.model()
    if checkpointing is not None:
        apply_activation_checkpointing(model, BlockPolicy.parse(checkpointing))
    model.train()
    with SavedActivations(model.parameters()) as saved:
        task.loss(model, first_batch(task, micro_batch))
    return saved.bytes


def one_block_recomputed_bytes(task: CharLM, micro_batch: int) -> int:
    """What one Block saves inside itself: what its recomputation holds during backward.

    The block's input is left out: the checkpoint already keeps it (its recomputed layer norm
    saves that same tensor again, no new bytes).
    """
    torch.manual_seed(SEED)
    block = task.model().blocks[0]
    block.train()
    inputs = torch.randn(micro_batch, SIZE["block"], SIZE["width"], requires_grad=True)
    with SavedActivations(block.parameters()) as saved:
        block(inputs)
    return saved.bytes - inputs.numel() * inputs.element_size()


class _Held:
    """What autograd keeps for one saved tensor while a :class:`HeldBytes` counts."""

    __slots__ = ("counter", "root", "tensor")

    def __init__(self, counter: HeldBytes, tensor: torch.Tensor) -> None:
        self.counter, self.tensor, self.root = counter, tensor, base_tensor(tensor)
        counter.acquire(self.root)

    def __del__(self) -> None:  # autograd dropped this save (after its node's backward)
        self.counter.release(self.root)


class HeldBytes:
    """Saved-for-backward bytes autograd holds, live and at their peak, over a whole block of code.

    A ``saved_tensors_hooks`` pair: pack wraps each saved tensor in an object autograd keeps
    until it frees that save; its base tensor counts from the first save to the last release
    (views once, as their base; parameters never). Unlike :class:`SavedActivations`, which
    counts one forward, this sees micro-batches come and go. The engine's own counter (nested,
    so it wins) hides the first micro-batch of the first step from it; so do checkpointed blocks'
    recomputations (torch's checkpoint packs with its own hooks).
    """

    def __init__(self) -> None:
        self.count: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(self, t), lambda h: h.tensor)

    def acquire(self, root: torch.Tensor) -> None:
        if isinstance(root, nn.Parameter):
            return
        key = id(root)  # the root is alive while counted here: its id is not reused
        if key not in self.count:
            self.count[key] = 0
            self.live += root.numel() * root.element_size()
            self.peak = max(self.peak, self.live)
        self.count[key] += 1

    def release(self, root: torch.Tensor) -> None:
        if isinstance(root, nn.Parameter):
            return
        key = id(root)
        self.count[key] -= 1
        if not self.count[key]:
            del self.count[key]
            self.live -= root.numel() * root.element_size()

    def __enter__(self) -> HeldBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def held_peak(task: CharLM, micro_batch: int, steps: int) -> tuple[int, int]:
    """(peak, left at the end) of the saved bytes held at once over a ``fit`` of the global batch."""
    with HeldBytes() as held:
        train(task, ACCUM_BATCH, micro_batch, None, steps, StepClock(steps))
    gc.collect()
    return held.peak, held.live


# ---------------------------------------------------------------------------------------
# Step time, interleaved


@dataclass
class Timed:
    name: str
    layers: int
    global_batch: int
    micro_batch: int
    checkpointing: str | None
    baseline: str  # the name of the row its ratio is taken against
    medians: list[float] = field(default_factory=list)  # seconds per step, one per round
    cpu_medians: list[float] = field(default_factory=list)  # CPU seconds per step, one per round
    losses: list[float] = field(default_factory=list)
    result: lt.FitResult | None = None  # the last run's


def measure_speed(
    entries: list[Timed], tasks: dict[int, CharLM], steps: int, rounds: int, warmup: int, label: str
) -> None:
    # One short untimed run of each setting first: lazy initialisation (oneDNN kernels for each
    # shape, first allocations) would otherwise land in round 1's first run of that setting.
    for entry in entries:
        torch.set_num_threads(THREADS)
        task = tasks[entry.layers]
        train(task, entry.global_batch, entry.micro_batch, entry.checkpointing, 3, StepClock(3))
    for round_index in range(rounds):
        shift = round_index % len(entries)  # no setting always first or last
        for entry in entries[shift:] + entries[:shift]:
            gc.collect()
            torch.set_num_threads(THREADS)
            clock = StepClock(steps)
            result = train(
                tasks[entry.layers], entry.global_batch, entry.micro_batch, entry.checkpointing, steps, clock
            )
            if len(clock.stamps) != steps:
                raise RuntimeError(f"{entry.name} ran {len(clock.stamps)} steps, expected {steps}")
            gaps = [later - earlier for earlier, later in itertools.pairwise(clock.stamps)][warmup:]
            entry.medians.append(statistics.median(gaps))
            cpu_gaps = [later - earlier for earlier, later in itertools.pairwise(clock.cpu_stamps)][warmup:]
            entry.cpu_medians.append(statistics.median(cpu_gaps))
            entry.losses.append(result.final_train_loss)
            entry.result = result
            print(
                f"{label} round {round_index + 1}/{rounds}  {entry.name:<28} "
                f"median {entry.medians[-1] * 1e3:7.1f} ms/step, CPU {entry.cpu_medians[-1] * 1e3:7.1f} ms",
                file=sys.stderr,
                flush=True,
            )


def ratios(entries: list[Timed], cpu: bool = False) -> dict[str, list[float]]:
    """Per round, each row's median step (wall, or CPU) over its baseline's in the same round."""
    named = {entry.name: entry for entry in entries}

    def of(entry: Timed) -> list[float]:
        return entry.cpu_medians if cpu else entry.medians

    return {
        entry.name: [mine / ref for mine, ref in zip(of(entry), of(named[entry.baseline]), strict=True)]
        for entry in entries
    }


# ---------------------------------------------------------------------------------------
# Peak process memory, one fresh subprocess per micro-batch


def rss_probe(micro_batch: int, steps: int, out: Path) -> None:
    """The subprocess: a warm-up fit, then ``steps`` steps of the global batch in ``micro_batch``."""
    torch.set_num_threads(THREADS)
    task = make_task(ACCUM_LAYERS)  # the corpus is read and encoded before the baseline
    # torch's first forward and backward allocate ~100 MiB once per process (oneDNN and
    # thread-pool set-up, lazily loaded code), whatever the batch: paid here, on 2 samples.
    train(task, 2, 2, None, 2, StepClock(2))
    gc.collect()
    reset_peak_rss()
    before = current_rss_kib()
    clock = StepClock(steps, read_rss=True)
    train(task, ACCUM_BATCH, micro_batch, None, steps, clock)
    out.write_text(json.dumps({"before_kib": before, "peak_kib": clock.peak_kib}))


def run_probe(micro_batch: int, steps: int, out: Path) -> float:
    """Peak RSS growth of one probe, MiB."""
    arguments = ["--rss-probe", str(micro_batch), "--rss-steps", str(steps), "--probe-out", str(out)]
    figures = run_probe_script(Path(__file__).resolve(), arguments, out)
    return (figures["peak_kib"] - figures["before_kib"]) / 1024


def measure_rss(micro_batches: Sequence[int], steps: int, repetitions: int) -> dict[int, list[float]]:
    growth: dict[int, list[float]] = {micro: [] for micro in micro_batches}
    jobs = [(micro, repetition) for repetition in range(repetitions) for micro in micro_batches]
    with tempfile.TemporaryDirectory(prefix="leantrain-memory-rss-") as scratch:

        def run_job(job: tuple[int, int]) -> None:
            micro, repetition = job
            growth[micro].append(run_probe(micro, steps, Path(scratch) / f"rss-{micro}-{repetition}.json"))
            print(
                f"repetition {repetition + 1}/{repetitions}  RSS micro-batch {micro:<3} "
                f"+{growth[micro][-1]:.1f} MiB",
                file=sys.stderr,
                flush=True,
            )

        with ThreadPoolExecutor(max_workers=PROBES_AT_ONCE) as pool:
            list(pool.map(run_job, jobs))
    return growth


# ---------------------------------------------------------------------------------------
# The plan


@dataclass
class PlanCheck:
    setting: str
    micro_batch: int
    planned_activations: int
    measured_activations: int  # SavedActivations around task.loss
    planned_total: int
    measured_total: int  # the FitResult's four fields

    @property
    def ratio(self) -> float:
        return self.planned_activations / self.measured_activations

    @property
    def total_ratio(self) -> float:
        return self.planned_total / self.measured_total


def planned_rows(task: CharLM, global_batch: int, checkpointing: str | None) -> dict[int, MemoryBreakdown]:
    """The plan's breakdown of every candidate micro-batch of ``global_batch``."""
    config = lt.TrainConfig(
        global_batch_size=global_batch, activation_checkpointing=checkpointing, device="cpu"
    )
    return {row.micro_batch_size: row.memory for row in estimate_memory(task, config).rows}


def fit_total(result: lt.FitResult) -> int:
    return result.params_bytes + result.grads_bytes + result.optimizer_bytes + result.activation_bytes


# ---------------------------------------------------------------------------------------
# Report


def mib(count: float) -> str:
    return f"{count / MIB:.2f}"


def noise(floor: float) -> float:
    """How far from 1 a ratio must be to count as a difference: the noise floor's distance, or 2%."""
    return max(abs(floor - 1), 0.02)


def by_name(entries: list[Timed], name: str) -> Timed:
    return next(entry for entry in entries if entry.name == name)


def yes_no(met: bool) -> str:
    return "yes" if met else "**no**"


@dataclass
class Results:
    saved: dict[tuple[int, str | None], int]  # (layers, checkpointing) -> bytes, micro-batch CKPT_BATCH
    block_inside: dict[int, int]  # layers -> one block's recomputed saves (the same for any depth)
    ckpt_timed: list[Timed]
    accum_saved: dict[int, int]  # micro-batch -> bytes
    held: dict[int, tuple[int, int]]  # micro-batch -> (peak, left at the end)
    accum_timed: list[Timed]
    rss: dict[int, list[float]]
    plans: list[PlanCheck]
    params: dict[int, int]  # layers -> parameter count


def ckpt_name(layers: int, checkpointing: str | None, again: bool = False) -> str:
    what = f'checkpointing "{checkpointing}"' if checkpointing else "no checkpointing"
    return f"L={layers}, {what}{', again' if again else ''}"


def accum_name(accumulation: int, again: bool = False) -> str:
    return f"accumulation {accumulation}{', again' if again else ''}"


def verdicts(res: Results) -> dict[int, dict[str, float]]:
    """Per depth: the byte cut, its target, the step ratio and its range."""
    speed, cpu = ratios(res.ckpt_timed), ratios(res.ckpt_timed, cpu=True)
    out = {}
    for layers in LAYERS:
        plain, recomputed = res.saved[(layers, None)], res.saved[(layers, CHECKPOINTING)]
        step = speed[ckpt_name(layers, CHECKPOINTING)]
        floor = ckpt_name(layers, None, again=True)
        out[layers] = {
            "cut": 1 - recomputed / plain,
            "needed": 1 - 2 / layers,
            "bound_cut": 1 - (recomputed + res.block_inside[layers]) / plain,
            "ratio": statistics.median(step),
            "ratio_max": max(step),
            "floor": statistics.median(speed[floor]),
            "cpu_ratio": statistics.median(cpu[ckpt_name(layers, CHECKPOINTING)]),
            "cpu_floor": statistics.median(cpu[floor]),
        }
    return out


def time_table(entries: list[Timed], against: str) -> list[str]:
    speed, cpu = ratios(entries), ratios(entries, cpu=True)
    lines = [
        f"| Setting | Median step (ms) | {against} | CPU per step (ms) | CPU {against} | Final train loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for entry in entries:
        lines.append(
            f"| {entry.name} | {statistics.median(entry.medians) * 1e3:.1f} | {ranged(speed[entry.name], 3)} "
            f"| {statistics.median(entry.cpu_medians) * 1e3:.1f} | {ranged(cpu[entry.name], 3)} "
            f"| {ranged(entry.losses, 4)} |"
        )
    return lines


def render(res: Results, args: argparse.Namespace, load_before: str, minutes: float) -> str:
    size_text = ", ".join(f"{k}={v}" for k, v in SIZE.items())
    lines = [
        "# Activation checkpointing and micro-batching on the CPU: memory and step time (charlm)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} "
        f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} CPU cores visible, Python "
        f"{platform.python_version()}; load average before / after: {load_before} / {load_now()}; "
        f"the full run took {minutes:.1f} min",
        f"- Versions: torch {torch.__version__}, leantrain {lt.__version__}",
        f"- Threads: `torch.set_num_threads({THREADS})` everywhere (stable timings on a shared machine)",
        f"- Work: the `charlm` example, `CharLMTask(layers=L, {size_text})` (L={LAYERS[0]}: "
        f"{res.params[LAYERS[0]]:,} parameters, L={LAYERS[1]}: {res.params[LAYERS[1]]:,}; tied "
        "embeddings), validation left out; AdamW (lr 3e-3, weight decay 0.01), fp32; "
        f"`leantrain.Trainer(TrainConfig(global_batch_size=..., micro_batch_size=..., seed={SEED}, "
        f'activation_checkpointing=None or "{CHECKPOINTING}", log_every_n_steps={LOG_EVERY}, '
        'progress="none", logger="none")).fit(task)`',
        "- Step time: an `on_step` callback stamps `time.perf_counter()` after every step; a run's step "
        "time is the median gap between stamps, the first gaps dropped (the first step also counts "
        "the saved activations, through Python hooks). All settings of a table run interleaved in one "
        "process, in a rotating order, after an untimed 3-step run of each. *Median step*: median over "
        "rounds. *vs ...*: median over rounds of the ratio to the baseline of the same round, range "
        "in brackets. Each baseline runs twice per round: the ratio of its second copy (*again*) is "
        "the noise floor. *CPU*: the same from `time.process_time()` stamps (the process's CPU time, "
        "which other processes competing for the cores do not stretch, unlike the wall time; the "
        "targets are judged on the wall time).",
        "",
        f'## 1. Activation checkpointing (`"{CHECKPOINTING}"`: every block recomputed)',
        "",
        f"- Global batch {CKPT_BATCH} sequences of {SIZE['block']} characters, one micro-batch per step.",
        "- *Saved*: the bytes autograd saves for backward in one training forward of the micro-batch, "
        "exact: `leantrain.memory.accountant.SavedActivations(model.parameters())` around "
        "`task.loss(model, batch)` on a fresh model in train mode (each tensor once, views as their "
        "base, parameters excluded). *FitResult*: `FitResult.activation_bytes` of the timed runs (the "
        "engine's count at its first step). With checkpointing, backward recomputes one block at a time "
        "and holds that block's inner saves until its backward is done: *Saved + one block* adds "
        "what one `Block` saves inside itself (its input excluded: the checkpoint keeps it already), "
        "an upper bound of the saved bytes held at once during backward (the head's and later blocks' "
        "saves are freed by then). *Cut*: 1 - bytes / the same depth without checkpointing. MiB.",
        "",
        "| Layers | Checkpointing | Saved | FitResult | Cut | Saved + one block | Cut |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    named = {entry.name: entry for entry in res.ckpt_timed}
    for layers in LAYERS:
        plain = res.saved[(layers, None)]
        for checkpointing in (None, CHECKPOINTING):
            saved = res.saved[(layers, checkpointing)]
            fit = named[ckpt_name(layers, checkpointing)].result
            bound = saved + (res.block_inside[layers] if checkpointing else 0)
            cut, bound_cut = "-", "-"
            if checkpointing:
                cut, bound_cut = f"{1 - saved / plain:.1%}", f"{1 - bound / plain:.1%}"
            lines.append(
                f"| {layers} | {checkpointing or '-'} | {mib(saved)} | {mib(fit.activation_bytes)} "
                f"| {cut} | {mib(bound)} | {bound_cut} |"
            )
    lines += [
        "",
        f"Step time: {args.steps} steps per run, the first {args.warmup} gaps dropped, {args.rounds} "
        "rounds. *vs plain*: against the same depth without checkpointing.",
        "",
        *time_table(res.ckpt_timed, "vs plain"),
    ]
    judged = verdicts(res)
    lines += [
        "",
        f"Targets: saved bytes cut by at least {BYTES_TARGET}, at most {TIME_TARGET}x the step time "
        "(median ratio over rounds, wall time; the worst round in brackets; the CPU-time ratio beside).",
        "",
        "| Layers | Saved bytes cut | Needed | Met | Step time | CPU time | Needed | Met |",
        "|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for layers, v in judged.items():
        lines.append(
            f"| {layers} | {v['cut']:.1%} | >= {v['needed']:.1%} | {yes_no(v['cut'] >= v['needed'])} "
            f"| {v['ratio']:.3f}x (worst {v['ratio_max']:.3f}x) | {v['cpu_ratio']:.3f}x | <= {TIME_TARGET}x "
            f"| {yes_no(v['ratio'] <= TIME_TARGET)} |"
        )

    accum_by_name = {entry.name: entry for entry in res.accum_timed}
    first = accum_by_name[accum_name(ACCUMULATIONS[0])].result
    lines += [
        "",
        f"## 2. Micro-batching: global batch {ACCUM_BATCH} at accumulation "
        f"{', '.join(map(str, ACCUMULATIONS))}",
        "",
        f"- `CharLMTask(layers={ACCUM_LAYERS}, {size_text})`, no checkpointing; `global_batch_size="
        f"{ACCUM_BATCH}`, `micro_batch_size` = {ACCUM_BATCH} / accumulation.",
        "- *Saved per micro-batch*: `SavedActivations` around one forward, as in part 1. *Held at once*: "
        "the most saved-for-backward bytes autograd held at the same time over a whole "
        f"{args.held_steps}-step `fit`, counted by a `saved_tensors_hooks` pair around `fit` (each saved "
        "tensor from its pack until autograd drops it; the engine's own count of the first micro-batch, "
        "nested inside, hides that one micro-batch from it). *Left*: what was still held after `fit`.",
        "- *Params*, *Grads*, *Optimizer*, *Activations*: the accountant's figures in the `FitResult` "
        "(`params_bytes`, `grads_bytes`, `optimizer_bytes`, `activation_bytes`), *Total* their sum. MiB.",
        "",
        "| Accumulation | Micro-batch | Saved per micro-batch | Held at once | Left | Params | Grads "
        "| Optimizer | Activations | Total |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for accumulation in ACCUMULATIONS:
        micro = ACCUM_BATCH // accumulation
        fit = accum_by_name[accum_name(accumulation)].result
        peak, left = res.held[micro]
        lines.append(
            f"| {accumulation} | {micro} | {mib(res.accum_saved[micro])} | {mib(peak)} | {mib(left)} "
            f"| {mib(fit.params_bytes)} | {mib(fit.grads_bytes)} | {mib(fit.optimizer_bytes)} "
            f"| {mib(fit.activation_bytes)} | {mib(fit_total(fit))} |"
        )
    lines += [
        "",
        "Peak process memory: `python benchmarks/recompute.py --rss-probe MICRO --rss-steps "
        f"{args.rss_steps}` "
        "in a fresh process per run: the task is built, an untimed 2-step `fit` on 2 samples pays "
        "torch's one-off first-step cost (about 100 MiB, whatever the batch), the high-water mark is "
        "reset (`/proc/self/clear_refs`), and the global batch trains "
        f"{args.rss_steps} steps. *Growth*: the peak RSS (`VmHWM`) at the last step's `on_step`, minus "
        "the RSS right before `fit`; *Accountant*: what that `fit` adds by the accountant's count "
        f"(grads + optimizer state + one micro-batch's activations). {args.rss_repetitions} "
        f"repetition(s), {PROBES_AT_ONCE} at a time, median, range in brackets. MiB.",
        "",
        "| Accumulation | Micro-batch | Peak RSS growth | Accountant |",
        "|---:|---:|---:|---:|",
    ]
    for accumulation in ACCUMULATIONS:
        micro = ACCUM_BATCH // accumulation
        fit = accum_by_name[accum_name(accumulation)].result
        added = fit.grads_bytes + fit.optimizer_bytes + fit.activation_bytes
        lines.append(f"| {accumulation} | {micro} | {ranged(res.rss[micro], 1)} | {mib(added)} |")
    lines += [
        "",
        f"Step time: {args.accum_steps} steps per run, the first {args.accum_warmup} gaps dropped, "
        f"{args.accum_rounds} rounds. *vs 1*: against accumulation 1 (one micro-batch of {ACCUM_BATCH}).",
        "",
        *time_table(res.accum_timed, "vs 1"),
    ]
    lines += [
        "",
        "## 3. `leantrain plan` against the measurement",
        "",
        "- *Plan*: `leantrain.memory.estimate.estimate_memory(task, TrainConfig(global_batch_size=..., "
        "activation_checkpointing=...)).rows`, the row of the micro-batch (a model on the meta "
        "device, a forward on fake tensors). *Measured*: `SavedActivations` around a real forward "
        "(part 1 and 2), and for the totals the `FitResult`'s four fields of the same setting. Bytes.",
        "",
        "| Setting | Micro-batch | Plan: activations | Measured | Plan / measured | Plan: total "
        "| FitResult total | Plan / measured | Within 10% |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for check in res.plans:
        within = abs(check.ratio - 1) <= PLAN_TARGET and abs(check.total_ratio - 1) <= PLAN_TARGET
        lines.append(
            f"| {check.setting} | {check.micro_batch} | {check.planned_activations:,} "
            f"| {check.measured_activations:,} | {check.ratio:.4f} | {check.planned_total:,} "
            f"| {check.measured_total:,} | {check.total_ratio:.4f} | {yes_no(within)} |"
        )
    lines += ["", "## Reading the results", "", *interpretation(res, first)]
    return "\n".join(lines) + "\n"


def interpretation(res: Results, first: lt.FitResult) -> list[str]:
    """A few sentences derived from the numbers of this run (so a re-run stays truthful)."""
    judged = verdicts(res)
    lines = []
    for layers, v in judged.items():
        inputs = layers * CKPT_BATCH * SIZE["block"] * SIZE["width"] * 4  # each block's fp32 input
        rest = res.saved[(layers, CHECKPOINTING)] - inputs
        bytes_met, time_met = v["cut"] >= v["needed"], v["ratio"] <= TIME_TARGET
        lines.append(
            f"- L={layers}: checkpointing every block cuts the saved bytes by {v['cut']:.1%} (needed "
            f">= {v['needed']:.0%}: {'met' if bytes_met else 'missed'}), and by {v['bound_cut']:.1%} "
            f"counting the block that backward recomputes at a time. What is left: the {layers} block "
            f"inputs ({mib(inputs)} MiB) and {mib(rest)} MiB outside the blocks (embeddings, final "
            "norm, the head's logits and the cross-entropy), the same at any depth, so the cut grows "
            f"with L. Step time {v['ratio']:.2f}x (worst round {v['ratio_max']:.2f}x; needed <= "
            f"{TIME_TARGET}x: {'met' if time_met else 'missed'}), CPU time {v['cpu_ratio']:.2f}x; noise "
            f"floors {v['floor']:.3f} (wall) and {v['cpu_floor']:.3f} (CPU)."
        )
    measured = ", ".join(
        f"L={layers} {v['ratio']:.2f}x wall, {v['cpu_ratio']:.2f}x CPU" for layers, v in judged.items()
    )
    above = [
        layers for layers, v in judged.items() if v["cpu_ratio"] > RECOMPUTE_ESTIMATE + noise(v["cpu_floor"])
    ]
    same_loss = all(
        ranged(by_name(res.ckpt_timed, ckpt_name(layers, None)).losses, 4)
        == ranged(by_name(res.ckpt_timed, ckpt_name(layers, CHECKPOINTING)).losses, 4)
        for layers in LAYERS
    )
    lines.append(
        "- Time. Recomputation runs every block's forward a second time, in backward; with a backward "
        f"that costs about twice its forward, that is about {RECOMPUTE_ESTIMATE:.2f}x the blocks' time, "
        "and the embeddings, head, loss and optimizer step are not recomputed, so a whole step should "
        f"cost less than that. Measured: {measured}"
        + (
            f"; in CPU time (which other processes disturb least) above the estimate at L="
            f"{', '.join(map(str, above))}: there recomputation costs more than a third of a block's "
            "forward + backward, or the blocks' backward costs less than twice their forward."
            if above
            else "; in CPU time (which other processes disturb least) no more than the estimate, within "
            "the noise."
        )
        + (
            " The final train loss is the same with and without checkpointing (to 4 digits): the "
            "recomputed forward gives the same values."
            if same_loss
            else " The final train loss differs with checkpointing (see the table)."
        )
    )
    micros = [ACCUM_BATCH // a for a in ACCUMULATIONS]
    saved = [res.accum_saved[m] for m in micros]
    held_equal = all(res.held[m][0] == res.accum_saved[m] for m in micros)
    lines.append(
        "- Micro-batching: the saved bytes per micro-batch are "
        + ", ".join(f"{mib(b)} MiB at {m}" for m, b in zip(micros, saved, strict=True))
        + f" ({saved[0] / saved[-1]:.1f}x from {micros[0]} to {micros[-1]}: proportional to the "
        "micro-batch). "
        + (
            "Over a whole run the most autograd held at once is exactly one micro-batch's, whatever "
            "the accumulation: each micro-batch's backward frees its saves before the next forward, so "
            "the peak activation memory is the micro-batch's (SPEC)."
            if held_equal
            else "Over a whole run the most autograd held at once differs from one micro-batch's ("
            + ", ".join(f"{mib(res.held[m][0])} MiB at {m}" for m in micros)
            + "): saves of one micro-batch outlive its backward."
        )
        + f" Parameters ({mib(first.params_bytes)} MiB), gradients ({mib(first.grads_bytes)}) and "
        f"optimizer state ({mib(first.optimizer_bytes)}) do not depend on it."
    )
    growth = {m: statistics.median(res.rss[m]) for m in micros}
    accum_speed = ratios(res.accum_timed)
    falls = all(growth[a] > growth[b] for a, b in itertools.pairwise(micros))
    lines.append(
        f"- The process {'agrees' if falls else 'does not simply follow'}: peak RSS growth "
        + ", ".join(f"{growth[m]:.0f} MiB at micro-batch {m}" for m in micros)
        + ". It also holds what no saved tensor is: the gradients flowing back, temporaries inside "
        "operations (attention, the logits' softmax), the allocator's cached blocks; so it does not "
        "follow the saved bytes one to one."
    )
    accum_cpu = ratios(res.accum_timed, cpu=True)
    again = accum_name(ACCUMULATIONS[0], again=True)
    floor, cpu_floor = statistics.median(accum_speed[again]), statistics.median(accum_cpu[again])
    pace = {a: statistics.median(accum_speed[accum_name(a)]) for a in ACCUMULATIONS[1:]}
    cpu_pace = {a: statistics.median(accum_cpu[accum_name(a)]) for a in ACCUMULATIONS[1:]}

    def compared(ratio: float) -> str:
        if abs(ratio - 1) <= noise(cpu_floor):
            return "as fast (within the noise)"
        return "slower" if ratio > 1 else "faster"

    reasons = []
    if any(r > 1 + noise(cpu_floor) for r in cpu_pace.values()):
        reasons.append(
            "Slower: more, smaller kernels, and the per-micro-batch work of the engine and of torch "
            "paid more often."
        )
    if any(r < 1 - noise(cpu_floor) for r in cpu_pace.values()):
        reasons.append(
            "Faster: probably a working set (attention scores, MLP activations) that stays in the "
            "CPU caches better."
        )
    same_loss = len({ranged(e.losses, 4) for e in res.accum_timed}) == 1
    lines.append(
        "- Step time of the global batch, against one micro-batch of "
        f"{ACCUM_BATCH}: "
        + ", ".join(
            f"accumulation {a} {pace[a]:.2f}x wall and {cpu_pace[a]:.2f}x CPU, {compared(cpu_pace[a])}"
            for a in pace
        )
        + f" (judged on CPU time; noise floors {floor:.3f} wall, {cpu_floor:.3f} CPU)."
        + "".join(" " + reason for reason in reasons)
        + (
            " The final train loss is the same at every accumulation (to 4 digits): the loss is summed "
            "over the global batch, however it is split."
            if same_loss
            else " The final train loss differs between accumulations (see the table)."
        )
    )
    floors, cpu_floors = (
        [
            r
            for timed in (res.ckpt_timed, res.accum_timed)
            for entry in timed
            if entry.name.endswith("again")
            for r in ratios(timed, cpu=cpu)[entry.name]
        ]
        for cpu in (False, True)
    )
    lines.append(
        f"- Noise: the noise-floor rounds (each baseline against its own second copy) range from "
        f"{min(floors):.3f} to {max(floors):.3f} in wall time, {min(cpu_floors):.3f} to "
        f"{max(cpu_floors):.3f} in CPU time; a single round's ratio is no more precise than that, the "
        "medians over rounds are. Other processes on the machine (see the load average) are the first "
        "suspect of a wide range."
    )
    worst = max(res.plans, key=lambda c: abs(c.ratio - 1))
    worst_total = max(res.plans, key=lambda c: abs(c.total_ratio - 1))
    all_within = all(abs(c.ratio - 1) <= PLAN_TARGET for c in res.plans)
    exact = all(c.planned_activations == c.measured_activations for c in res.plans)
    lines.append(
        f"- `leantrain plan`: its activations are within {PLAN_TARGET:.0%} of the measured ones in "
        f"{sum(abs(c.ratio - 1) <= PLAN_TARGET for c in res.plans)} of {len(res.plans)} settings "
        f"({'met' if all_within else 'missed'}); "
        + (
            "they are equal to the byte in every one (the plan counts the same saved tensors, on fake "
            "tensors of the same shapes)"
            if exact
            else f"the furthest is {worst.setting}, micro-batch {worst.micro_batch}: {worst.ratio:.4f}"
        )
        + ". Totals (with parameters, gradients and optimizer state): furthest "
        f"{worst_total.total_ratio:.4f} ({worst_total.setting}, micro-batch {worst_total.micro_batch})."
    )
    return lines


# ---------------------------------------------------------------------------------------
# Orchestration


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per checkpointing run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first step gaps dropped (default 5)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of the checkpointing runs (default 9)")
    parser.add_argument(
        "--accum-steps", type=int, default=12, help="steps per micro-batching run (default 12)"
    )
    parser.add_argument(
        "--accum-warmup", type=int, default=3, help="first step gaps dropped, micro-batching (default 3)"
    )
    parser.add_argument(
        "--accum-rounds", type=int, default=5, help="rounds of the micro-batching runs (default 5)"
    )
    parser.add_argument(
        "--held-steps", type=int, default=3, help="steps of the run counting held bytes (default 3)"
    )
    parser.add_argument(
        "--rss-steps", type=int, default=6, help="steps of each peak-memory subprocess (default 6)"
    )
    parser.add_argument(
        "--rss-repetitions", type=int, default=2, help="peak-memory subprocesses per setting (default 2)"
    )
    add_output_options(
        parser,
        "smoke run: fewer steps and rounds, 1 peak-memory run each; writes only with --out",
        DEFAULT_OUT,
    )
    # Internal: the peak-memory subprocess.
    parser.add_argument("--rss-probe", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_probe is not None:
        if args.probe_out is None:
            parser.error("--rss-probe needs --probe-out")
        return args
    if args.quick:
        args.steps, args.warmup, args.rounds = 10, 3, 2
        args.accum_steps, args.accum_warmup, args.accum_rounds = 6, 2, 1
        args.held_steps, args.rss_steps, args.rss_repetitions = 2, 3, 1
    args.out = output_path(args, DEFAULT_OUT)
    if args.steps <= args.warmup + 1 or args.accum_steps <= args.accum_warmup + 1:
        parser.error("--steps must exceed --warmup + 1, and --accum-steps --accum-warmup + 1")
    if min(args.rounds, args.accum_rounds, args.held_steps, args.rss_steps, args.rss_repetitions) < 1:
        parser.error("rounds, --held-steps, --rss-steps and --rss-repetitions must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_probe is not None:
        rss_probe(args.rss_probe, args.rss_steps, args.probe_out)
        return 0
    started = time.perf_counter()
    load_before = load_now()
    torch.set_num_threads(THREADS)
    tasks = {layers: make_task(layers) for layers in sorted({*LAYERS, ACCUM_LAYERS})}
    params = {layers: sum(p.numel() for p in tasks[layers].model().parameters()) for layers in LAYERS}

    # Exact bytes, and the plan's prediction of them.
    saved = {
        (layers, checkpointing): saved_bytes(tasks[layers], CKPT_BATCH, checkpointing)
        for layers in LAYERS
        for checkpointing in (None, CHECKPOINTING)
    }
    block_inside = {layers: one_block_recomputed_bytes(tasks[layers], CKPT_BATCH) for layers in LAYERS}
    micros = [ACCUM_BATCH // accumulation for accumulation in ACCUMULATIONS]
    accum_saved = {micro: saved_bytes(tasks[ACCUM_LAYERS], micro, None) for micro in micros}
    ckpt_plans = {
        key: planned_rows(tasks[key[0]], CKPT_BATCH, key[1])[CKPT_BATCH] for key in saved
    }  # (layers, checkpointing) -> breakdown
    accum_plan = planned_rows(tasks[ACCUM_LAYERS], ACCUM_BATCH, None)
    print("exact bytes and plans done", file=sys.stderr, flush=True)

    # 1. Checkpointing, step time.
    ckpt_timed = []
    for layers in LAYERS:
        plain = ckpt_name(layers, None)
        for name, checkpointing in (
            (plain, None),
            (ckpt_name(layers, CHECKPOINTING), CHECKPOINTING),
            (ckpt_name(layers, None, again=True), None),
        ):
            ckpt_timed.append(Timed(name, layers, CKPT_BATCH, CKPT_BATCH, checkpointing, plain))
    measure_speed(ckpt_timed, tasks, args.steps, args.rounds, args.warmup, "checkpointing")

    # 2. Micro-batching, step time, held bytes, process memory.
    base = accum_name(ACCUMULATIONS[0])
    accum_timed = [
        Timed(accum_name(a), ACCUM_LAYERS, ACCUM_BATCH, ACCUM_BATCH // a, None, base) for a in ACCUMULATIONS
    ]
    accum_timed.append(
        Timed(accum_name(ACCUMULATIONS[0], again=True), ACCUM_LAYERS, ACCUM_BATCH, ACCUM_BATCH, None, base)
    )
    measure_speed(
        accum_timed, tasks, args.accum_steps, args.accum_rounds, args.accum_warmup, "micro-batching"
    )
    held = {micro: held_peak(tasks[ACCUM_LAYERS], micro, args.held_steps) for micro in micros}
    rss = measure_rss(micros, args.rss_steps, args.rss_repetitions)

    # 3. The plan against the measurements.
    ckpt_results = {(e.layers, e.checkpointing): e.result for e in ckpt_timed if not e.name.endswith("again")}
    plans = [
        PlanCheck(
            ckpt_name(layers, checkpointing),
            CKPT_BATCH,
            ckpt_plans[(layers, checkpointing)].activation_bytes,
            saved[(layers, checkpointing)],
            ckpt_plans[(layers, checkpointing)].total_bytes,
            fit_total(ckpt_results[(layers, checkpointing)]),
        )
        for layers, checkpointing in saved
    ]
    accum_results = {e.micro_batch: e.result for e in accum_timed if not e.name.endswith("again")}
    plans += [
        PlanCheck(
            f"L={ACCUM_LAYERS}, global batch {ACCUM_BATCH}",
            micro,
            accum_plan[micro].activation_bytes,
            accum_saved[micro],
            accum_plan[micro].total_bytes,
            fit_total(accum_results[micro]),
        )
        for micro in micros
    ]
    results = Results(saved, block_inside, ckpt_timed, accum_saved, held, accum_timed, rss, plans, params)
    minutes = (time.perf_counter() - started) / 60
    table = render(results, args, load_before, minutes)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
