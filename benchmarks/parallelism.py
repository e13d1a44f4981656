"""Memory per process, loss and overhead of the parallel strategies on the CPU (charlm, gloo).

The built-in ``charlm`` example (a 4-block GPT, tied embedding and head weights) trained with
the same global batch, micro-batch, steps and seed by every strategy:

- ``single`` (one process, the reference) and ``split`` (one process, ``--device-map cpu,cpu``):
  ``leantrain fit``;
- ``ddp``, ``fsdp`` and ``pipeline`` (2 stages): ``leantrain launch --nproc-per-node 2 fit``.

Every run is a subprocess with ``OMP_NUM_THREADS=1`` per process and its own run folder in a
temporary directory; the figures are read from its ``summary.json`` (written by rank 0, so the
byte counts are rank 0's view): ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``,
``activation_bytes``, ``peak_memory_bytes``, ``samples_per_second``, ``final_train_loss``
(and ``val_loss``). The strategies run interleaved, several rounds in a rotating order; the
tables give medians.

A probe (this file started by torchrun with ``--fsdp-probe``) shards the model as ``fsdp``
does and looks at what autograd saves in one forward: FSDP all-gathers each block's weights
for its forward, autograd saves those gathered weights for backward, and the engine's
activation count sees them; FSDP frees their storage after the block's forward.

    python benchmarks/parallelism.py          # full run (about 6 min on 2 cores): results/parallelism.md
    python benchmarks/parallelism.py --quick  # smoke run (1 round, 20 steps); prints the tables only
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.utils.data import default_collate

import leantrain as lt
from _common import add_output_options, cpu_model, load_now, output_path, publish, ranged
from leantrain.examples.charlm import Block, CharLMTask
from leantrain.memory.accountant import base_tensor
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.fsdp import FullyShard

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "parallelism.md"
PROCESSES = 2  # of the multi-process strategies; also the pipeline's stages
GLOBAL_BATCH = 32
MICRO_BATCH = 8  # 4 micro-batches per step for single, split and the pipeline; 2 per process for ddp, fsdp
LOG_EVERY = 10
SEED = 0
MIB = 1024 * 1024


@dataclass(frozen=True)
class Strategy:
    name: str
    processes: int
    flags: tuple[str, ...]
    holds: str  # what one process holds, in words

    def micro_x_acc(self) -> str:
        """Micro-batch x accumulation steps of one process (the stages of a pipeline all see every sample)."""
        data_parallel = self.processes if self.name in ("ddp", "fsdp") else 1
        return f"{MICRO_BATCH} x {GLOBAL_BATCH // data_parallel // MICRO_BATCH}"


STRATEGIES = (
    Strategy("single", 1, ("--strategy", "single"), "the whole model"),
    Strategy("ddp", PROCESSES, ("--strategy", "ddp"), "a full replica"),
    Strategy("fsdp", PROCESSES, ("--strategy", "fsdp"), f"1/{PROCESSES} of every tensor of the state"),
    Strategy(
        "pipeline",
        PROCESSES,
        ("--strategy", "pipeline", "--pipeline-stages", str(PROCESSES)),
        f"its stage: {4 // PROCESSES} of the 4 blocks",
    ),
    Strategy(
        "split",
        1,
        ("--strategy", "split", "--device-map", ",".join(["cpu"] * PROCESSES)),
        f"the whole model, in {PROCESSES} parts",
    ),
)
REFERENCE = "single"
DATA_PARALLEL = "ddp"  # what fsdp and the pipeline are compared with: a full replica per process
BYTES = ("params_bytes", "grads_bytes", "optimizer_bytes")


# ---------------------------------------------------------------------------------------
# The runs: leantrain as subprocesses


def fit_arguments(strategy: Strategy, out_dir: Path, steps: int) -> list[str]:
    """The leantrain command line after the program name."""
    fit = [
        "fit",
        *("--example", "charlm"),
        *strategy.flags,
        *("--global-batch-size", str(GLOBAL_BATCH)),
        *("--micro-batch-size", str(MICRO_BATCH)),
        *("--max-steps", str(steps)),
        *("--log-every-n-steps", str(LOG_EVERY)),
        *("--device", "cpu"),
        *("--seed", str(SEED)),
        *("--progress", "plain"),
        *("--logger", "none"),
        *("--out", str(out_dir)),
    ]
    launcher = ["launch", "--nproc-per-node", str(strategy.processes)] if strategy.processes > 1 else []
    return [*launcher, *fit]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Set explicitly: torchrun sets OMP_NUM_THREADS=1 only when it is unset, and a plain
    # `leantrain fit` would use every core. One core per process, in every run.
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    return env


def run_checked(command: list[str], what: str) -> None:
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"{what} failed with exit status {done.returncode}:\n{tail}")


@dataclass
class Measured:
    strategy: Strategy
    summaries: list[dict[str, Any]] = field(default_factory=list)  # one summary.json per round
    command_seconds: list[float] = field(default_factory=list)  # the whole subprocess, start-up included
    steady: list[float] = field(default_factory=list)  # samples/s after the first log window, per round

    def values(self, key: str) -> list[float]:
        return [summary[key] for summary in self.summaries]

    def first(self, key: str) -> Any:
        return self.summaries[0][key]


def run_leantrain(entry: Measured, scratch: Path, steps: int, index: int) -> None:
    out_dir = scratch / f"run-{index}-{entry.strategy.name}"
    command = [sys.executable, "-m", "leantrain", *fit_arguments(entry.strategy, out_dir, steps)]
    started = time.perf_counter()
    run_checked(command, f"leantrain {entry.strategy.name}")
    entry.command_seconds.append(time.perf_counter() - started)
    summary = json.loads((out_dir / "summary.json").read_text())
    if summary["strategy"] != entry.strategy.name or summary["steps"] != steps:
        raise RuntimeError(
            f"{entry.strategy.name}: summary.json says {summary['strategy']}, {summary['steps']} steps"
        )
    entry.summaries.append(summary)
    entry.steady.append(steady_speed(out_dir / "metrics.csv"))


def steady_speed(metrics_csv: Path) -> float:
    """The median ``samples_per_second`` of the log windows after the first (warm-up: the first step
    also counts the saved activations, and a pipeline's first step builds its schedule)."""
    with metrics_csv.open(newline="") as file:
        # The final validation writes a row without samples_per_second.
        speeds = [
            float(row["samples_per_second"]) for row in csv.DictReader(file) if row["samples_per_second"]
        ]
    if len(speeds) < 2:
        raise RuntimeError(f"{metrics_csv}: {len(speeds)} log window(s); --steps must give at least 2")
    return statistics.median(speeds[1:])


def round_order(round_index: int) -> list[Strategy]:
    """Rotated by one each round, and reversed every other round: no strategy always runs first,
    nor always after the same one."""
    shift = round_index % len(STRATEGIES)
    order = list(STRATEGIES[shift:] + STRATEGIES[:shift])
    return order[::-1] if round_index % 2 else order


def measure(rounds: int, steps: int, scratch: Path) -> dict[str, Measured]:
    measured = {strategy.name: Measured(strategy) for strategy in STRATEGIES}
    index = 0
    for round_index in range(rounds):
        for strategy in round_order(round_index):
            index += 1
            entry = measured[strategy.name]
            run_leantrain(entry, scratch, steps, index)
            print(
                f"round {round_index + 1}/{rounds}  {strategy.name:<9} "
                f"{entry.summaries[-1]['samples_per_second']:7.1f} samples/s  "
                f"{entry.command_seconds[-1]:5.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return measured


# ---------------------------------------------------------------------------------------
# The fsdp probe: what the activation count of an fsdp run holds


def fsdp_probe(out: Path) -> None:
    """Shard charlm as ``--strategy fsdp`` does; after one training forward, sort what autograd
    saved into the tensors whose storage is still allocated and those FSDP freed.

    Counted as the engine's accountant counts (``leantrain.memory.accountant``): each saved
    tensor once, as its base; the model's parameters (here the local shards) left out.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        task = CharLMTask()
        torch.manual_seed(SEED)
        model = task.model()
        config = lt.TrainConfig(strategy="fsdp", global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH)
        plan = FullyShard(config, torch.device("cpu"), ParallelDims(dp=dist.get_world_size()))
        plan.wrap(model, None)
        exclude = {id(base_tensor(p)) for p in plan.model.parameters()}
        saved: dict[int, torch.Tensor] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            root = base_tensor(tensor)
            if id(root) not in exclude:
                saved.setdefault(id(root), root)
            return tensor

        data = task.train_data()
        batch = default_collate([data[i] for i in range(MICRO_BATCH)])
        plan.module.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = task.loss(plan.module, batch)
        freed = [t for t in saved.values() if t.untyped_storage().nbytes() == 0]
        shapes = sorted({tuple(t.shape) for t in freed})
        result = {
            "counted_bytes": sum(t.numel() * t.element_size() for t in saved.values()),
            "freed_bytes": sum(t.numel() * t.element_size() for t in freed),
            "freed_tensors": len(freed),
            "freed_shapes": [list(shape) for shape in shapes],
            "block_param_bytes": sum(
                p.numel() * p.element_size()
                for module in model.modules()
                if isinstance(module, Block)
                for p in module.parameters()
            ),
        }
        loss.sum.backward()  # frees the graph, and every rank takes part in the backward collectives
        if dist.get_rank() == 0:
            out.write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def probe_command(out: Path) -> list[str]:
    return [
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(PROCESSES)),
        str(Path(__file__).resolve()),
        *("--fsdp-probe", "--probe-out", str(out)),
    ]


def run_probe(scratch: Path) -> dict[str, Any]:
    out = scratch / "fsdp-probe.json"
    run_checked([sys.executable, *probe_command(out)], "fsdp probe")
    return json.loads(out.read_text())


def validation_check(single_run: Path, pipeline_accumulation: int) -> dict[str, Any]:
    """Single's final weights evaluated on all validation sequences, and on those a pipeline keeps.

    The pipeline validates its micro-batches ``pipeline_accumulation`` at a time and leaves out a
    last incomplete group: it sees the first ``kept`` sequences of the (unsharded) validation set.
    """
    torch.set_num_threads(1)
    task = CharLMTask()
    model = task.model()
    missing, unexpected = model.load_state_dict(load_file(single_run / "model.safetensors"), strict=False)
    if unexpected or set(missing) - {"token.weight"}:  # the tied weight is exported once, as head.weight
        raise RuntimeError(f"single's weights do not fit charlm: missing {missing}, unexpected {unexpected}")
    model.eval()
    data = task.val_data()
    batches = -(-len(data) // MICRO_BATCH)
    kept = min(len(data), batches // pipeline_accumulation * pipeline_accumulation * MICRO_BATCH)

    def mean_loss(count: int) -> float:
        total, tokens = 0.0, 0
        with torch.no_grad():
            for start in range(0, count, MICRO_BATCH):
                batch = default_collate([data[i] for i in range(start, min(start + MICRO_BATCH, count))])
                loss = task.loss(model, batch)
                total, tokens = total + float(loss.sum), tokens + int(loss.count)
        return total / tokens

    return {
        "all": len(data),
        "kept": kept,
        "group": pipeline_accumulation,
        "loss_all": mean_loss(len(data)),
        "loss_kept": mean_loss(kept),
    }


# ---------------------------------------------------------------------------------------
# Report


def mib(value: float) -> str:
    return f"{value / MIB:.3f}"


def model_facts() -> dict[str, int]:
    model = CharLMTask().model()
    return {
        "params": sum(p.numel() for p in model.parameters()),  # the tied weight once
        "param_tensors": len(list(model.parameters())),
        "token_bytes": model.token.weight.numel() * model.token.weight.element_size(),
        "vocab": model.token.weight.shape[0],
        "width": model.token.weight.shape[1],
    }


def per_round_ratios(entry: Measured, reference: Measured, key: str) -> list[float]:
    return [a[key] / b[key] for a, b in zip(entry.summaries, reference.summaries, strict=True)]


def render(
    measured: dict[str, Measured],
    probe: dict[str, Any],
    val_check: dict[str, Any],
    args: argparse.Namespace,
    load_before: str,
    minutes: float,
) -> str:
    facts = model_facts()
    ref, ddp = measured[REFERENCE], measured[DATA_PARALLEL]
    example = " and ".join(
        f"`{shlex.join(['leantrain', *fit_arguments(s, Path('DIR'), args.steps)])}`"
        for s in (STRATEGIES[1], STRATEGIES[4])
    )
    lines = [
        "# Parallel strategies on the CPU: memory per process, loss and overhead (charlm, gloo)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPU cores visible, Python {platform.python_version()}; "
        f"load average before / after: {load_before} / {load_now()}; the full run took {minutes:.1f} min",
        f"- Versions: torch {torch.__version__}, leantrain {lt.__version__}",
        f"- Work: the built-in `charlm` example (4 blocks, width {facts['width']}, vocabulary "
        f"{facts['vocab']}, {facts['params']:,} parameters with the token embedding and the head tied; "
        f"AdamW; fp32; validation once at the end), global batch {GLOBAL_BATCH}, micro-batch "
        f"{MICRO_BATCH}, {args.steps} steps, seed {SEED}, every process with `OMP_NUM_THREADS=1`. "
        f"`single` and `split` run in one process (`leantrain fit`), `ddp`, `fsdp` and `pipeline` in "
        f"{PROCESSES} (`leantrain launch --nproc-per-node {PROCESSES} fit`, gloo). E.g. {example}.",
        f"- Runs: {args.rounds} round(s), the {len(STRATEGIES)} strategies in a rotating order (reversed "
        "every other round), each run a subprocess with its run folder in a temporary directory; the "
        "figures are read from its `summary.json`, which rank 0 writes: the bytes are rank 0's. Medians over "
        "rounds, the range in brackets where it shows.",
        "",
        "## Memory per process (rank 0)",
        "",
        "- *Params*, *Grads*, *Optimizer*: `params_bytes`, `grads_bytes`, `optimizer_bytes` (the engine's "
        "accountant, after the first step: each tensor once, a sharded `DTensor` as its local shard). "
        "*Activations*: `activation_bytes`, what autograd saves for backward in the first micro-batch's "
        "forward. *vs ddp*: Params / Grads / Optimizer over ddp's. *Peak RSS*: `peak_memory_bytes`, the "
        "process's peak resident set (`VmHWM`), most of it torch itself. MiB.",
        "",
        "| Strategy | Processes | Meant to hold, per process | Micro x acc per process | Params | Grads "
        "| Optimizer | Params + grads + optimizer | vs ddp | Activations | Peak RSS |",
        "|---|---:|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for entry in measured.values():
        strategy = entry.strategy
        state = [sum(s[k] for k in BYTES) for s in entry.summaries]
        versus = " / ".join(f"{statistics.median(per_round_ratios(entry, ddp, k)):.3f}" for k in BYTES)
        lines.append(
            f"| {strategy.name} | {strategy.processes} | {strategy.holds} | {strategy.micro_x_acc()} "
            + "".join(f"| {ranged([v / MIB for v in entry.values(k)], 3)} " for k in BYTES)
            + f"| {ranged([v / MIB for v in state], 3)} | {versus} "
            f"| {ranged([v / MIB for v in entry.values('activation_bytes')], 3)} "
            f"| {ranged([v / MIB for v in entry.values('peak_memory_bytes')], 1)} |"
        )
    lines += [
        "",
        "## Loss and throughput",
        "",
        "- *Final train loss*: `final_train_loss` of the first round; *Δ vs single*: the largest "
        "|difference| from single's in the same round, over all rounds. *Val loss*: `val_loss` of the "
        "first round (validation once, after the last step).",
        "- *samples/s*: `samples_per_second` (all the run's training samples over its training time, the "
        "first steps included, validation not); *after warm-up*: the median `samples_per_second` of the "
        f"log windows in `metrics.csv` after the first ({LOG_EVERY} steps each); *vs single*: median over "
        "rounds of the ratio to single in the same round, range in brackets. *Command s*: the wall time of "
        "the whole subprocess (start-up, process group, validation, saving included).",
        f"- Not a speed benchmark of the strategies: {PROCESSES} processes on {os.cpu_count()} cores, one "
        "thread each, on a tiny model, beside whatever else runs on the machine (see the load average). "
        "The multi-process rows show what each strategy's communication and bookkeeping cost here; the "
        "one-process rows leave a core idle.",
        "",
        "| Strategy | Final train loss | Δ vs single | Val loss | samples/s | vs single | after warm-up "
        "| vs single | Command s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in measured.values():
        delta = max(
            abs(a - b)
            for a, b in zip(entry.values("final_train_loss"), ref.values("final_train_loss"), strict=True)
        )
        steady_ratios = [a / b for a, b in zip(entry.steady, ref.steady, strict=True)]
        lines.append(
            f"| {entry.strategy.name} | {entry.first('final_train_loss'):.7f} | {delta:.1e} "
            f"| {entry.first('val_loss'):.7f} | {ranged(entry.values('samples_per_second'), 1)} "
            f"| {ranged(per_round_ratios(entry, ref, 'samples_per_second'), 2)} "
            f"| {ranged(entry.steady, 1)} | {ranged(steady_ratios, 2)} "
            f"| {ranged(entry.command_seconds, 1)} |"
        )
    lines += ["", "## Findings", "", *findings(measured, probe, val_check, facts)]
    return "\n".join(lines) + "\n"


def findings(
    measured: dict[str, Measured], probe: dict[str, Any], val_check: dict[str, Any], facts: dict[str, int]
) -> list[str]:
    ref, ddp, fsdp = measured[REFERENCE], measured[DATA_PARALLEL], measured["fsdp"]
    pipe = measured["pipeline"]
    lines = []

    # fsdp: half the state, to a few bytes.
    half = {k: ddp.first(k) / PROCESSES for k in BYTES}
    extra = {k: fsdp.first(k) - half[k] for k in BYTES}
    step_bytes = ref.first("optimizer_bytes") - 2 * ref.first("params_bytes")  # AdamW's step counters
    pad = facts["width"] * 4 * (facts["vocab"] % PROCESSES) * (PROCESSES - 1) / PROCESSES
    lines.append(
        f"- **fsdp** holds {fsdp.first('params_bytes') / ddp.first('params_bytes'):.4f} of ddp's parameter "
        f"bytes, {fsdp.first('grads_bytes') / ddp.first('grads_bytes'):.4f} of its gradient bytes and "
        f"{fsdp.first('optimizer_bytes') / ddp.first('optimizer_bytes'):.4f} of its optimizer bytes per "
        f"process: 1/{PROCESSES}, plus {extra['params_bytes']:,.0f} B of parameters and gradients"
        + (
            f" (the token embedding has {facts['vocab']} rows, an odd count: rank 0's shard takes the extra "
            f"row, half a row above 1/{PROCESSES})"
            if facts["vocab"] % PROCESSES and abs(extra["params_bytes"] - pad) < 1
            else ""
        )
        + f", and {extra['optimizer_bytes']:,.0f} B of optimizer state"
        + (
            f" (the same twice, for AdamW's two moments, and its {step_bytes} B of `step` counters, one "
            f"scalar per parameter tensor ({facts['param_tensors']}), which are not sharded)"
            if abs(extra["optimizer_bytes"] - 2 * extra["params_bytes"] - step_bytes / 2) < 1
            else ""
        )
        + "."
    )
    act_extra = fsdp.first("activation_bytes") - ddp.first("activation_bytes")
    consistent = probe["counted_bytes"] == fsdp.first("activation_bytes")
    shapes = ", ".join(str(tuple(shape)) for shape in probe["freed_shapes"])
    root_saved = probe["counted_bytes"] - probe["freed_bytes"] - ddp.first("activation_bytes")
    root_weights = (
        facts["token_bytes"] + 2 * facts["width"] * 4
    )  # the tied head, the final norm's weight, bias
    lines.append(
        f"- **fsdp's activations** read {mib(fsdp.first('activation_bytes'))} MiB against ddp's "
        f"{mib(ddp.first('activation_bytes'))} MiB for the same micro-batch (+{act_extra / MIB:.3f} MiB, "
        f"{act_extra / ddp.first('activation_bytes'):+.1%}). The probe (torchrun, {PROCESSES} processes, the "
        "model sharded by leantrain's own `FullyShard` strategy, one training forward of the first "
        f"micro-batch) counts {mib(probe['counted_bytes'])} MiB of saved tensors"
        + (" (the run's figure exactly)" if consistent else " (not the run's figure: see the table)")
        + f", of which {probe['freed_tensors']} tensors, {mib(probe['freed_bytes'])} MiB, have no storage "
        f"left after the forward: the blocks' all-gathered weights (shapes {shapes}; the 4 blocks hold "
        f"{mib(probe['block_param_bytes'])} MiB of parameters; the linear layers' biases are not saved). "
        "Autograd saves the gathered weight of every linear layer, and the weight and bias of every layer "
        "norm, for backward; FSDP frees them after the block's forward (reshard after forward) and gathers "
        "them again, one block at a time, in backward. So fsdp's `activation_bytes` counts about one full "
        "copy of the blocks' weights that is never held at once: what the first micro-batch's forward holds "
        "at its end is the ddp figure plus the root unit's gathered weights (the root is not resharded after "
        f"forward), {root_saved:,} B here"
        + (
            " (the tied head weight and the final layer norm's weight and bias, to the byte)"
            if root_saved == root_weights
            else ""
        )
        + ". The engine's figure is right for ddp and single, and overstates fsdp's by "
        f"{probe['freed_bytes'] / fsdp.first('activation_bytes'):.0%} here; on a large model with small "
        "micro-batches the blocks' weights can dwarf the activations."
    )

    # pipeline: the stage's gradients and optimizer state, but the whole model's parameters.
    stage_params = pipe.first("grads_bytes")  # every parameter of the stage is trainable
    whole_plus_copy = ref.first("params_bytes") + facts["token_bytes"]
    lines.append(
        f"- **pipeline** (rank 0 = stage 0: the token and position embeddings and blocks 0-1) holds "
        f"{pipe.first('grads_bytes') / ddp.first('grads_bytes'):.3f} of ddp's gradient bytes and "
        f"{pipe.first('optimizer_bytes') / ddp.first('optimizer_bytes'):.3f} of its optimizer bytes: its "
        f"stage's share ({mib(stage_params)} MiB of the stage's parameters; above 1/2 because the embeddings "
        f"are on stage 0). Its `params_bytes` "
        + ("is the stage's" if pipe.first("params_bytes") == stage_params else "is not the stage's")
        + f": {mib(pipe.first('params_bytes'))} MiB, "
        f"{pipe.first('params_bytes') / ddp.first('params_bytes'):.3f} of ddp's"
        + (
            f", exactly the whole model ({mib(ref.first('params_bytes'))} MiB) plus one copy of the tied "
            f"token embedding ({facts['token_bytes']:,} B). The traced pipeline keeps the original model "
            "alive beside its stage (a known limit, docs/parallelism.md), and the accountant counts "
            "`model.parameters()` of that whole model with the stage's optimizer parameters; the stage's "
            "parameters are the original tensors except the tied embedding, which the tracer copied. So "
            "rank 0 really does hold the other stage's blocks too, unused: a pipeline does not yet cut the "
            "parameters' memory"
            if pipe.first("params_bytes") == whole_plus_copy
            else ""
        )
        + f". Its `activation_bytes` is {pipe.first('activation_bytes'):,}: not measured under a pipeline "
        "(documented)."
    )

    # Loss.
    deltas = {
        name: max(
            abs(a - b)
            for a, b in zip(entry.values("final_train_loss"), ref.values("final_train_loss"), strict=True)
        )
        for name, entry in measured.items()
        if name != REFERENCE
    }
    val_deltas = {name: abs(measured[name].first("val_loss") - ref.first("val_loss")) for name in deltas}
    others = max(v for name, v in val_deltas.items() if name != "pipeline")
    lines.append(
        "- **Loss**: the final train loss against single's, largest difference over the rounds: "
        + ", ".join(f"{name} {delta:.1e}" for name, delta in deltas.items())
        + f" (relative {max(deltas.values()) / ref.first('final_train_loss'):.0e} at most): float32 rounding "
        "of the same sums taken in another order. Val loss: within "
        f"{others:.1e} of single's, but the pipeline's is {val_deltas['pipeline']:.1e} off. Not a different "
        f"model: the pipeline validates its batches {val_check['group']} at a time (the stages were traced "
        "for a step's micro-batches) and leaves out a last incomplete group (documented); of charlm's "
        f"{val_check['all']} validation sequences, in batches of {MICRO_BATCH}, it evaluates "
        f"{val_check['kept']}. Single's final weights (its first round's `model.safetensors`) give "
        f"{val_check['loss_all']:.7f} on all of them (single's `val_loss`: {ref.first('val_loss'):.7f}) and "
        f"{val_check['loss_kept']:.7f} on those {val_check['kept']} alone: the pipeline's "
        f"{pipe.first('val_loss'):.7f} to {abs(val_check['loss_kept'] - pipe.first('val_loss')):.0e}."
    )

    # Throughput, after warm-up (the summary's figure counts the first steps too).
    def speed(name: str) -> float:
        return statistics.median(measured[name].steady)

    def ratio(name: str, reference: str = REFERENCE) -> float:
        pairs = zip(measured[name].steady, measured[reference].steady, strict=True)
        return statistics.median(a / b for a, b in pairs)

    def outside_fit(entry: Measured) -> float:
        pairs = zip(entry.command_seconds, entry.values("wall_seconds"), strict=True)
        return statistics.median(command - wall for command, wall in pairs)

    def step_ms(name: str) -> float:
        return GLOBAL_BATCH / speed(name) * 1e3

    # fsdp's collectives per step: per micro-batch an all-gather of every unit in forward and of
    # every block again in backward (the root stays gathered), then one reduce-scatter per unit.
    blocks, micro_batches = 4, GLOBAL_BATCH // PROCESSES // MICRO_BATCH
    collectives = micro_batches * (2 * blocks + 1) + blocks + 1
    pipeline_micro = GLOBAL_BATCH // MICRO_BATCH
    bubble = f"{PROCESSES - 1}/{pipeline_micro + PROCESSES - 1}"  # (S - 1) / (k + S - 1)
    split_ratios = [a / b for a, b in zip(measured["split"].steady, ref.steady, strict=True)]
    one_process = sorted({f"{outside_fit(measured[name]):.0f}" for name in (REFERENCE, "split")})

    lines.append(
        "- **Throughput** after warm-up (the overhead on this machine, not the strategies' speed): "
        + ", ".join(f"{name} {speed(name):.0f} samples/s ({ratio(name):.2f}x single)" for name in deltas)
        + f", single {speed(REFERENCE):.0f}. ddp splits each step over 2 processes on 2 cores and adds one "
        f"all-reduce of the gradients (about 3 MB) per step. fsdp / ddp = {ratio('fsdp', 'ddp'):.2f}, "
        f"{step_ms('fsdp') - step_ms('ddp'):.0f} ms more per step ({step_ms('ddp'):.0f} against "
        f"{step_ms('fsdp'):.0f} ms): fsdp runs about {collectives} collectives a step instead of 1 (with "
        f"{micro_batches} micro-batches per process: an all-gather of every unit in forward and of every "
        "block again in backward, then a reduce-scatter per unit), each of at most one block's weights (0.8 "
        "MB) over gloo on the cores that compute, about "
        f"{(step_ms('fsdp') - step_ms('ddp')) / collectives:.1f} ms apiece: latency and FSDP's Python "
        "hooks, not bandwidth"
        + (". fsdp in 2 processes is slower than single in one" if ratio("fsdp") < 1 else "")
        + ". The pipeline's "
        f"two stages wait for each other (with {pipeline_micro} micro-batches and {PROCESSES} stages the "
        f"bubble alone is {bubble} of the step in theory) and pass activations and gradients through gloo "
        "every micro-batch. split does single's work in one process, one part after the other, plus a "
        "forward pre-hook per placed module; its moves between two `cpu` devices copy nothing. Its ratio to "
        f"single ranges over {min(split_ratios):.2f}-{max(split_ratios):.2f} in the rounds"
        + (
            ": no cost above the noise"
            if min(split_ratios) <= 1 <= max(split_ratios)
            else f", all on one side of 1.00 in {len(split_ratios)} rounds on a noisy machine: rerun with "
            "more rounds before calling it a cost or a gain"
        )
        + ". The summary's `samples_per_second` counts the first "
        "steps too: see the table. *Command s*: the 2-process runs spend "
        + ", ".join(f"{name} {outside_fit(measured[name]):.0f} s" for name in ("ddp", "fsdp", "pipeline"))
        + " outside `fit` (torchrun, imports, process group; the pipeline's tracing), the 1-process runs "
        f"{'-'.join(one_process)} s."
    )
    rss = {
        name: statistics.median(entry.values("peak_memory_bytes")) / MIB for name, entry in measured.items()
    }
    lines.append(
        f"- **Peak RSS** is {min(rss.values()):.0f}-{max(rss.values()):.0f} MiB in every strategy: torch's "
        f"own footprint, next to a model state of {mib(sum(ddp.first(k) for k in BYTES))} MiB and "
        f"activations of {mib(ddp.first('activation_bytes'))} MiB. Against single: "
        + ", ".join(f"{name} {round(rss[name] - rss[REFERENCE]):+d} MiB" for name in deltas)
        + " (not broken down here: gloo and DDP's buckets; FSDP2's and DTensor's run-time state; the "
        "pipeline's tracing with torch.export and its schedule. Not imports: "
        "importing FSDP and torch.distributed.pipelining after `leantrain` adds no resident memory). On a "
        "model this small, sharding saves nothing visible in the process's memory; the byte counts above "
        "are the figures that scale with the model."
    )
    return lines


# ---------------------------------------------------------------------------------------
# Orchestration


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=30,
        help=f"optimizer steps per run, at least {2 * LOG_EVERY} (default 30)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every strategy (default 3)")
    add_output_options(parser, "smoke run: 1 round of 10 steps; writes only with --out", DEFAULT_OUT)
    # Internal: the fsdp probe, started by torchrun.
    parser.add_argument("--fsdp-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fsdp_probe:
        if args.probe_out is None:
            parser.error("--fsdp-probe needs --probe-out")
        return args
    if args.quick:
        args.steps, args.rounds = 2 * LOG_EVERY, 1
    args.out = output_path(args, DEFAULT_OUT)
    if args.steps < 2 * LOG_EVERY or args.rounds < 1:
        parser.error(f"--steps must be at least {2 * LOG_EVERY} (2 log windows), --rounds at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fsdp_probe:
        fsdp_probe(args.probe_out)
        return 0
    started = time.perf_counter()
    load_before = load_now()
    with tempfile.TemporaryDirectory(prefix="leantrain-parallelism-bench-") as scratch:
        measured = measure(args.rounds, args.steps, Path(scratch))
        print("fsdp probe", file=sys.stderr, flush=True)
        probe = run_probe(Path(scratch))
        val_check = validation_check(
            Path(measured[REFERENCE].first("out_dir")), measured["pipeline"].first("accumulation_steps")
        )
    minutes = (time.perf_counter() - started) / 60
    table = render(measured, probe, val_check, args, load_before, minutes)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
