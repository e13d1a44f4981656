"""Memory per process, loss and overhead of the parallel strategies on the CPU (charlm, gloo).

The built-in ``charlm`` example (a 4-block GPT, tied embedding and head weights) trained with
the same global batch, micro-batch, steps and seed by every strategy:

- ``single`` (one process, the reference) and ``split`` (one process, ``--device-map cpu,cpu``):
  ``leantrain fit``;
- ``ddp``, ``fsdp``, ``pipeline`` (2 stages), ``tp`` (``--tp 2`` with the defaults: strategy
  ddp, sequence parallelism on) and ``tp (no SP)`` (``--sequence-parallel false``): ``leantrain
  launch --nproc-per-node 2 fit``;
- ``ddp x tp`` and ``fsdp x tp`` (``--strategy ddp|fsdp --tp 2``: 2 data-parallel ranks of
  2-rank tensor-parallel groups): ``leantrain launch --nproc-per-node 4 fit``.

Every run is a subprocess with ``OMP_NUM_THREADS=1`` per process and its own run folder in a
temporary directory; the figures are read from its ``summary.json`` (written by rank 0, so the
byte counts are rank 0's view): ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``,
``activation_bytes``, ``peak_memory_bytes``, ``samples_per_second``, ``final_train_loss``
(and ``val_loss``). The strategies run interleaved, several rounds in a rotating order; the
tables give medians.

Two probes, this file started by torchrun:

- ``--fsdp-probe`` shards the model as ``fsdp`` does and looks at what autograd saves in one
  forward: FSDP all-gathers each block's weights for its forward, autograd saves those gathered
  weights for backward, and the engine's activation count sees them; FSDP frees their storage
  after the block's forward.
- ``--tp-probe`` counts the collectives tensor parallelism runs: in one micro-batch's forward and
  backward of the model split by leantrain's own strategy, and in one whole training step of
  ``leantrain.Trainer`` (also under plain ddp, for comparison), with and without sequence
  parallelism; and what its activation count holds.

    python benchmarks/parallelism.py          # full run (about 11 min on 2 cores): results/parallelism.md
    python benchmarks/parallelism.py --quick  # smoke run (1 round, 20 steps); prints the tables only
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import platform
import re
import shlex
import statistics
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

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.data import default_collate

import leantrain as lt
from _common import add_output_options, cpu_model, git_state, load_now, output_path, publish, ranged
from leantrain.examples.charlm import Block, CharLMTask
from leantrain.memory.accountant import base_tensor, held_memory
from leantrain.strategies.base import Example
from leantrain.strategies.ddp import Distributed
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.fsdp import FullyShard
from leantrain.strategies.tp_plan import STYLES, planned_modules

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "parallelism.md"
PROCESSES = 2  # of the multi-process strategies; also the pipeline's stages
TP = 2  # the tensor-parallel degree of the tp rows
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
    runs_as: str = ""  # the strategy summary.json names, where not ``name``
    tp: int = 1

    @property
    def summary_strategy(self) -> str:
        return self.runs_as or self.name

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name).strip("-")

    def data_parallel(self) -> int:
        """How many shares the global batch is split into: a pipeline's stages and a tensor-parallel
        group's ranks all load the same samples."""
        return self.processes // self.tp if self.summary_strategy in ("ddp", "fsdp") else 1

    def micro_x_acc(self) -> str:
        """Micro-batch x accumulation steps of one process."""
        return f"{MICRO_BATCH} x {GLOBAL_BATCH // self.data_parallel() // MICRO_BATCH}"


TP_HOLDS = "1/2 of each block's 4 matrices; embeddings, head, norms whole"
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
    # The task asks for `--tp 2` with leantrain's defaults: the default strategy of a launch is ddp
    # (over one data-parallel rank here), and summary.json says so.
    Strategy("tp", TP, ("--tp", str(TP)), TP_HOLDS, runs_as="ddp", tp=TP),
    # charlm's plan splits the positions between blocks (sequence parallelism) unless told not to:
    # this row is the plain Megatron split, whose all-reduces the formula describes.
    Strategy("tp (no SP)", TP, ("--tp", str(TP), "--sequence-parallel", "false"), "as tp", "ddp", TP),
    Strategy("ddp x tp", 2 * TP, ("--strategy", "ddp", "--tp", str(TP)), "as tp (2 replicas)", "ddp", TP),
    Strategy(
        "fsdp x tp", 2 * TP, ("--strategy", "fsdp", "--tp", str(TP)), "1/2 of tp's (FSDP over dp)", "fsdp", TP
    ),
)
REFERENCE = "single"
DATA_PARALLEL = "ddp"  # what fsdp and the pipeline are compared with: a full replica per process
TP_ROWS = ("tp", "tp (no SP)", "ddp x tp", "fsdp x tp")
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
    window_losses: list[list[float]] = field(default_factory=list)  # each log window's train loss, per round

    def values(self, key: str) -> list[float]:
        return [summary[key] for summary in self.summaries]

    def first(self, key: str) -> Any:
        return self.summaries[0][key]


def run_leantrain(entry: Measured, scratch: Path, steps: int, index: int) -> None:
    out_dir = scratch / f"run-{index}-{entry.strategy.slug}"
    command = [sys.executable, "-m", "leantrain", *fit_arguments(entry.strategy, out_dir, steps)]
    started = time.perf_counter()
    run_checked(command, f"leantrain {entry.strategy.name}")
    entry.command_seconds.append(time.perf_counter() - started)
    summary = json.loads((out_dir / "summary.json").read_text())
    said = (summary["strategy"], summary.get("tensor_parallel", 1), summary["steps"])
    if said != (entry.strategy.summary_strategy, entry.strategy.tp, steps):
        raise RuntimeError(f"{entry.strategy.name}: summary.json says strategy, tp, steps = {said}")
    entry.summaries.append(summary)
    speed, losses = read_metrics(out_dir / "metrics.csv")
    entry.steady.append(speed)
    entry.window_losses.append(losses)


def read_metrics(metrics_csv: Path) -> tuple[float, list[float]]:
    """The median ``samples_per_second`` of the log windows after the first (warm-up: the first step
    also counts the saved activations, and a pipeline's first step builds its schedule), and every
    window's mean train loss."""
    with metrics_csv.open(newline="") as file:
        # The final validation writes a row without samples_per_second.
        rows = [row for row in csv.DictReader(file) if row["samples_per_second"]]
    if len(rows) < 2:
        raise RuntimeError(f"{metrics_csv}: {len(rows)} log window(s); --steps must give at least 2")
    speeds = [float(row["samples_per_second"]) for row in rows]
    return statistics.median(speeds[1:]), [float(row["train_loss"]) for row in rows]


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

    Counted as the engine's accountant counts (``leantrain.memory.accountant.held_memory``): each
    saved storage once; the model's parameters (here the local shards) left out.
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
        exclude = {held_memory(p)[0] for p in plan.model.parameters()}
        saved: dict[Any, tuple[torch.Tensor, int]] = {}  # storage -> (a tensor on it, its bytes)

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key, size = held_memory(tensor)
            if key not in exclude:
                saved.setdefault(key, (base_tensor(tensor), size))
            return tensor

        data = task.train_data()
        batch = default_collate([data[i] for i in range(MICRO_BATCH)])
        plan.module.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = task.loss(plan.module, batch)
        freed = [(t, size) for t, size in saved.values() if t.untyped_storage().nbytes() == 0]
        shapes = sorted({tuple(t.shape) for t, _ in freed})
        result = {
            "counted_bytes": sum(size for _, size in saved.values()),
            "freed_bytes": sum(size for _, size in freed),
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


def probe_command(out: Path, mode: str, processes: int, *extra: str) -> list[str]:
    return [
        *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)),
        str(Path(__file__).resolve()),
        *(mode, "--probe-out", str(out), *extra),
    ]


