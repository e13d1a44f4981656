"""Step time and memory of each precision mode, training the ``charlm`` example on the CPU.

Three measurements, all with one intra-op thread (``torch.set_num_threads(1)``):

1. Step time. ``leantrain.Trainer.fit`` trains the same charlm model under every value of
   ``TrainConfig.precision``; an ``on_step`` callback stamps ``time.perf_counter()`` after each
   optimizer step, and a run's step time is the median gap between stamps, warm-up dropped.
   The modes run interleaved in one process, several rounds in a rotating order, after an
   untimed warm-up run of each; fp32 runs twice per round (its second copy is the noise floor).
   The fit result's skipped steps (fp16's loss scale settling) and final train loss are kept.
2. State bytes, exact: one optimizer step driven by hand through the precision object
   (``prepare``, ``autocast``, ``backward``, ``unscale_and_clip``, ``step``), counting the bytes
   of the weights, fp32 master weights, gradients, AdamW state, and the activations autograd
   saves for one micro-batch (``saved_tensors_hooks``, each storage once).
3. Peak process memory. Each mode trains in a fresh subprocess (this file with a hidden flag);
   the peak resident set (``VmHWM``) minus the resident set right before ``fit``: *cold*, the
   first ``fit`` of the process, and *warm*, after a 2-step ``fit`` on a micro-batch of 2 that
   pays torch's one-off first-step costs. ``ru_maxrss`` is not used: in a child of a large
   process it reports at least the parent's peak (Linux keeps the high-water mark of the image
   replaced by ``exec`` in the process's rusage), which hid every difference between modes.

    python benchmarks/precision.py            # full run (about 6 min on 2 cores); writes results/precision.md
    python benchmarks/precision.py --quick    # smoke run; prints the tables only
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

import leantrain as lt
from _common import (
    add_output_options,
    current_rss_kib,
    load_now,
    output_path,
    peak_rss_kib,
    publish,
    ranged,
    reset_peak_rss,
    run_probe_script,
)
from leantrain.data.loader import move_to_device
from leantrain.examples.charlm import CharLMTask
from leantrain.step.precision import make_precision

MODES = ("32", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
BASELINE, NOISE_FLOOR = "32", "32, again"
SIZE = {"block": 64, "layers": 4, "heads": 4, "width": 128}
BATCH_SIZE = 32  # one micro-batch per step: no accumulation
SEED = 0
THREADS = 1
LOG_EVERY = 1000  # more than the steps of a run: the only log point (a host read) is the last step
CPU = torch.device("cpu")
MIB = 1024 * 1024
PROBES_AT_ONCE = 2  # peak-memory subprocesses run side by side
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "precision.md"
# CPU features that decide whether 16-bit math can be fast: bf16 dot products (AVX512-BF16),
# bf16 matrix tiles (AMX-BF16), fp16 arithmetic (AVX512-FP16), fp16 tiles (AMX-FP16).
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "amx_tile")


class CharLM(CharLMTask):
    """The charlm example without validation data: validation is no part of a training step."""

    val_data = None  # leantrain validates only when the task's val_data is callable


def make_task() -> CharLM:
    return CharLM(**SIZE)


class StepClock:
    """leantrain callback: one stamp per optimizer step, and the peak RSS at the last one."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.stamps: list[float] = []
        self.peak_kib = 0

    def on_step(self, stats: lt.StepStats) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == self.steps:  # before the final checkpoint and weight export
            self.peak_kib = peak_rss_kib()


def train(
    task: CharLM, mode: str, steps: int, clock: StepClock, batch_size: int = BATCH_SIZE
) -> lt.FitResult:
    # The run folder (metrics.csv, checkpoint, weights) goes to a scratch directory.
    with tempfile.TemporaryDirectory(prefix="leantrain-precision-bench-") as scratch:
        config = lt.TrainConfig(
            global_batch_size=batch_size,
            max_steps=steps,
            seed=SEED,
            device="cpu",
            precision=mode,
            out_dir=str(Path(scratch) / "run"),
            log_every_n_steps=LOG_EVERY,
            progress="none",
            logger="none",
        )
        return lt.Trainer(config, callbacks=[clock]).fit(task)


