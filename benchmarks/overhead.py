"""Per-step overhead of ``leantrain.Trainer.fit`` against a hand-written PyTorch loop.

Every contender trains the same tiny MLP on the same CPU data (fp32, batch 32) and
stamps the clock (process CPU time by default, ``--clock wall`` for wall-clock time) right
after each optimizer step. A contender's step time is the median of the gaps between
consecutive stamps, warm-up steps dropped.
The model is so small that the framework's Python work per step is a visible share
of the step: this measures the engine, not the math.

Contenders run interleaved in one process, several rounds, the order rotating each
round, so that slow drift of a noisy machine (other load, frequency changes) hits all
of them alike. Only the side-by-side ratios are meant to be compared across machines.

    python benchmarks/overhead.py            # full run; writes benchmarks/results/overhead.md
    python benchmarks/overhead.py --quick    # smoke run; prints the table only

PyTorch Lightning and Hugging Face Accelerate are timed when importable
(``pip install -e ".[bench]"``) and listed as skipped otherwise.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import leantrain as lt
from _common import add_output_options, load_now, output_path, publish

SAMPLES, FEATURES, HIDDEN, CLASSES = 4096, 64, 256, 10
BATCH_SIZE = 32
LEARNING_RATE, MOMENTUM = 0.05, 0.9
DATA_SEED, INIT_SEED, ORDER_SEED = 1234, 0, 0
# leantrain's default: the training loss is read from the device (a host sync) and a
# metrics.csv row written every N steps. The hand-written loop does the same work: it keeps
# the detached loss and reads the mean every N steps, as a careful loop that logs would.
LOG_EVERY = lt.TrainConfig().log_every_n_steps
THREADS = 1
TARGET = 1.02  # leantrain's median step time / the hand-written loop's
BASELINE, LEANTRAIN, NOISE_FLOOR = "hand-written loop", "leantrain", "hand-written loop, again"
BATCHED = "hand-written loop, batched reads"

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overhead.md"

# The clocks a run can stamp with. Process CPU time is the default: on a shared machine another
# tenant's load stretches wall-clock gaps by up to 2x in one run (the noise floor's range), while
# the CPU time this process spends per step barely moves; the contenders are single-threaded
# (num_workers=0, one intra-op thread), so their CPU time is their step time on an idle machine.
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
now = CLOCKS["cpu"]

# A contender trains for ``steps`` optimizer steps and returns one ``now()`` stamp taken
# right after each step.
RunFn = Callable[[Dataset, int], list[float]]


# ---------------------------------------------------------------------------------------
# The shared work: data, model, optimizer, loss


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(DATA_SEED)
    features = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float32)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return TensorDataset(features, labels)


def make_model() -> nn.Module:
    # A forked RNG: every contender starts from identical weights, whatever the global
    # RNG state the previous contender (or leantrain's seeding) left behind.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        return nn.Sequential(
            nn.Linear(FEATURES, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, CLASSES),
        )


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=MOMENTUM)


def batch_loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    features, labels = batch
    return F.cross_entropy(model(features), labels)


def make_loader(dataset: Dataset) -> DataLoader:
    """Shuffled, whole batches only, loaded in the main process: what leantrain's sampler gives."""
    return DataLoader(
        dataset,
        batch_size=BATCH_SIZE,
        shuffle=True,
        drop_last=True,
        num_workers=0,
        generator=torch.Generator().manual_seed(ORDER_SEED),
    )


def endless(loader: DataLoader) -> Iterable[Any]:
    """Batches epoch after epoch, as a loop bounded by steps rather than epochs reads them."""
    while True:
        yield from loader


# ---------------------------------------------------------------------------------------
# Contenders


logged: list[float] = []  # where the hand-written loop's log lines go (kept, not printed)


def batched_reads(dataset: TensorDataset) -> Iterable[tuple[torch.Tensor, ...]]:
    """Shuffled whole batches, one indexed read per tensor: how leantrain reads a TensorDataset,
    written by hand (no DataLoader, no item tuples)."""
    generator = torch.Generator().manual_seed(ORDER_SEED)
    whole = len(dataset) // BATCH_SIZE * BATCH_SIZE
    while True:
        for rows in torch.randperm(len(dataset), generator=generator)[:whole].split(BATCH_SIZE):
            yield tuple(tensor[rows] for tensor in dataset.tensors)


def hand_loop(batches: Iterable[Any], steps: int) -> list[float]:
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    model.train()
    stamps: list[float] = []
    losses: list[torch.Tensor] = []
    for batch in batches:
        loss = batch_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if len(losses) == LOG_EVERY:
            logged.append(float(torch.stack(losses).mean()))  # the log point's host sync
            losses.clear()
        stamps.append(now())
        if len(stamps) == steps:
            break
    return stamps


def run_hand_written(dataset: Dataset, steps: int) -> list[float]:
    return hand_loop(endless(make_loader(dataset)), steps)


def run_hand_written_batched(dataset: TensorDataset, steps: int) -> list[float]:
    return hand_loop(batched_reads(dataset), steps)