def run_probe(scratch: Path) -> dict[str, Any]:
    out = scratch / "fsdp-probe.json"
    run_checked([sys.executable, *probe_command(out, "--fsdp-probe", PROCESSES)], "fsdp probe")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------
# The tp probe: the collectives tensor parallelism runs, and what its activation count holds

# The functional collectives' helpers: they wait for or wrap a result, and move nothing.
BOOKKEEPING = ("wait_tensor", "_wrap_tensor_autograd")
# Where c10d's collectives live in the dispatcher: DTensor's (functional) and torch.distributed's.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d")


def group_ranks(args: Sequence[Any]) -> list[int]:
    """The global ranks of the group a dispatched collective runs on."""
    if isinstance(args[-1], str):  # a functional collective: its group's name comes last
        return dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(args[-1]))
    for arg in args[1:]:
        if isinstance(arg, torch.ScriptObject):  # torch.distributed's ops pass the group boxed
            try:
                return dist.get_process_group_ranks(dist.ProcessGroup.unbox(arg))
            except RuntimeError:  # another boxed argument: the reduce op
                continue
    return []


class CollectiveCounter(TorchDispatchMode):
    """Every collective that reaches the dispatcher, with the bytes of the tensors it is given.

    DTensor's redistributions call the functional collectives, in forward and in the backward
    that autograd runs on this thread (on the CPU); ``dist.all_reduce`` and DDP's reducer call
    c10d's ops through the dispatcher too. The bytes are those of the first argument: the
    tensors reduced (or the input of a gather), not what goes on the wire.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = ""
        self.calls: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        op = func.name().partition("::")[2]
        if func.namespace in COLLECTIVE_NAMESPACES and op not in BOOKKEEPING:
            tensors = [t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
            self.calls.append({
                "op": func.name(),
                "phase": self.phase,
                "shapes": [list(t.shape) for t in tensors],
                "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else "",
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "ranks": group_ranks(args),
            })  # fmt: skip
        return func(*args, **(kwargs or {}))


def gloo_shapes(profiler: profile) -> list[list[Any]]:
    """What gloo itself ran, from the profiler's events (record_shapes): names and input shapes."""
    return [[event.name, event.input_shapes] for event in profiler.events() if event.name.startswith("gloo:")]


class SavedTensors:
    """What autograd saves in one forward, counted as the engine's accountant counted it before it
    counted storages (each tensor once, as its base; the parameters left out by identity) and split
    into what that count holds: tensors on a parameter's storage, tensors on a storage counted
    already, and the rest (by storage: what the engine counts now)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.parameter_ids = {id(base_tensor(p)) for p in model.parameters()}
        self.parameter_storages = {
            base_tensor(p).untyped_storage().data_ptr(): name for name, p in model.named_parameters()
        }
        self.saved: dict[int, torch.Tensor] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        root = base_tensor(tensor)
        if id(root) not in self.parameter_ids:
            self.saved.setdefault(id(root), root)
        return tensor

    def summary(self) -> dict[str, Any]:
        def size(tensors: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        on_parameters, seen, again = [], {}, []
        for tensor in self.saved.values():
            storage = tensor.untyped_storage().data_ptr()
            if storage in self.parameter_storages:
                on_parameters.append(tensor)
            elif storage in seen:
                again.append((seen[storage], tensor))
            else:
                seen[storage] = tensor
        return {
            "counted_bytes": size(list(self.saved.values())),
            "parameter_bytes": size(on_parameters),
            "parameter_names": sorted(
                {self.parameter_storages[t.untyped_storage().data_ptr()] for t in on_parameters}
            ),
            "parameter_shapes": sorted({tuple(t.shape) for t in on_parameters}),
            "again_bytes": size([t for _, t in again]),
            "again_shapes": sorted({(tuple(first.shape), tuple(t.shape)) for first, t in again}),
            "held_bytes": sum(t.untyped_storage().nbytes() for t in seen.values()),
        }


def first_micro_batch(task: CharLMTask) -> Any:
    data = task.train_data()
    return default_collate([data[i] for i in range(MICRO_BATCH)])


def probe_micro_batch(task: CharLMTask, sequence: bool) -> dict[str, Any]:
    """Split charlm as ``--tp`` does (leantrain's own strategy, its plan, sequence parallelism on or
    off), then count the collectives of one micro-batch's forward and backward twice: in the
    dispatcher (``CollectiveCounter``) and in gloo's own profiler events. Also what autograd saves,
    and the float32 distance of the loss and gradients from the same micro-batch on the whole model."""
    torch.manual_seed(SEED)
    model = task.model()
    whole = copy.deepcopy(model)  # the same weights, not split: the reference
    config = lt.TrainConfig(
        strategy="ddp",
        tp=TP,
        sequence_parallel=sequence,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
    )
    strategy = Distributed.with_tensor_parallel()(config, torch.device("cpu"), ParallelDims(dp=1, tp=TP))
    batch = first_micro_batch(task)
    strategy.wrap(model, Example(task.loss, lambda: batch, task.tp_plan))
    saved, counter = SavedTensors(strategy.model), CollectiveCounter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler, counter:
        counter.phase = "forward"
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            loss = task.loss(strategy.module, batch)
        counter.phase = "backward"
        loss.sum.backward()
    reference = task.loss(whole, batch)
    reference.sum.backward()
    wanted = dict(whole.named_parameters())
    worst, largest = 0.0, 0.0
    for name, parameter in strategy.model.named_parameters():
        grad = parameter.grad
        # After counting: full_tensor is a collective, and it also sums a norm's pending (Partial)
        # gradient under sequence parallelism, as the strategy does once a step.
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        worst = max(worst, float((grad - wanted[name].grad).abs().max()))
        largest = max(largest, float(wanted[name].grad.abs().max()))
    return {
        "calls": counter.calls,
        "gloo": gloo_shapes(profiler),
        "saved": saved.summary(),
        "loss": float(loss.sum),
        "loss_whole": float(reference.sum),
        "grad_max_diff": worst,
        "grad_max": largest,
    }


class NoValidation(CharLMTask):
    def val_data(self) -> None:
        """The step probe counts a training step: a final validation would only add time."""


class StepWindow:
    """A callback that counts the collectives of one whole training step as the Trainer runs it:
    the third, from the end of the second (the first steps are not typical: leantrain checks the
    whole gradients' agreement over a TP group at the first, DDP broadcasts its rebuilt buckets in
    the second) to its own end."""

    def __init__(self) -> None:
        self.counter = CollectiveCounter()
        self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def on_step(self, stats: Any) -> None:
        if stats.step == 2:
            self.profiler.start()
            self.counter.__enter__()
        elif stats.step == 3:
            self.counter.__exit__(None, None, None)
            self.profiler.stop()


def probe_step(tp: int, sequence: bool, run_dir: Path) -> dict[str, Any]:
    window = StepWindow()
    config = lt.TrainConfig(
        strategy="ddp",
        tp=tp,
        sequence_parallel=sequence,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        max_steps=3,
        device="cpu",
        seed=SEED,
        progress="none",
        logger="none",
        out_dir=str(run_dir),
    )
    lt.Trainer(config, callbacks=[window]).fit(NoValidation())
    return {"calls": window.counter.calls, "gloo": gloo_shapes(window.profiler)}


# The step probes: (row, processes, tp, sequence parallelism), by the torchrun that runs them.
STEP_PROBES = (
    ("tp", TP, TP, True),
    ("tp (no SP)", TP, TP, False),
    ("ddp x tp", 2 * TP, TP, True),
    ("ddp", PROCESSES, 1, False),
)


def tp_probe(out: Path, tp: int) -> None:
    """With exactly one tensor-parallel group, one micro-batch with and without sequence
    parallelism; then every step probe of this layout (the Trainer takes the group it finds)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        result: dict[str, Any] = {"micro_batch": {}, "steps": {}}
        if tp == world:
            for sequence in (False, True):
                result["micro_batch"]["SP" if sequence else "no SP"] = probe_micro_batch(
                    CharLMTask(), sequence
                )
        for row, processes, probe_tp, sequence in STEP_PROBES:
            if (processes, probe_tp) == (world, tp):
                result["steps"][row] = probe_step(tp, sequence, out.with_suffix(f".{len(result['steps'])}"))
        if dist.get_rank() == 0:
            out.write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_tp_probes(scratch: Path) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {"micro_batch": {}, "steps": {}}
    for processes, tp in dict.fromkeys((processes, tp) for _, processes, tp, _ in STEP_PROBES):
        out = scratch / f"tp-probe-{processes}-{tp}.json"
        command = probe_command(out, "--tp-probe", processes, "--probe-tp", str(tp))
        run_checked([sys.executable, *command], f"tp probe ({processes} processes, tp {tp})")
        for key, value in json.loads(out.read_text()).items():
            merged[key].update(value)
    return merged