# ---------------------------------------------------------------------------------------
# 1. Step time


@dataclass
class Timed:
    name: str
    mode: str
    medians: list[float] = field(default_factory=list)  # seconds per step, one per round
    skipped: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def measure_speed(task: CharLM, steps: int, rounds: int, warmup: int) -> list[Timed]:
    timed = [Timed(mode, mode) for mode in MODES] + [Timed(NOISE_FLOOR, BASELINE)]
    # One short untimed run of each mode first: lazy initialisation (oneDNN kernels for each
    # dtype, first allocations) would otherwise land in round 1's first run of that mode.
    for mode in MODES:
        torch.set_num_threads(THREADS)
        train(task, mode, 3, StepClock(3))
    for round_index in range(rounds):
        shift = round_index % len(timed)  # no mode always first or last
        for entry in timed[shift:] + timed[:shift]:
            gc.collect()
            torch.set_num_threads(THREADS)
            clock = StepClock(steps)
            result = train(task, entry.mode, steps, clock)
            if len(clock.stamps) != steps:
                raise RuntimeError(f"{entry.name} ran {len(clock.stamps)} steps, expected {steps}")
            gaps = [later - earlier for earlier, later in itertools.pairwise(clock.stamps)][warmup:]
            entry.medians.append(statistics.median(gaps))
            entry.skipped.append(result.skipped_steps)
            entry.losses.append(result.final_train_loss)
            print(
                f"round {round_index + 1}/{rounds}  {entry.name:<11} "
                f"median {entry.medians[-1] * 1e3:7.1f} ms/step, {result.skipped_steps} skipped",
                file=sys.stderr,
                flush=True,
            )
    return timed


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MATMUL, ATTENTION, FORWARD = "matmul", "attention", "attention forward"


def median_ms(run: Callable[[], object], repeats: int = 30) -> float:
    run()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3


def kernel_ms() -> dict[str, dict[str, float]]:
    """Two of charlm's kernels on its shapes, per dtype, in ms: where the step time goes.

    The MLP's first matmul on a micro-batch (forward), and causal attention as the model
    calls it (``scaled_dot_product_attention``), forward and backward, once per layer; and
    its forward alone.
    """
    rows, inner, cols = BATCH_SIZE * SIZE["block"], SIZE["width"], 4 * SIZE["width"]
    qkv_shape = (BATCH_SIZE, SIZE["heads"], SIZE["block"], SIZE["width"] // SIZE["heads"])
    times: dict[str, dict[str, float]] = {MATMUL: {}, ATTENTION: {}, FORWARD: {}}
    for name, dtype in DTYPES.items():
        a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype)
        times[MATMUL][name] = median_ms(lambda a=a, b=b: a @ b)
        q, k, v = (torch.randn(qkv_shape).to(dtype).requires_grad_() for _ in range(3))

        def attention(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))
            for tensor in (q, k, v):
                tensor.grad = None

        times[ATTENTION][name] = median_ms(attention)
        with torch.no_grad():
            times[FORWARD][name] = median_ms(
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            )
    return times


# ---------------------------------------------------------------------------------------
# 2. State bytes of one step, driven by hand