class MLPTask:
    """The leantrain task: the same model, data, loss and optimizer as the other contenders."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def model(self) -> nn.Module:
        return make_model()

    def train_data(self) -> Dataset:
        return self.dataset

    def loss(self, model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return batch_loss(model, batch)

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return make_optimizer(params)


class StepClock:
    """leantrain callback: one stamp per optimizer step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step(self, stats: lt.StepStats) -> None:
        self.stamps.append(now())


def run_leantrain(dataset: Dataset, steps: int) -> list[float]:
    clock = StepClock()
    # The run folder (metrics.csv, summary.json, weights) goes to a scratch directory.
    with tempfile.TemporaryDirectory(prefix="leantrain-bench-") as scratch:
        config = lt.TrainConfig(
            global_batch_size=BATCH_SIZE,
            max_steps=steps,
            seed=ORDER_SEED,
            device="cpu",
            out_dir=str(Path(scratch) / "run"),
            log_every_n_steps=LOG_EVERY,
            progress="none",
            logger="none",
        )
        lt.Trainer(config, callbacks=[clock]).fit(MLPTask(dataset))
    return clock.stamps


def import_lightning() -> ModuleType | None:
    """``lightning.pytorch`` (the unified package) or the standalone ``pytorch_lightning``."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def run_lightning(dataset: Dataset, steps: int) -> list[float]:
    pl = import_lightning()
    assert pl is not None

    class MLPModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return batch_loss(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

    class LightningClock(pl.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        # Called after the optimizer step of the batch under automatic optimization.
        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self.stamps.append(now())

    clock = LightningClock()
    with tempfile.TemporaryDirectory(prefix="lightning-bench-") as scratch, warnings.catch_warnings():
        # "does not have many workers" and similar advice: num_workers=0 is deliberate.
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            max_epochs=-1,
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=scratch,
            callbacks=[clock],
        )
        trainer.fit(MLPModule(), train_dataloaders=make_loader(dataset))
    return clock.stamps


def run_accelerate(dataset: Dataset, steps: int) -> list[float]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(dataset))
    model.train()
    stamps: list[float] = []
    for batch in endless(loader):
        loss = batch_loss(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.append(now())
        if len(stamps) == steps:
            break
    accelerator.free_memory()
    return stamps


@dataclass
class Contender:
    name: str
    run: RunFn
    skipped: str | None = None  # why it is not timed
    medians: list[float] = field(default_factory=list)  # seconds per step, one per round
    means: list[float] = field(default_factory=list)


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def contenders() -> list[Contender]:
    hint = 'not installed (pip install -e ".[bench]")'
    lightning = import_lightning()
    return [
        Contender(BASELINE, run_hand_written),
        Contender(LEANTRAIN, run_leantrain),
        # leantrain reads a TensorDataset one indexed read per tensor, not item by item: beside a
        # hand loop that does the same, what remains is the engine's own cost per step.
        Contender(BATCHED, run_hand_written_batched),
        Contender("PyTorch Lightning", run_lightning, None if lightning else hint),
        Contender("HF Accelerate", run_accelerate, None if importable("accelerate") else hint),
        # The baseline once more (an A/A test): its ratio shows the noise floor of this
        # machine, against which the other ratios must be read.
        Contender(NOISE_FLOOR, run_hand_written),
    ]


# ---------------------------------------------------------------------------------------
# Measuring


def step_seconds(stamps: Sequence[float], warmup: int) -> list[float]:
    """Gaps between consecutive step-end stamps, the first ``warmup`` dropped."""
    gaps = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    return gaps[warmup:]


def measure(timed: list[Contender], dataset: Dataset, steps: int, rounds: int, warmup: int) -> None:
    # One short untimed run of each first: imports, lazy initialisation and the first
    # allocations of the process would otherwise land in round 1's first contender.
    for contender in timed:
        torch.set_num_threads(THREADS)
        contender.run(dataset, warmup + 2)
    for round_index in range(rounds):
        # Rotate the order: no contender is always first (cold caches) or last.
        shift = round_index % len(timed)
        for contender in timed[shift:] + timed[:shift]:
            # Every run starts from the same state: no garbage left by the previous one,
            # and one intra-op thread even if a framework changed it.
            gc.collect()
            torch.set_num_threads(THREADS)
            stamps = contender.run(dataset, steps)
            if len(stamps) != steps:
                raise RuntimeError(f"{contender.name} ran {len(stamps)} steps, expected {steps}")
            gaps = step_seconds(stamps, warmup)
            contender.medians.append(statistics.median(gaps))
            contender.means.append(statistics.fmean(gaps))
            print(
                f"round {round_index + 1}/{rounds}  {contender.name:<24} "
                f"median {contender.medians[-1] * 1e6:8.1f} us/step",
                file=sys.stderr,
                flush=True,
            )
    torch.set_num_threads(THREADS)


# ---------------------------------------------------------------------------------------
# Report


def versions() -> str:
    parts = [f"torch {torch.__version__}", f"leantrain {lt.__version__}"]
    pl = import_lightning()
    if pl is not None:
        parts.append(f"{pl.__name__.split('.')[0]} {pl.__version__}")
    if importable("accelerate"):
        parts.append(f"accelerate {importlib.import_module('accelerate').__version__}")
    return ", ".join(parts)


def paired_ratios(contender: Contender, baseline: Contender) -> list[float]:
    """Per round, the contender's median step time over the baseline's in the same round."""
    return [mine / base for mine, base in zip(contender.medians, baseline.medians, strict=True)]


CLOCK_WORDS = {
    "cpu": "`time.process_time()` (the process's CPU time: another tenant's load on the shared machine "
    "does not stretch it)",
    "wall": "`time.perf_counter()` (wall-clock time)",
}


def render(
    all_contenders: list[Contender], steps: int, rounds: int, warmup: int, load_before: str, clock: str
) -> str:
    by_name = {c.name: c for c in all_contenders}
    baseline, leantrain, floor = by_name[BASELINE], by_name[LEANTRAIN], by_name[NOISE_FLOOR]
    lines = [
        "# Per-step overhead: leantrain vs a hand-written PyTorch loop",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores visible, "
        f"Python {platform.python_version()}; load average before / after: {load_before} / {load_now()}",
        f"- Versions: {versions()}",
        f"- Threads: `torch.set_num_threads({THREADS})` for every contender (fairness and stability)",
        f"- Work: MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, fp32 on CPU; the same TensorDataset of "
        f"{SAMPLES} x {FEATURES} random float32 features and {CLASSES} classes for all; "
        f"SGD (lr {LEARNING_RATE}, momentum {MOMENTUM}); batch {BATCH_SIZE}, shuffled, "
        f"DataLoader with num_workers=0; {steps} optimizer steps per run; leantrain with its default "
        f'`log_every_n_steps={LOG_EVERY}`, `progress="none"`, `logger="none"`; the hand-written '
        f"loop keeps the detached loss and reads its mean every {LOG_EVERY} steps too (the same work)",
        f"- Method: each run stamps {CLOCK_WORDS[clock]} after every optimizer step; a run's step time "
        f"is the median gap between stamps, the first {warmup} dropped. {rounds} rounds, contenders "
        "interleaved in one process in a rotating order. *Median step*: the median over rounds. "
        "*vs hand-written*: the median over rounds of the ratio to the hand-written loop of the same "
        "round, its range over rounds in brackets. *Mean step*: the mean gap (median over rounds); it "
        "includes the periodic work that the median hides (epoch ends, leantrain's metrics read "
        f"and CSV row every {LOG_EVERY} steps).",
        f"- The machine is shared and noisy: compare the ratios, not the absolute times. "
        f'"{NOISE_FLOOR}" runs the baseline a second time: its ratio is the noise floor.',
        "",
        "| Contender | Median step (µs) | vs hand-written | Mean step (µs) | Mean vs hand-written |",
        "|---|---:|---:|---:|---:|",
    ]
    for contender in all_contenders:
        if contender.skipped:
            lines.append(f"| {contender.name} | skipped: {contender.skipped} | | | |")
            continue
        ratios = paired_ratios(contender, baseline)
        mean_ratios = [mine / base for mine, base in zip(contender.means, baseline.means, strict=True)]
        lines.append(
            f"| {contender.name} | {statistics.median(contender.medians) * 1e6:.1f} "
            f"| {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
            f"| {statistics.median(contender.means) * 1e6:.1f} | {statistics.median(mean_ratios):.3f} |"
        )
    ratio = statistics.median(paired_ratios(leantrain, baseline))
    noise = statistics.median(paired_ratios(floor, baseline))
    engine = statistics.median(paired_ratios(leantrain, by_name[BATCHED]))
    verdict = "met" if ratio <= TARGET else "NOT met"
    lines += [
        "",
        f"Target: leantrain / hand-written <= {TARGET} (median step): {verdict}, {ratio:.3f} "
        f"(noise floor {noise:.3f}).",
        "",
        f"The engine's own cost, the data path being equal: leantrain / {BATCHED} = {engine:.3f} "
        "(median of the per-round ratios).",
    ]
    return "\n".join(lines) + "\n"


def quiet_frameworks() -> None:
    """Silence the frameworks' start-up banners so that the progress lines stay readable."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=512, help="optimizer steps per run (default 512)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of all contenders (default 9)")
    parser.add_argument("--warmup", type=int, default=20, help="first step gaps dropped (default 20)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="what a step stamp reads: the process's CPU time (default; steady on a shared machine) "
        "or wall-clock time",
    )
    add_output_options(parser, "smoke run: 100 steps, 2 rounds; writes only with --out", DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup = 100, 2, 10
    args.out = output_path(args, DEFAULT_OUT)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps must exceed --warmup + 1 ({args.warmup + 1})")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    global now
    now = CLOCKS[args.clock]
    torch.set_num_threads(THREADS)
    load_before = load_now()
    dataset = make_dataset()
    all_contenders = contenders()
    # After contenders(): importing Lightning resets its loggers to INFO.
    quiet_frameworks()
    timed = [c for c in all_contenders if not c.skipped]
    measure(timed, dataset, args.steps, args.rounds, args.warmup)
    table = render(all_contenders, args.steps, args.rounds, args.warmup, load_before, args.clock)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