def validation_check(single_run: Path, pipeline_accumulation: int) -> dict[str, Any]:
    """Single's final weights evaluated on all validation sequences, and on those a pipeline keeps.

    The pipeline validates its micro-batches ``pipeline_accumulation`` at a time and leaves out a
    last incomplete group: it sees the first ``kept`` sequences of the (unsharded) validation set.
    """
    torch.set_num_threads(1)
    task = CharLMTask()
    model = task.model()
    missing, unexpected = model.load_state_dict(load_file(single_run / "model.safetensors"), strict=False)
    # The tied weight is exported once, under one of its two names.
    if unexpected or len(missing) > 1 or set(missing) - {"token.weight", "head.weight"}:
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


def plan_facts(task: CharLMTask, model: torch.nn.Module) -> dict[str, int]:
    """From charlm's plan as leantrain reads it: the bytes of the tensors it splits (every split
    weight, and a colwise layer's bias; a rowwise layer adds its bias after the sum: whole), and how
    many tensors the sequence-parallel norms have (their gradients come in parts, one per rank)."""
    split, norm_tensors = 0, 0
    for name, style in planned_modules(model, task.tp_plan(model), TP).items():
        module = model.get_submodule(name)
        if style == "sequence_parallel":
            norm_tensors += len(list(module.parameters()))
        if not STYLES[style][0]:  # a style that splits nothing
            continue
        split += module.weight.numel() * module.weight.element_size()
        if module.bias is not None and STYLES[style][0] == "out":
            split += module.bias.numel() * module.bias.element_size()
    return {"split_bytes": split, "sequence_norm_tensors": norm_tensors}


def model_facts() -> dict[str, int]:
    task = CharLMTask()
    model = task.model()
    return {
        "params": sum(p.numel() for p in model.parameters()),  # the tied weight once
        "param_tensors": len(list(model.parameters())),
        "token_bytes": model.token.weight.numel() * model.token.weight.element_size(),
        "vocab": model.token.weight.shape[0],
        "width": model.token.weight.shape[1],
        "block": model.position.weight.shape[0],
        "blocks": len(model.blocks),
        **plan_facts(task, model),
    }


def per_round_ratios(entry: Measured, reference: Measured, key: str) -> list[float]:
    return [a[key] / b[key] for a, b in zip(entry.summaries, reference.summaries, strict=True)]


def command_line(name: str, steps: int) -> str:
    strategy = next(s for s in STRATEGIES if s.name == name)
    return f"`{shlex.join(['leantrain', *fit_arguments(strategy, Path('DIR'), steps)])}`"


def render(measured: dict[str, Measured], probes: dict[str, Any], context: dict[str, Any]) -> str:
    facts = model_facts()
    lines = [
        *header_lines(context, facts),
        *memory_lines(measured),
        *speed_lines(measured),
        *tp_section(probes["tp"], facts, measured),
        "",
        "## Findings",
        "",
        *findings(measured, probes, facts),
    ]
    return "\n".join(lines) + "\n"


def header_lines(context: dict[str, Any], facts: dict[str, int]) -> list[str]:
    args = context["args"]
    example = " and ".join(command_line(name, args.steps) for name in ("ddp", "split", "tp"))
    return [
        "# Parallel strategies on the CPU: memory per process, loss and overhead (charlm, gloo)",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.system()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPU cores visible, Python {platform.python_version()}; "
        f"load average before / after: {context['load_before']} / {load_now()}; the full run took "
        f"{context['minutes']:.1f} min",
        f"- Versions: torch {torch.__version__}, leantrain {lt.__version__}; commit "
        f"{context['commit_before']}"
        + (
            f" (after the run: {context['commit_after']})"
            if context["commit_after"] != context["commit_before"]
            else ""
        ),
        f"- Work: the built-in `charlm` example (4 blocks, width {facts['width']}, vocabulary "
        f"{facts['vocab']}, {facts['params']:,} parameters with the token embedding and the head tied; "
        f"AdamW; fp32; validation once at the end), global batch {GLOBAL_BATCH}, micro-batch "
        f"{MICRO_BATCH}, {args.steps} steps, seed {SEED}, every process with `OMP_NUM_THREADS=1`. "
        f"`single` and `split` run in one process (`leantrain fit`), `ddp`, `fsdp`, `pipeline`, `tp` and "
        f"`tp (no SP)` in {PROCESSES} (`leantrain launch --nproc-per-node {PROCESSES} fit`, gloo; `tp` is "
        f"`--tp {TP}` with the defaults: strategy ddp over one data-parallel rank, sequence parallelism on; "
        f"`tp (no SP)` adds `--sequence-parallel false`), `ddp x tp` and `fsdp x tp` in {2 * TP} "
        f"(`--nproc-per-node {2 * TP} --strategy ddp|fsdp --tp {TP}`: 2 data-parallel ranks, each a "
        f"{TP}-rank tensor-parallel group, so {2 * TP} processes share the {os.cpu_count()} cores). E.g. "
        f"{example}.",
        f"- Runs: {args.rounds} round(s), the {len(STRATEGIES)} strategies in a rotating order (reversed "
        "every other round), each run a subprocess with its run folder in a temporary directory; the "
        "figures are read from its `summary.json`, which rank 0 writes: the bytes are rank 0's. Medians over "
        "rounds, the range in brackets where it shows.",
    ]