def nbytes(tensors: Sequence[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class StateBytes:
    params: int  # parameter count (tied weights once)
    weights: int
    weight_dtype: str
    masters: int
    grads: int  # the model's .grad after backward
    master_grads: int  # the fp32 copies unscale_and_clip makes (-true only)
    optimizer: int
    activations: int

    @property
    def persistent(self) -> int:
        """What lives between steps (gradients are set to None after each step)."""
        return self.weights + self.masters + self.optimizer

    @property
    def counted(self) -> int:
        return self.persistent + self.grads + self.master_grads + self.activations


def state_bytes(task: CharLM, mode: str) -> StateBytes:
    torch.manual_seed(SEED)
    model = task.model()
    precision = make_precision(mode, CPU)
    params = precision.prepare(model)  # what the optimizer updates: fp32 masters for -true
    model_params = list(model.parameters())
    model_ids = {id(p) for p in model_params}
    masters = [p for p in params if id(p) not in model_ids]
    optimizer = task.optimizer(iter(params))
    data = task.train_data()
    batch = default_collate([data[i] for i in range(BATCH_SIZE)])
    batch = move_to_device(batch, CPU, dtype=precision.input_dtype)

    # Saved activations: every tensor autograd keeps for backward, one count per storage (q, k
    # and v are views of one qkv output, for instance). Parameters saved as they are (fp32
    # weights, the 16-bit model of -true) are state, not activations; autocast's 16-bit copies
    # of the weights (-mixed) are new tensors and do count.
    param_storages = {p.untyped_storage().data_ptr() for p in model_params + params}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor  # the graph keeps it alive, so no address is reused while counting

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), precision.autocast():
        loss = task.loss(model, batch)
    precision.backward(loss.sum)
    grads = nbytes([p.grad for p in model_params])
    precision.unscale_and_clip(params, None)  # -true: fp32 master grads, 16-bit grads freed
    master_grads = nbytes([p.grad for p in masters])
    # The update is made even if fp16's first scaled gradients overflowed (the engine would
    # skip it): the optimizer state's size does not depend on the values.
    precision.step(optimizer)
    optimizer_bytes = nbytes(
        [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    )
    precision.zero_grad(optimizer)
    return StateBytes(
        params=sum(p.numel() for p in model_params),
        weights=nbytes(model_params),
        weight_dtype=str(model_params[0].dtype).removeprefix("torch."),
        masters=nbytes(masters),
        grads=grads,
        master_grads=master_grads,
        optimizer=optimizer_bytes,
        activations=sum(saved.values()),
    )


# ---------------------------------------------------------------------------------------
# 3. Peak process memory, one fresh subprocess per mode


def rss_probe(mode: str, steps: int, warm: bool, out: Path) -> None:
    """The subprocess: train ``steps`` steps of ``mode``, write its RSS figures to ``out``."""
    torch.set_num_threads(THREADS)
    task = make_task()  # the corpus is read and encoded before the baseline
    if warm:
        # torch's first forward and backward allocate ~100 MiB once per process (oneDNN and
        # thread-pool set-up, lazily loaded code), whatever the size and the mode: pay it here.
        train(task, mode, 2, StepClock(2), batch_size=2)
    gc.collect()
    reset_peak_rss()
    before = current_rss_kib()
    clock = StepClock(steps)
    result = train(task, mode, steps, clock)
    out.write_text(
        json.dumps({"before_kib": before, "peak_kib": clock.peak_kib, "skipped": result.skipped_steps})
    )


@dataclass
class Rss:
    mode: str
    cold: list[dict[str, int]] = field(default_factory=list)
    warm: list[dict[str, int]] = field(default_factory=list)

    def growth(self, warm: bool) -> list[float]:
        """Peak minus before, MiB, one per run."""
        return [(run["peak_kib"] - run["before_kib"]) / 1024 for run in (self.warm if warm else self.cold)]

    def before(self, warm: bool) -> float:
        """RSS right before the measured fit, MiB (warm: with the warm-up fit's leftovers)."""
        return statistics.median(run["before_kib"] for run in (self.warm if warm else self.cold)) / 1024


def run_probe(mode: str, steps: int, warm: bool, out: Path) -> dict[str, int]:
    arguments = ["--rss-probe", mode, "--steps", str(steps), "--probe-out", str(out)]
    return run_probe_script(Path(__file__).resolve(), [*arguments, *(["--rss-warm"] if warm else [])], out)


def measure_rss(steps: int, repetitions: int, scratch: Path) -> list[Rss]:
    """Cold and warm probes of every mode; two at a time (memory, unlike time, does not mind)."""
    results = [Rss(mode) for mode in MODES]
    jobs = [
        (entry, warm, repetition)
        for repetition in range(repetitions)
        for entry in results
        for warm in (False, True)
    ]

    def run_job(job: tuple[Rss, bool, int]) -> None:
        entry, warm, repetition = job
        figures = run_probe(entry.mode, steps, warm, scratch / f"rss-{entry.mode}-{warm}-{repetition}.json")
        (entry.warm if warm else entry.cold).append(figures)
        growth = (figures["peak_kib"] - figures["before_kib"]) / 1024
        print(
            f"repetition {repetition + 1}/{repetitions}  RSS {entry.mode:<10} {'warm' if warm else 'cold'} "
            f"+{growth:.1f} MiB",
            file=sys.stderr,
            flush=True,
        )

    with ThreadPoolExecutor(max_workers=PROBES_AT_ONCE) as pool:
        list(pool.map(run_job, jobs))
    return results


# ---------------------------------------------------------------------------------------
# Report


def cpu_description() -> tuple[str, dict[str, bool]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, {flag: flag in flags for flag in CPU_FLAGS}


def mib(count: int) -> str:
    return f"{count / MIB:.2f}" if count else "-"


def render(
    timed: list[Timed],
    states: dict[str, StateBytes],
    rss: list[Rss],
    kernels: dict[str, dict[str, float]],
    args: argparse.Namespace,
    load_before: str,
    minutes: float,
) -> str:
    by_name = {entry.name: entry for entry in timed}
    base = by_name[BASELINE]
    ratios = {
        entry.name: [mine / ref for mine, ref in zip(entry.medians, base.medians, strict=True)]
        for entry in timed
    }
    speed = {name: statistics.median(values) for name, values in ratios.items()}
    cpu_model, flags = cpu_description()
    flag_text = ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in flags.items())
    state32 = states[BASELINE]
    lines = [
        "# Precision modes on the CPU: step time and memory (charlm)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} "
        f"{platform.machine()}, {cpu_model}, {os.cpu_count()} CPU cores visible, Python "
        f"{platform.python_version()}; load average before / after: {load_before} / {load_now()}; "
        f"the full run took {minutes:.1f} min",
        f"- Versions: torch {torch.__version__} (CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}), leantrain {lt.__version__}",
        f"- CPU flags: {flag_text}",
        f"- Threads: `torch.set_num_threads({THREADS})` everywhere (stable timings on a shared machine)",
        f"- Work: the `charlm` example, `CharLMTask({', '.join(f'{k}={v}' for k, v in SIZE.items())})` "
        f"({state32.params:,} parameters, tied embeddings), validation left out; AdamW (lr 3e-3, "
        f"weight decay 0.01); global batch {BATCH_SIZE} sequences of {SIZE['block']} characters, one "
        f"micro-batch per step; `leantrain.Trainer(TrainConfig(precision=..., seed={SEED}, "
        f'log_every_n_steps={LOG_EVERY}, progress="none", logger="none")).fit(task)`, '
        f"{args.steps} optimizer steps per run",
        f"- Step time: an `on_step` callback stamps `time.perf_counter()` after every step; a run's "
        f"step time is the median gap between stamps, the first {args.warmup} gaps dropped (this "
        f"also drops fp16's skipped steps, which come first and make no update). {args.rounds} "
        "rounds, all modes interleaved in one process in a rotating order, after an untimed "
        "3-step run of each. *Median step*: median over rounds. *vs 32*: median over rounds of the "
        "ratio to the fp32 run of the same round, range in brackets. *32, again* runs fp32 a second "
        "time per round: its ratio is the noise floor. *Skipped*: `FitResult.skipped_steps` (fp16: "
        "steps whose scaled gradients overflowed while the dynamic loss scale, starting at 2^15, "
        "settles). *Final loss*: `FitResult.final_train_loss` (the last step's loss).",
        "",
        "| Mode | Median step (ms) | vs 32 | Skipped steps | Final train loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for entry in timed:
        lines.append(
            f"| {entry.name} | {statistics.median(entry.medians) * 1e3:.1f} "
            f"| {ranged(ratios[entry.name], 3)} | {ranged(entry.skipped, 0)} "
            f"| {ranged(entry.losses, 4)} |"
        )
    rows, inner, cols = BATCH_SIZE * SIZE["block"], SIZE["width"], 4 * SIZE["width"]
    head = SIZE["width"] // SIZE["heads"]
    kernel_names = {
        MATMUL: f"matmul {rows} x {inner} @ {inner} x {cols} (the MLP's first layer, forward)",
        ATTENTION: f"causal `scaled_dot_product_attention`, forward + backward, q/k/v {BATCH_SIZE} x "
        f"{SIZE['heads']} x {SIZE['block']} x {head} (once per layer, {SIZE['layers']} layers)",
        FORWARD: "the same attention, forward only (no grad)",
    }
    lines += [
        "",
        "Two of the model's kernels alone, on its shapes, one thread, median of 30 calls (ms):",
        "",
        "| Kernel | " + " | ".join(DTYPES) + " |",
        "|---|" + "---:|" * len(DTYPES),
        *(
            f"| {kernel_names[kernel]} | " + " | ".join(f"{kernels[kernel][d]:.2f}" for d in DTYPES) + " |"
            for kernel in (MATMUL, ATTENTION, FORWARD)
        ),
        "",
        "## State bytes of one step (exact, from the tensors)",
        "",
        "- One step driven by hand through `leantrain.step.precision.make_precision(mode, cpu)`: `prepare` "
        "(model cast for -true; the optimizer gets fp32 masters), forward under `autocast()` on one "
        f"micro-batch of {BATCH_SIZE} (inputs through `move_to_device(..., dtype=input_dtype)`), "
        "`backward(loss.sum)`, `unscale_and_clip`, `step` (AdamW), `zero_grad`.",
        "- *Weights*: the model's parameters (dtype in brackets). *Masters*: the fp32 copies the "
        "optimizer updates (-true only). *Grads*: the model's `.grad` after backward. *Master grads*: "
        "the fp32 gradients `unscale_and_clip` makes for the masters (-true only); it frees each "
        "16-bit gradient as it copies it, so the two coexist one tensor at a time. *Optimizer*: every "
        "tensor in `optimizer.state` after the step (AdamW's two moments in fp32, and step counters). "
        "*Activations*: the tensors autograd saves for backward in one forward, each storage counted "
        "once, parameters excluded (autocast's 16-bit copies of the weights are included). "
        "*Between steps*: weights + masters + optimizer (gradients are freed after each step). "
        "*Sum*: every column added, an upper bound of what is alive at once (activations are freed "
        "during backward as the gradients fill in). MiB.",
        "",
        "| Mode | Weights | Masters | Grads | Master grads | Optimizer | Activations | Between steps "
        "| vs 32 | Sum | vs 32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        s = states[mode]
        lines.append(
            f"| {mode} | {mib(s.weights)} ({s.weight_dtype}) | {mib(s.masters)} | {mib(s.grads)} "
            f"| {mib(s.master_grads)} | {mib(s.optimizer)} | {mib(s.activations)} "
            f"| {mib(s.persistent)} | {s.persistent / state32.persistent:.2f} | {mib(s.counted)} "
            f"| {s.counted / state32.counted:.2f} |"
        )
    base_rss = next(entry for entry in rss if entry.mode == BASELINE)
    cold32, warm32 = (statistics.median(base_rss.growth(warm)) for warm in (False, True))
    lines += [
        "",
        "## Peak process memory (fresh process per mode)",
        "",
        f"- `python benchmarks/precision.py --rss-probe MODE --steps {args.rss_steps} [--rss-warm]`: "
        "the charlm task is built (corpus read and encoded), the high-water mark is reset "
        "(`/proc/self/clear_refs`), the RSS is read (*Before*, `/proc/self/statm`), and `fit` trains "
        f"{args.rss_steps} steps. Growth: the peak RSS (`VmHWM`) at the last step's `on_step` (before "
        "the final checkpoint), minus *Before*. *Cold*: the first `fit` of the process, as a user's run "
        "starts. *Warm*: after an untimed 2-step `fit` of the same mode on a micro-batch of 2, which pays "
        "torch's one-off first-step cost (about 100 MiB of oneDNN and thread-pool set-up and lazily "
        "loaded code, whatever the mode and size): what is left is closer to what the mode itself "
        "needs. `ru_maxrss` is not used: in a child process it reports at least the parent's peak "
        "(Linux keeps the replaced image's high-water mark across `exec`), which hid every difference "
        f"between modes. {args.rss_repetitions} repetition(s), median, range in brackets. MiB.",
        "",
        "| Mode | Cold: before | Cold: growth | vs 32 | Warm: before | Warm: growth | vs 32 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in rss:
        cold, warm = entry.growth(warm=False), entry.growth(warm=True)
        lines.append(
            f"| {entry.mode} | {entry.before(warm=False):.1f} | {ranged(cold, 1)} "
            f"| {statistics.median(cold) / cold32:.2f} | {entry.before(warm=True):.1f} | {ranged(warm, 1)} "
            f"| {statistics.median(warm) / warm32:.2f} |"
        )
    lines += ["", "## Reading the results", "", *interpretation(timed, speed, states, rss, kernels, flags)]
    return "\n".join(lines) + "\n"


def interpretation(
    timed: list[Timed],
    speed: dict[str, float],
    states: dict[str, StateBytes],
    rss: list[Rss],
    kernels: dict[str, dict[str, float]],
    flags: dict[str, bool],
) -> list[str]:
    """A few sentences derived from the numbers of this run (so a re-run stays truthful)."""

    def pace(ratio: float) -> str:
        if abs(ratio - 1) <= max(abs(speed[NOISE_FLOOR] - 1), 0.02):
            return "as fast as fp32 (within the noise)"
        return f"{ratio:.2f}x fp32's step time ({'slower' if ratio > 1 else 'faster'})"

    units = (("AMX-BF16", "amx_bf16"), ("AVX512-BF16", "avx512_bf16"))
    bf16_units = [name for name, flag in units if flags[flag]]
    mm, at, fw = kernels[MATMUL], kernels[ATTENTION], kernels[FORWARD]
    step = {entry.name: statistics.median(entry.medians) * 1e3 for entry in timed}
    extra_attention = SIZE["layers"] * (at["bfloat16"] - at["float32"])
    extra_step = step["bf16-mixed"] - step[BASELINE]
    lines = [
        f"- Speed. bf16-mixed: {pace(speed['bf16-mixed'])}; bf16-true: {pace(speed['bf16-true'])}; "
        f"16-mixed: {pace(speed['16-mixed'])}; 16-true: {pace(speed['16-true'])}. Noise floor "
        f"(fp32 against itself): {speed[NOISE_FLOOR]:.3f}.",
        f"- Kernels. This CPU has {' and '.join(bf16_units) or 'no bf16 units'}: the bf16 matmul "
        f"takes {mm['bfloat16'] / mm['float32']:.2f}x the fp32 time. fp16 has "
        f"{'AMX-FP16' if flags['amx_fp16'] else 'no matrix unit here (no AMX-FP16'}"
        f"{', only AVX512-FP16)' if flags['avx512_fp16'] and not flags['amx_fp16'] else ')'}: "
        f"{mm['float16'] / mm['float32']:.2f}x. But torch's CPU attention is slower in 16-bit: "
        f"{at['bfloat16'] / at['float32']:.1f}x (bf16) and {at['float16'] / at['float32']:.1f}x (fp16) "
        f"the fp32 time for forward + backward, while the forward alone takes "
        f"{fw['bfloat16'] / fw['float32']:.2f}x and {fw['float16'] / fw['float32']:.2f}x: the backward "
        f"kernel is the slow one. That is "
        f"{extra_attention:.0f} ms more per step in bf16 over {SIZE['layers']} layers, against "
        f"{extra_step:.0f} ms more per step measured for bf16-mixed: the attention eats the matmul "
        "gain and more. fp16 gets no matmul gain to offset it.",
    ]
    s32, sm, st = states[BASELINE], states["bf16-mixed"], states["bf16-true"]
    lines.append(
        f"- State. -mixed keeps fp32 weights, gradients and optimizer state (between steps "
        f"{sm.persistent / s32.persistent:.2f}x fp32) and saves 16-bit activations "
        f"({sm.activations / s32.activations:.2f}x fp32's, autocast's weight copies included). "
        f"-true halves the weights and the saved activations ({st.activations / s32.activations:.2f}x) but "
        f"adds fp32 masters: between steps it holds {st.persistent / s32.persistent:.2f}x fp32's bytes. "
        "The activations grow with batch and sequence length and the weight-side state does not, so "
        "the savings of 16-bit grow with the batch."
    )
    cold = {entry.mode: statistics.median(entry.growth(warm=False)) for entry in rss}
    warm = {entry.mode: statistics.median(entry.growth(warm=True)) for entry in rss}
    lines.append(
        "- Process memory (peak RSS growth in MiB, cold / warm): "
        + ", ".join(f"{mode} {cold[mode]:.0f} / {warm[mode]:.0f}" for mode in MODES)
        + ". The process also holds what is no tensor of the table above: the allocator's cached "
        "and fragmented blocks, oneDNN's kernels and scratch buffers, autocast's weight-cast cache, "
        "so it does not follow the tensor bytes one to one; at this model size fixed costs are a large "
        "share, and the cold figures mostly measure torch's first step."
    )
    lines.append(
        "- On this CPU the sure gain of 16-bit is memory. bf16 could also gain time where matmuls "
        "dominate and attention does not (wider models; a model without `scaled_dot_product_attention`, "
        "or a torch whose 16-bit CPU attention backward is faster); fp16 without AMX-FP16 brings loss "
        "scaling and its skipped steps for no speed."
    )
    return lines


# ---------------------------------------------------------------------------------------
# Orchestration


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per timed run (default 50)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of all modes (default 6)")
    parser.add_argument("--warmup", type=int, default=10, help="first step gaps dropped (default 10)")
    parser.add_argument(
        "--rss-steps", type=int, default=20, help="steps of each peak-memory subprocess (default 20)"
    )
    parser.add_argument(
        "--rss-repetitions", type=int, default=2, help="peak-memory subprocesses per mode (default 2)"
    )
    add_output_options(
        parser,
        "smoke run: 14 steps, 2 rounds, 1 peak-memory run of 12 steps; writes only with --out",
        DEFAULT_OUT,
    )
    # Internal: the peak-memory subprocess.
    parser.add_argument("--rss-probe", choices=MODES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rss-warm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_probe is not None:
        if args.probe_out is None:
            parser.error("--rss-probe needs --probe-out")
        return args
    if args.quick:
        args.steps, args.rounds, args.warmup, args.rss_steps, args.rss_repetitions = 14, 2, 10, 12, 1
    args.out = output_path(args, DEFAULT_OUT)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps must exceed --warmup + 1 ({args.warmup + 1})")
    if args.rounds < 1 or args.rss_repetitions < 1 or args.rss_steps < 1:
        parser.error("--rounds, --rss-steps and --rss-repetitions must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_probe is not None:
        rss_probe(args.rss_probe, args.steps, args.rss_warm, args.probe_out)
        return 0
    started = time.perf_counter()
    load_before = load_now()
    torch.set_num_threads(THREADS)
    task = make_task()
    states = {mode: state_bytes(task, mode) for mode in MODES}
    kernels = kernel_ms()
    timed = measure_speed(task, args.steps, args.rounds, args.warmup)
    with tempfile.TemporaryDirectory(prefix="leantrain-precision-rss-") as scratch:
        rss = measure_rss(args.rss_steps, args.rss_repetitions, Path(scratch))
    minutes = (time.perf_counter() - started) / 60
    table = render(timed, states, rss, kernels, args, load_before, minutes)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