def memory_lines(measured: dict[str, Measured]) -> list[str]:
    ddp = measured[DATA_PARALLEL]
    lines = [
        "",
        "## Memory per process (rank 0)",
        "",
        "- *Params*, *Grads*, *Optimizer*: `params_bytes`, `grads_bytes`, `optimizer_bytes` (the engine's "
        "accountant, after the first step: each tensor once, a sharded `DTensor` as its local shard). "
        "*Activations*: `activation_bytes`, what autograd saves for backward in the first micro-batch's "
        "forward (for fsdp and the tp rows it counts more than is held: see the findings). *vs ddp*: Params "
        "/ Grads / Optimizer over ddp's. *Peak RSS*: `peak_memory_bytes`, the process's peak resident set "
        "(`VmHWM`), most of it torch itself. MiB.",
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
    return lines


def speed_lines(measured: dict[str, Measured]) -> list[str]:
    ref = measured[REFERENCE]
    lines = [
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
        f"- Not a speed benchmark of the strategies: {PROCESSES} processes on {os.cpu_count()} cores (the "
        f"`x tp` rows {2 * TP}), one thread each, on a tiny model, beside whatever else runs on the machine "
        "(see the load average). The multi-process rows show what each strategy's communication and "
        "bookkeeping cost here; the one-process rows leave a core idle.",
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
    return lines


ALL_REDUCE = "_c10d_functional::all_reduce"
ALL_GATHER = "_c10d_functional::all_gather_into_tensor"
REDUCE_SCATTER = "_c10d_functional::reduce_scatter_tensor"
PHASES = ("forward", "backward")
# What gloo runs for each collective. torch's gloo backend runs a reduce-scatter as an all-reduce of
# the whole tensor, each rank then keeping its part (its profiler events say so: gloo_agrees checks).
GLOO_RUNS = {
    "all_reduce": "gloo:all_reduce",
    "allreduce_": "gloo:all_reduce",
    "all_gather_into_tensor": "gloo:all_gather",
    "reduce_scatter_tensor": "gloo:all_reduce",
    "broadcast_": "gloo:broadcast",
}


def kind(op: str) -> str:
    return op.partition("::")[2]


def ring_bytes(op: str, size: float, group: int) -> float:
    """What a ring sends per rank (and receives) for a collective handed ``size`` bytes over ``group``
    ranks: an all-reduce 2 (n - 1) / n of them, a reduce-scatter (n - 1) / n of its whole input, an
    all-gather n - 1 times the part each rank gives."""
    if kind(op).startswith("all_gather"):
        return (group - 1) * size
    share = (group - 1) / group * size
    return share if kind(op).startswith("reduce_scatter") else 2 * share


def moved_per_rank(calls: list[dict[str, Any]]) -> float:
    return sum(ring_bytes(call["op"], call["bytes"], len(call["ranks"])) for call in calls)


def gloo_sent(calls: list[dict[str, Any]]) -> float:
    """As ``moved_per_rank``, for the collectives gloo runs: a reduce-scatter is an all-reduce there."""
    return sum(ring_bytes(GLOO_RUNS.get(kind(c["op"]), c["op"]), c["bytes"], len(c["ranks"])) for c in calls)


def dispatched_shapes(calls: list[dict[str, Any]]) -> list[list[Any]]:
    """The counter's calls as gloo names its work, to compare with ``gloo_shapes``."""
    return [[GLOO_RUNS.get(kind(c["op"]), c["op"]), c["shapes"]] for c in calls]


def activation_size(facts: dict[str, int]) -> int:
    """One micro-batch's activations at a block's boundary: micro-batch x block x width, float32."""
    return MICRO_BATCH * facts["block"] * facts["width"] * 4


def tp_formula(facts: dict[str, int], sequence: bool) -> dict[tuple[str, str], tuple[int, int]]:
    """Megatron's collectives per micro-batch: (collective, phase) -> (count, bytes handed to each).

    Without sequence parallelism, per block 2 all-reduces of the activations in forward (after the
    rowwise layers) and 2 of their gradients in backward (before the colwise ones). With it, each
    becomes an all-gather of the rank's share of the positions before a colwise layer and a
    reduce-scatter after a rowwise one, and the reverse in backward; plus the ways in and out of the
    split: the head's input gathered in forward, the first block's input gradient in backward.
    """
    size, pairs = activation_size(facts), 2 * facts["blocks"]
    if not sequence:
        return {(ALL_REDUCE, phase): (pairs, size) for phase in PHASES}
    gathers = {(ALL_GATHER, phase): (pairs + 1, size // TP) for phase in PHASES}
    return {**gathers, **{(REDUCE_SCATTER, phase): (pairs, size) for phase in PHASES}}


def group_name(ranks: Sequence[int], processes: int, tp: int) -> str:
    """Rank 0's group by role: tensor-parallel ranks are consecutive, data-parallel ones ``tp`` apart."""
    role = "tp" if tp > 1 and list(ranks) == list(range(tp)) else ""
    role = role or ("dp" if list(ranks) == list(range(0, processes, tp)) else "?")
    return f"{role}: {', '.join(map(str, ranks))}"


def grouped(calls: list[dict[str, Any]]) -> list[tuple[tuple[Any, ...], int]]:
    """The calls by (op, phase, ranks, bytes each, dtype), in the order they first came."""
    keys = ((call["op"], call["phase"], tuple(call["ranks"]), call["bytes"], call["dtype"]) for call in calls)
    return list(Counter(keys).items())


def gloo_agrees(probe: dict[str, Any]) -> bool:
    """Whether gloo's own events are the dispatcher's collectives: the same names, count and shapes."""

    def key(pair: list[Any]) -> str:
        return json.dumps(pair)

    return Counter(map(key, probe["gloo"])) == Counter(map(key, dispatched_shapes(probe["calls"])))


def tp_section(tp_probes: dict[str, Any], facts: dict[str, int], measured: dict[str, Measured]) -> list[str]:
    lines = [
        "",
        "## Tensor parallelism: bytes communicated per step, measured against the formula",
        "",
        "- *Formula* (Megatron's, for charlm's plan): per block and micro-batch, the forward all-reduces "
        "the outputs of `proj` and `mlp.2` (the rowwise layers' partial sums), the backward the input "
        "gradients of `qkv` and `mlp.0` (the colwise layers' partial ones); each micro-batch x block x "
        f"width x 4 bytes = {MICRO_BATCH} x {facts['block']} x {facts['width']} x 4 = "
        f"{activation_size(facts):,} B. With sequence parallelism (`--sequence-parallel`, on by default "
        "where the plan has it, as charlm's does) each rank holds its share of the positions between the "
        "blocks' matrices: each all-reduce becomes an all-gather before a colwise layer and a "
        "reduce-scatter after a rowwise one (in backward the reverse), plus the ways in and out (the "
        "head's input gathered in forward, the first block's input gradient in backward). Sent per rank by "
        "a ring over n ranks: an all-reduce "
        "2 (n - 1) / n of the tensor, a reduce-scatter and an all-gather (n - 1) / n of the whole.",
        f"- *Measured*: the probe (`parallelism.py --tp-probe`, started by torchrun in {TP} processes) "
        "splits charlm with leantrain's own strategy (`Distributed.with_tensor_parallel()`, what `--tp "
        f"{TP}` runs: charlm's `tp_plan` through `parallelize_module`), once with sequence parallelism and "
        "once without, and runs the first micro-batch's forward and backward inside a `TorchDispatchMode` "
        "that records every op of the `_c10d_functional` and `c10d` namespaces with the bytes of the "
        "tensors handed to it (DTensor's redistributions and torch.distributed's collectives, DDP's "
        "reducer included, all pass the dispatcher; the helpers `wait_tensor` and `_wrap_tensor_autograd` "
        "move nothing and are left out), and inside `torch.profiler` (record_shapes), whose `gloo:*` events "
        "are what gloo itself ran. The bytes are those handed to the collectives (an all-gather's: the "
        "rank's part); what crosses the wire is the ring figure, or gloo's own (below).",
        "",
        "One micro-batch, forward and backward, rank 0:",
        "",
        "| Plan | Collective | Phase | Count | Bytes each | Total bytes | Formula | Ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for plan, micro in tp_probes["micro_batch"].items():
        lines += micro_batch_rows(plan, micro, tp_formula(facts, plan == "SP"))
    micros = tp_probes["micro_batch"].values()
    in_group = all(call["ranks"] == list(range(TP)) for micro in micros for call in micro["calls"])
    agree = all(gloo_agrees(micro) for micro in micros)
    lines += [
        "",
        (
            "Every one over the tensor-parallel group (ranks 0, 1). "
            if in_group
            else "NOT all over ranks 0, 1. "
        )
        + (
            "gloo's events in the same windows are the same collectives, count and shapes, each "
            "reduce-scatter run as a `gloo:all_reduce` of its whole input (torch's gloo backend, here), and "
            "an all-reduce sends twice a reduce-scatter's bytes (the *gloo* rows). "
            if agree
            else "gloo's events are NOT the dispatcher's: read the probe. "
        )
        + "The split model's loss sum on this micro-batch against the whole model's, and the largest "
        "gradient difference: "
        + "; ".join(
            f"{plan}: {micro['loss']:.6f} against {micro['loss_whole']:.6f}, {micro['grad_max_diff']:.1e} "
            f"(largest |gradient| {micro['grad_max']:.1f})"
            for plan, micro in tp_probes["micro_batch"].items()
        )
        + ": float32 rounding.",
        *tp_step_table(tp_probes["steps"], facts, measured),
    ]
    return lines


def micro_batch_rows(
    plan: str, micro: dict[str, Any], formula: dict[tuple[str, str], tuple[int, int]]
) -> list[str]:
    rows = []
    for (op, phase, _, each, dtype), count in grouped(micro["calls"]):
        total = count * each
        wanted_count, wanted_each = formula.get((op, phase), (0, 0))
        wanted = wanted_count * wanted_each
        rows.append(
            f"| {plan} | `{op}` ({dtype}) | {phase} | {count} | {each:,} | {total:,} | "
            + (
                f"{wanted_count} x {wanted_each:,} = {wanted:,} | {total / wanted:.3f} |"
                if wanted
                else "- | - |"
            )
        )
    calls = micro["calls"]
    total, wanted = sum(c["bytes"] for c in calls), sum(n * each for n, each in formula.values())
    ring = sum(ring_bytes(op, n * each, TP) for (op, _), (n, each) in formula.items())
    sent, by_gloo = moved_per_rank(calls), gloo_sent(calls)
    return [
        *rows,
        f"| {plan}: all | | | {len(calls)} | | {total:,} | {wanted:,} | {total / wanted:.3f} |",
        f"| {plan}: sent per rank, ring | | | | | {sent:,.0f} | {ring:,.0f} | {sent / ring:.3f} |",
        f"| {plan}: sent per rank, gloo | | | | | {by_gloo:,.0f} | {ring:,.0f} | {by_gloo / ring:.3f} |",
    ]


def tp_step_table(steps: dict[str, Any], facts: dict[str, int], measured: dict[str, Measured]) -> list[str]:
    lines = [
        "",
        "One whole training step (the third), rank 0: the same counter and profiler in a callback of "
        "`leantrain.Trainer` (`TrainConfig(strategy='ddp', tp=..., sequence_parallel=...)`, as `launch ... "
        "fit` builds it, charlm without validation), from the end of the second step to the end of the "
        "third (the first steps are not typical: leantrain checks at the first that the whole gradients "
        "agree over a TP group, DDP broadcasts its rebuilt buckets in the second). Plain ddp for "
        "comparison. *Expected*: the formula for the activations (micro-batches per rank x per micro-batch); "
        "the norms' gradient parts under sequence parallelism (each rank's positions give a part of a "
        "norm's weight and bias gradient, summed once a step after backward); the run's `grads_bytes` "
        "(rank 0's gradient values) for the gradients' all-reduce over the data-parallel group.",
        "",
        "| Run | Collective | Group (ranks) | Count | Bytes each | Tensor bytes | Sent per rank (ring) "
        "| Expected |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for row, processes, tp, sequence in STEP_PROBES:
        calls = steps[row]["calls"]
        micro_batches = GLOBAL_BATCH // (processes // tp) // MICRO_BATCH
        per_step: Counter[tuple[str, int]] = Counter()
        for (op, _), (count, each) in tp_formula(facts, sequence).items():
            per_step[op, each] += count * micro_batches if tp > 1 else 0
        gradients = sum(c["bytes"] for c in calls if is_gradient_reduce(c))
        grads_bytes = measured[row if row in measured else DATA_PARALLEL].first("grads_bytes")
        for (op, _, ranks, each, dtype), count in grouped(calls):
            if per_step[op, each]:
                expected = f"{per_step[op, each]} x {each:,}"
            elif sequence and op == ALL_REDUCE and each == facts["width"] * 4:
                expected = f"{facts['sequence_norm_tensors']} x {each:,}: the norms' gradient parts"
            elif is_gradient_reduce({"op": op, "dtype": dtype, "ranks": ranks}):
                together = "together " if gradients != each * count else ""
                expected = f"{together}`grads_bytes` {grads_bytes:,}" + (
                    "" if gradients == grads_bytes else " (NOT what was reduced)"
                )
            else:
                expected = "the loss sums: total, count, is-a-sum" if each == 24 else ""
            lines.append(
                f"| {row} ({processes} processes) | `{op}` ({dtype}) | {group_name(ranks, processes, tp)} "
                f"| {count} | {each:,} | {count * each:,} | {ring_bytes(op, count * each, len(ranks)):,.0f} "
                f"| {expected} |"
            )
        lines.append(
            f"| {row}: the step | all | | {len(calls)} | | {sum(c['bytes'] for c in calls):,} "
            f"| {moved_per_rank(calls):,.0f} | gloo sends {gloo_sent(calls):,.0f} |"
        )
    agree = [gloo_agrees(steps[row]) for row, *_ in STEP_PROBES]
    lines += [
        "",
        "gloo's own events agree with the dispatcher's (names, count, shapes; a reduce-scatter as an "
        "all-reduce) in "
        + ("every step." if all(agree) else f"{sum(agree)} of the {len(agree)} steps only: READ THE PROBE."),
    ]
    return lines


def is_gradient_reduce(call: dict[str, Any]) -> bool:
    """torch.distributed's float32 all-reduce over more than one rank: the gradients (DDP's buckets,
    or ddp x tp's flat all-reduce of each rank's values); the loss sums are float64."""
    return call["op"] == "c10d::allreduce_" and call["dtype"] == "float32" and len(call["ranks"]) > 1


def findings(measured: dict[str, Measured], probes: dict[str, Any], facts: dict[str, int]) -> list[str]:
    return [
        *fsdp_findings(measured, probes["fsdp"], facts),
        pipeline_finding(measured, facts),
        tp_memory_finding(measured, facts),
        tp_activation_finding(measured, probes["tp"]["micro_batch"]),
        loss_finding(measured, probes["val_check"]),
        throughput_finding(measured, probes["tp"]),
        *tp_speed_findings(measured, probes["tp"], facts),
        rss_finding(measured),
    ]


def fsdp_findings(measured: dict[str, Measured], probe: dict[str, Any], facts: dict[str, int]) -> list[str]:
    ref, ddp, fsdp = measured[REFERENCE], measured[DATA_PARALLEL], measured["fsdp"]
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
    return lines


def pipeline_finding(measured: dict[str, Measured], facts: dict[str, int]) -> str:
    """The pipeline's stage: its gradients and optimizer state, and its parameters."""
    ref, ddp, pipe = measured[REFERENCE], measured[DATA_PARALLEL], measured["pipeline"]
    stage_params = pipe.first("grads_bytes")  # every parameter of the stage is trainable
    whole_plus_copy = ref.first("params_bytes") + facts["token_bytes"]
    return (
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


def loss_finding(measured: dict[str, Measured], val_check: dict[str, Any]) -> str:
    ref = measured[REFERENCE]
    deltas = {
        name: max(
            abs(a - b)
            for a, b in zip(entry.values("final_train_loss"), ref.values("final_train_loss"), strict=True)
        )
        for name, entry in measured.items()
        if name != REFERENCE
    }

    def windows(name: str) -> list[float]:
        """The largest difference from single's train loss, log window by log window, over the rounds."""
        pairs = zip(measured[name].window_losses, ref.window_losses, strict=True)
        per_round = [[abs(a - b) for a, b in zip(mine, single, strict=True)] for mine, single in pairs]
        return [max(column) for column in zip(*per_round, strict=True)]

    tp_windows = windows("tp")
    return (
        "- **Loss**: the final train loss against single's, largest difference over the rounds: "
        + ", ".join(f"{name} {delta:.1e}" for name, delta in deltas.items())
        + f" (relative {max(deltas.values()) / ref.first('final_train_loss'):.0e} at most): float32 rounding "
        "of the same sums taken in another order. The log windows' mean train loss against single's, window "
        f"by window ({LOG_EVERY} steps each): "
        + ", ".join(f"{name} {' / '.join(f'{d:.0e}' for d in windows(name))}" for name in ("ddp", *TP_ROWS))
        + ". tp rounds the forward differently too (its all-reduce or reduce-scatter adds the rowwise "
        "layers' partial sums), where ddp only sums the gradients in another order"
        + (", and its difference grows over the steps" if tp_windows[-1] > tp_windows[0] else "")
        + "; its first micro-batch agrees with one process's to float32 rounding (the probe, above), and "
        "leantrain's tests hold tp, ddp x tp and fsdp x tp within 1e-10 of one process in float64. "
        + validation_sentence(measured, val_check)
    )


def validation_sentence(measured: dict[str, Measured], val_check: dict[str, Any]) -> str:
    """Val loss against single's; whether the pipeline validated every sequence or whole groups only."""
    ref, pipe = measured[REFERENCE], measured["pipeline"].first("val_loss")
    off = {name: abs(entry.first("val_loss") - ref.first("val_loss")) for name, entry in measured.items()}
    others = max(v for name, v in off.items() if name not in TP_ROWS)
    every = abs(pipe - val_check["loss_all"]) <= abs(pipe - val_check["loss_kept"])
    where = (
        f"The pipeline validates every sequence: single's final weights (its first round's "
        f"`model.safetensors`) give {val_check['loss_all']:.7f} on all {val_check['all']} (the pipeline's: "
        f"{pipe:.7f}) against {val_check['loss_kept']:.7f} on the {val_check['kept']} in whole groups of "
        f"{val_check['group']} micro-batches, all that a pipeline once evaluated."
        if every
        else f"The pipeline validates its batches {val_check['group']} at a time and leaves out a last "
        f"incomplete group: single's final weights give {val_check['loss_all']:.7f} on all "
        f"{val_check['all']} sequences and {val_check['loss_kept']:.7f} on the {val_check['kept']} it keeps: "
        f"the pipeline's {pipe:.7f}."
    )
    return (
        f"Val loss: within {others:.1e} of single's, the tp rows within "
        f"{max(off[name] for name in TP_ROWS):.1e}. {where}"
    )


def speed(measured: dict[str, Measured], name: str) -> float:
    """Samples/s after warm-up (the summary's figure counts the first steps too)."""
    return statistics.median(measured[name].steady)


def ratio(measured: dict[str, Measured], name: str, reference: str = REFERENCE) -> float:
    pairs = zip(measured[name].steady, measured[reference].steady, strict=True)
    return statistics.median(a / b for a, b in pairs)


def step_ms(measured: dict[str, Measured], name: str) -> float:
    return GLOBAL_BATCH / speed(measured, name) * 1e3


def extra_ms(measured: dict[str, Measured], name: str, reference: str) -> float:
    """The median over rounds of the step time's difference from ``reference``'s in the same round:
    other load on the machine moves both of a round's runs alike more than it moves the medians."""
    pairs = zip(measured[name].steady, measured[reference].steady, strict=True)
    return statistics.median(GLOBAL_BATCH * 1e3 * (1 / a - 1 / b) for a, b in pairs)


def outside_fit(entry: Measured) -> float:
    pairs = zip(entry.command_seconds, entry.values("wall_seconds"), strict=True)
    return statistics.median(command - wall for command, wall in pairs)


def gradient_all_reduces(tp_probes: dict[str, Any]) -> list[dict[str, Any]]:
    """Plain ddp's gradient all-reduces in one step (its buckets), from the step probe."""
    return [call for call in tp_probes["steps"]["ddp"]["calls"] if is_gradient_reduce(call)]


def throughput_finding(measured: dict[str, Measured], tp_probes: dict[str, Any]) -> str:
    ref = measured[REFERENCE]
    others = ("ddp", "fsdp", "pipeline", "split")

    # fsdp's collectives per step: per micro-batch an all-gather of every unit in forward and of
    # every block again in backward (the root stays gathered), then one reduce-scatter per unit.
    blocks, micro_batches = 4, GLOBAL_BATCH // PROCESSES // MICRO_BATCH
    collectives = micro_batches * (2 * blocks + 1) + blocks + 1
    pipeline_micro = GLOBAL_BATCH // MICRO_BATCH
    bubble = f"{PROCESSES - 1}/{pipeline_micro + PROCESSES - 1}"  # (S - 1) / (k + S - 1)
    split_ratios = [a / b for a, b in zip(measured["split"].steady, ref.steady, strict=True)]
    one_process = sorted({f"{outside_fit(measured[name]):.0f}" for name in (REFERENCE, "split")})
    buckets = gradient_all_reduces(tp_probes)
    slower = extra_ms(measured, "fsdp", "ddp")
    return (
        "- **Throughput** after warm-up (the overhead on this machine, not the strategies' speed): "
        + ", ".join(
            f"{name} {speed(measured, name):.0f} samples/s ({ratio(measured, name):.2f}x single)"
            for name in others
        )
        + f", single {speed(measured, REFERENCE):.0f}. ddp splits each step over 2 processes on 2 cores and "
        f"adds {len(buckets)} all-reduce(s) of the gradients per step (DDP's buckets, "
        f"{sum(c['bytes'] for c in buckets):,} B together: the tp probe's plain-ddp step). fsdp / ddp = "
        f"{ratio(measured, 'fsdp', 'ddp'):.2f}, {slower:+.0f} ms a step against ddp (medians of the rounds' "
        f"ratios and differences): fsdp runs about {collectives} collectives a step instead of "
        f"{len(buckets)} (with {micro_batches} micro-batches per process: an all-gather of every unit in "
        "forward and of every block again in backward, then a reduce-scatter per unit), each of at most one "
        "block's weights (0.8 MB) over gloo on the cores that compute"
        + (
            f", about {slower / (collectives - len(buckets)):.1f} ms per extra collective: latency and "
            "FSDP's Python hooks, not bandwidth"
            if slower > 0
            else ": no cost above this run's noise"
        )
        + (". fsdp in 2 processes is slower than single in one" if ratio(measured, "fsdp") < 1 else "")
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
        + ", ".join(
            f"{name} {outside_fit(measured[name]):.0f} s"
            for name, entry in measured.items()
            if entry.strategy.processes == PROCESSES
        )
        + " outside `fit` (torchrun, imports, process group; the pipeline's tracing), the "
        + f"{2 * TP}-process runs "
        + ", ".join(
            f"{name} {outside_fit(measured[name]):.0f} s"
            for name, entry in measured.items()
            if entry.strategy.processes > PROCESSES
        )
        + f", the 1-process runs {'-'.join(one_process)} s."
    )


def tp_memory_finding(measured: dict[str, Measured], facts: dict[str, int]) -> str:
    """What a tp rank holds against what charlm's plan splits."""
    ddp, tp, no_sp, ddp_tp, fsdp_tp = (measured[name] for name in (DATA_PARALLEL, *TP_ROWS))
    whole, split = ddp.first("params_bytes"), facts["split_bytes"]
    expected = whole - split * (TP - 1) // TP
    held = tp.first("params_bytes")
    optimizer_extra = tp.first("optimizer_bytes") - 2 * held  # AdamW's step counters, one per tensor
    fsdp_extra = fsdp_tp.first("params_bytes") - held / 2
    fsdp_alone_extra = measured["fsdp"].first("params_bytes") - whole / 2

    def versus(entry: Measured) -> str:
        return " / ".join(f"{entry.first(k) / ddp.first(k):.3f}" for k in BYTES)

    same = all(no_sp.first(k) == tp.first(k) for k in BYTES)
    return (
        f"- **tp** holds {versus(tp)} of ddp's parameter / gradient / optimizer bytes per process. Charlm's "
        f"plan splits {split:,} B of the model's {whole:,} ({split / whole:.0%}: the {facts['blocks']} "
        "blocks' `qkv`, `proj`, `mlp.0` and `mlp.2` weights and the `qkv` and `mlp.0` biases; a rowwise "
        f"layer's bias is added after the sum and stays whole); each rank holds 1/{TP} of it, {expected:,} B "
        f"in all, and `params_bytes` reads {held:,}"
        + (" (to the byte)" if held == expected else " (NOT the plan's)")
        + f". Its optimizer bytes are AdamW's two moments of those plus {optimizer_extra} B of `step` "
        f"counters. The rest, {whole - split:,} B (the tied token embedding and head, the position "
        "embedding, the layer norms, the rowwise biases), stays whole on every rank: on this model tp saves "
        f"{split * (TP - 1) / TP / whole:.0%} of each process's state, the split matrices' parameters, "
        "gradients and AdamW moments, which on a large model are most of it. "
        + (
            "tp (no SP) holds the same bytes (sequence parallelism splits activations, not parameters). "
            if same
            else f"tp (no SP) holds {versus(no_sp)} (NOT tp's). "
        )
        + f"ddp x tp holds the same per process ({versus(ddp_tp)}: its second TP group is a data-parallel "
        f"replica); fsdp x tp {versus(fsdp_tp)}: FSDP halves tp's share over the 2 data-parallel ranks, "
        f"{fsdp_extra:+,.0f} B beside half of tp's parameters"
        + (" (the embedding's odd row, as in fsdp)." if fsdp_extra == fsdp_alone_extra else ".")
    )


def tp_activation_finding(measured: dict[str, Measured], micro: dict[str, Any]) -> str:
    """What tp's activation count holds (the probe), with and without sequence parallelism."""
    ddp = measured[DATA_PARALLEL].first("activation_bytes")
    runs = {
        "SP": measured["tp"].first("activation_bytes"),
        "no SP": measured["tp (no SP)"].first("activation_bytes"),
    }
    saved = {plan: micro[plan]["saved"] for plan in runs}
    exact = all(saved[plan]["held_bytes"] == runs[plan] for plan in runs)
    sp, whole = saved["SP"], saved["no SP"]
    shapes = ", ".join(str(tuple(shape)) for shape in sp["parameter_shapes"])
    aliases = "; ".join(f"{tuple(a)} and {tuple(b)}" for a, b in sp["again_shapes"])
    overcount = (sp["parameter_bytes"] + sp["again_bytes"]) / sp["held_bytes"]
    return (
        f"- **tp's activations** read {mib(runs['SP'])} MiB (tp (no SP): {mib(runs['no SP'])}) against "
        f"ddp's {mib(ddp)} MiB. The probe counts by storage what autograd saves in the first micro-batch's "
        f"forward: {sp['held_bytes']:,} B with sequence parallelism ({sp['held_bytes'] / ddp:.3f} of ddp's) "
        f"and {whole['held_bytes']:,} B without ({whole['held_bytes'] / ddp:.3f})"
        + (
            " (the runs' figures exactly: the engine counts by storage)"
            if exact
            else " (NOT the runs' figures)"
        )
        + ": each rank keeps its heads' queries, keys, values and attention output and its half of the MLP's "
        "hidden units; the tensors around them (the blocks' inputs, the norms, the residual stream) whole on "
        "both ranks without sequence parallelism, and as each rank's half of the positions with it, which "
        f"saves {whole['held_bytes'] - sp['held_bytes']:,} B here. Counted by the identity of base tensors "
        f"(the engine's way before it counted storages), the same forward reads {sp['counted_bytes']:,} B "
        f"and {whole['counted_bytes']:,} B, {overcount:.0%} too much: {sp['parameter_bytes']:,} B of the "
        f"split weights' own local shards (shapes {shapes}: transposed views of all "
        f"{len(sp['parameter_names'])} planned weights, which autograd saves for backward, made by DTensor "
        f"without a `_base` link to the parameter) and {sp['again_bytes']:,} B counted twice ({aliases}: "
        "one storage, neither tensor a view of the other). ddp x tp's reads "
        f"{mib(measured['ddp x tp'].first('activation_bytes'))} MiB, fsdp x tp's "
        f"{mib(measured['fsdp x tp'].first('activation_bytes'))}."
    )


def tp_speed_findings(
    measured: dict[str, Measured], tp_probes: dict[str, Any], facts: dict[str, int]
) -> list[str]:
    """What tp communicates per micro-batch and step against ddp (the probes), and what it costs here."""
    micro = {plan: tp_probes["micro_batch"][plan]["calls"] for plan in ("no SP", "SP")}
    steps = {row: tp_probes["steps"][row]["calls"] for row in ("tp", "tp (no SP)", "ddp", "ddp x tp")}
    wanted = {plan: sum(n * each for n, each in tp_formula(facts, plan == "SP").values()) for plan in micro}
    ratio_to_formula = {plan: sum(c["bytes"] for c in calls) / wanted[plan] for plan, calls in micro.items()}
    counts = Counter(c["op"] for c in micro["SP"])
    sent = {plan: (moved_per_rank(calls), gloo_sent(calls)) for plan, calls in micro.items()}
    per_step = {row: (len(calls), gloo_sent(calls)) for row, calls in steps.items()}
    shards = ", ".join(f"{c['bytes']:,} B" for c in steps["ddp x tp"] if is_gradient_reduce(c))
    communication = (
        "- **tp's communication** (the tables above): per micro-batch, without sequence parallelism "
        f"{len(micro['no SP'])} all-reduces of {activation_size(facts):,} B, "
        f"{ratio_to_formula['no SP']:.3f} of Megatron's formula; with it (the default) {counts[ALL_GATHER]} "
        f"all-gathers of each rank's {activation_size(facts) // TP:,} B and {counts[REDUCE_SCATTER]} "
        f"reduce-scatters of {activation_size(facts):,} B, {ratio_to_formula['SP']:.3f} of the formula. A "
        f"ring sends {sent['no SP'][0]:,.0f} B per rank and micro-batch without it and {sent['SP'][0]:,.0f} "
        "with it (the same, plus the ways in and out of the split); gloo, which all-reduces the whole "
        f"tensor for a reduce-scatter, sends {sent['SP'][1]:,.0f}, {sent['SP'][1] / sent['no SP'][1]:.2f}x "
        f"plain TP's, in {len(micro['SP']) / len(micro['no SP']):.2f}x its collectives. Per step (the step "
        "table), through gloo: "
        + ", ".join(f"{row} {n} collectives, {b:,.0f} B sent per rank" for row, (n, b) in per_step.items())
        + f": tp (no SP) {per_step['tp (no SP)'][1] / per_step['ddp'][1]:.1f}x and tp "
        f"{per_step['tp'][1] / per_step['ddp'][1]:.1f}x ddp's bytes. Each TP collective sits on the critical "
        "path (the next layer needs its result), where DDP's buckets are reduced while backward runs. The "
        "bytes grow with micro-batch x block x width and the number of blocks, not with the parameters: "
        "tensor parallelism pays off where the matrices are large against the activations, over a fast "
        "link. ddp x tp: each TP group trains on half the batch, so half the activation collectives per "
        f"rank, plus one all-reduce of each rank's gradient values over its data-parallel group ({shards}: "
        "its `grads_bytes`)."
    )
    return [communication, tp_throughput_finding(measured, per_step)]


def tp_throughput_finding(measured: dict[str, Measured], per_step: dict[str, tuple[int, float]]) -> str:
    def against_ddp(row: str) -> str:
        extra = extra_ms(measured, row, "ddp")
        per_collective = extra / (per_step[row][0] - per_step["ddp"][0])
        return (
            f"{row} {speed(measured, row):.0f} samples/s ({ratio(measured, row, 'ddp'):.2f}x ddp, "
            f"{ratio(measured, row):.2f}x single; {extra:+.0f} ms a step against ddp"
            + (f", {per_collective:.1f} ms per extra collective if it were all theirs)" if extra > 0 else ")")
        )

    pairs = zip(measured["tp"].steady, measured["tp (no SP)"].steady, strict=True)
    return (
        "- **tp's throughput** after warm-up: "
        + ", ".join(against_ddp(row) for row in ("tp", "tp (no SP)"))
        + f"; ddp {step_ms(measured, 'ddp'):.0f} ms a step. With sequence parallelism tp runs at "
        f"{ranged([a / b for a, b in pairs], 2)}x its speed without (the rounds' ratios), with "
        f"{per_step['tp'][0] / per_step['tp (no SP)'][0]:.2f}x the collectives and "
        f"{per_step['tp'][1] / per_step['tp (no SP)'][1]:.2f}x gloo's bytes. Not broken down here: "
        "DTensor's dispatch of every op on a split layer is in these times too. Expected on this machine: 2 "
        "processes on 2 cores, gloo over loopback TCP, a tiny model; both ranks of a group also compute the "
        "parts left whole (embeddings, head, loss; without sequence parallelism the norms too) for the whole "
        "micro-batch, where ddp's ranks each take half the samples. What tp buys is memory (above), not "
        f"speed, on a model this size. ddp x tp {speed(measured, 'ddp x tp'):.0f} and fsdp x tp "
        f"{speed(measured, 'fsdp x tp'):.0f} samples/s ({ratio(measured, 'ddp x tp'):.2f}x and "
        f"{ratio(measured, 'fsdp x tp'):.2f}x single): {2 * TP} processes on {os.cpu_count()} cores, two to "
        "a core, so these say that 2D runs here, and what its bytes are, not what it costs."
    )


def rss_finding(measured: dict[str, Measured]) -> str:
    ddp = measured[DATA_PARALLEL]
    rss = {
        name: statistics.median(entry.values("peak_memory_bytes")) / MIB for name, entry in measured.items()
    }
    return (
        f"- **Peak RSS** is {min(rss.values()):.0f}-{max(rss.values()):.0f} MiB in every strategy: torch's "
        f"own footprint, next to a model state of {mib(sum(ddp.first(k) for k in BYTES))} MiB and "
        f"activations of {mib(ddp.first('activation_bytes'))} MiB. Against single: "
        + ", ".join(f"{name} {round(rss[name] - rss[REFERENCE]):+d} MiB" for name in rss if name != REFERENCE)
        + " (not broken down here: gloo and DDP's buckets; FSDP2's and DTensor's run-time state; the "
        "pipeline's tracing with torch.export and its schedule. Not imports: "
        "importing FSDP and torch.distributed.pipelining after `leantrain` adds no resident memory). On a "
        "model this small, sharding saves nothing visible in the process's memory; the byte counts above "
        "are the figures that scale with the model."
    )


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
    # Internal: the probes, started by torchrun.
    parser.add_argument("--fsdp-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-tp", type=int, default=TP, help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fsdp_probe or args.tp_probe:
        if args.probe_out is None:
            parser.error("a probe needs --probe-out")
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
    if args.tp_probe:
        tp_probe(args.probe_out, args.probe_tp)
        return 0
    started = time.perf_counter()
    context: dict[str, Any] = {"args": args, "load_before": load_now(), "commit_before": git_state()}
    with tempfile.TemporaryDirectory(prefix="leantrain-parallelism-bench-") as scratch:
        measured = measure(args.rounds, args.steps, Path(scratch))
        print("fsdp probe", file=sys.stderr, flush=True)
        probes = {"fsdp": run_probe(Path(scratch))}
        print("tp probes", file=sys.stderr, flush=True)
        probes["tp"] = run_tp_probes(Path(scratch))
        probes["val_check"] = validation_check(
            Path(measured[REFERENCE].first("out_dir")), measured["pipeline"].first("accumulation_steps")
        )
    context["minutes"] = (time.perf_counter() - started) / 60
    context["commit_after"] = git_state()
    table = render(measured, probes, context)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
