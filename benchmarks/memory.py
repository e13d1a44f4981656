"""Peak process memory of one training job: leantrain against a hand-written PyTorch loop.

The same job (model, data in the same order, optimizer, micro-batch 4 x accumulation 4, fp32,
one thread, 60 optimizer steps) is trained by a hand-written loop (which keeps each
micro-batch's detached loss in a list and reads the mean every 50 steps, the logging work
leantrain does by default), by the same loop summing the losses in place into one device
scalar instead, by leantrain with its defaults (and once more with ``log_every_n_steps=1``, a
diagnostic that is not the default), by PyTorch Lightning and by Hugging Face Accelerate, each
in a fresh process: ``memory.py --probe ENGINE --job JOB`` prints one JSON line with the
process's peak resident set (``VmHWM``), its RSS before training and after every optimizer
step, and the sha256 of the final weights (which are also compared with the hand loop's). A
"build only" process (imports, data and model, no training) is the floor that every contender
pays anyway. Two jobs: ``gpt2`` (a 4-layer ``transformers`` GPT-2 on token sequences drawn
from a seeded generator) and ``charlm`` (leantrain's own example task).

The runs go one at a time (memory is measured, but a quiet machine keeps the runs alike), in
rounds whose order alternates (A..Z, then Z..A): the tables give the median and range over
rounds, the ratio to the hand-written loop of the same round, and the RSS after every fifth
step of one run per contender. ``--device cuda`` adds ``torch.cuda``'s peak allocated and
reserved bytes.

    python benchmarks/memory.py            # full run (3 rounds, 10-12 min); writes results/memory.md
    python benchmarks/memory.py --quick    # smoke run (1 round of 12 steps, about 2 min); prints only
    python benchmarks/memory.py --rounds 5 --jobs gpt2 --out /tmp/memory.md

PyTorch Lightning, Hugging Face Accelerate and ``transformers`` (the gpt2 job) are measured when
importable (``pip install -e ".[bench]"``) and listed as skipped otherwise. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# Standard library only at the top: a probe process imports what its contender needs and
# nothing more (the parent process, which measures nothing, never imports torch until the
# weights are compared at the end).
from _common import (
    add_output_options,
    cpu_model,
    current_rss_kib,
    load_now,
    output_path,
    peak_rss_kib,
    publish,
    run_probe_script,
)

STEPS = 60
MICRO_BATCH, ACCUMULATION = 4, 4
GLOBAL_BATCH = MICRO_BATCH * ACCUMULATION
THREADS = 1
SEED = 0  # the weights' initialisation and leantrain's seed
# The hand-written loop keeps each micro-batch's detached loss in a list and reads the mean every
# LOG_EVERY steps (and at the last): leantrain's default log_every_n_steps, the same work. The
# running-sum loop and Accelerate add each loss in place into one device scalar instead, read as
# often: the same host syncs, without a small tensor kept alive per micro-batch.
LOG_EVERY = 50
# gpt2: GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=64))
GPT2_LAYERS, GPT2_WIDTH, GPT2_HEADS, GPT2_VOCAB, SEQUENCE = 4, 128, 4, 1024, 64
GPT2_SEQUENCES = 1024  # more than the 60 x 16 sequences of a run: one pass, in order
GPT2_LR = 1e-3
TARGET_MEDIAN, TARGET_MAX = 1.01, 1.03  # leantrain (defaults) / hand-written loop, peak RSS
ROUNDS = 3  # 10-12 minutes on two cores

JOBS = ("gpt2", "charlm")
BUILD, HAND, HAND_SUM, LEANTRAIN = "build", "hand", "hand-sum", "leantrain"
# Probe names -> table labels, in the order of the first round.
ENGINES = {
    BUILD: "build only",
    HAND: "hand-written loop",
    HAND_SUM: "hand-written loop, running loss sum",
    LEANTRAIN: "leantrain (defaults)",
    "leantrain-log1": "leantrain, log_every_n_steps=1 (not the default)",
    "lightning": "PyTorch Lightning",
    "accelerate": "HF Accelerate",
    # Not run unless named in --engines: the cost of the TensorBoard writer.
    "leantrain-no-tb": 'leantrain, logger="none" (not the default)',
}
SHORT = {
    BUILD: "build",
    HAND: "hand",
    HAND_SUM: "hand sum",
    LEANTRAIN: "leantrain",
    "leantrain-log1": "lt log=1",
    "lightning": "Lightning",
    "accelerate": "Accelerate",
    "leantrain-no-tb": "lt no tb",
}
DEFAULT_ENGINES = (BUILD, HAND, HAND_SUM, LEANTRAIN, "leantrain-log1", "lightning", "accelerate")
HINT = 'not installed (pip install -e ".[bench]")'

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "memory.md"


# ---------------------------------------------------------------------------------------
# The jobs (built inside a probe process: these functions import torch)


class Job:
    """Model, data, loss and optimizer of one job, built the same way for every contender.

    ``loss`` is a mean over the micro-batch (what a loop divides by the accumulation steps);
    ``task_loss`` is what leantrain's task returns (charlm: the example's own ``LossSum``).
    """

    def __init__(
        self,
        name: str,
        dataset: Any,
        model: Callable[[], Any],
        loss: Callable[[Any, Any], Any],
        optimizer: Callable[[Iterable[Any]], Any],
        task_loss: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        self.name, self.dataset = name, dataset
        self._model, self.loss, self.optimizer = model, loss, optimizer
        self.task_loss = task_loss or loss

    def model(self) -> Any:
        import torch

        # A forked RNG: every contender starts from identical weights, whatever leantrain's or
        # Lightning's seeding did to the global RNG before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return self._model()


def gpt2_job() -> Job:
    import torch
    import transformers
    from torch.utils.data import TensorDataset

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=GPT2_LAYERS,
        n_embd=GPT2_WIDTH,
        n_head=GPT2_HEADS,
        vocab_size=GPT2_VOCAB,
        n_positions=SEQUENCE,
        # No dropout: no random numbers drawn in training, so the contenders can train the same weights.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=GPT2_VOCAB - 1,
        eos_token_id=GPT2_VOCAB - 1,
    )
    tokens = torch.randint(
        0, GPT2_VOCAB, (GPT2_SEQUENCES, SEQUENCE), generator=torch.Generator().manual_seed(SEED)
    )

    def loss(model: Any, batch: Any) -> Any:
        (ids,) = batch
        return model(input_ids=ids, labels=ids).loss  # next-token cross entropy, mean over tokens

    return Job(
        "gpt2",
        TensorDataset(tokens),
        lambda: transformers.GPT2LMHeadModel(config),
        loss,
        lambda params: torch.optim.AdamW(params, lr=GPT2_LR),
    )


def charlm_job() -> Job:
    # What `leantrain fit --example charlm` builds (load_example -> CharLMTask()), validation left
    # out: the loops train only. Importing the example imports the leantrain package too, so on
    # this job every contender, the build-only process included, pays leantrain's imports.
    from leantrain.examples.charlm import CharLMTask

    task = CharLMTask()

    def loss(model: Any, batch: Any) -> Any:
        summed = task.loss(model, batch)
        return summed.sum / summed.count

    return Job("charlm", task.train_data(), task.model, loss, task.optimizer, task_loss=task.loss)


def make_job(name: str) -> Job:
    return {"gpt2": gpt2_job, "charlm": charlm_job}[name]()


# ---------------------------------------------------------------------------------------
# The contenders (each runs in its own probe process)


class Trace:
    """RSS (``/proc/self/statm``) and peak RSS (``VmHWM``) after every optimizer step."""

    def __init__(self) -> None:
        self.rss: list[int] = []
        self.hwm: list[int] = []
        self.stamps: list[float] = []

    def record(self) -> None:
        self.rss.append(current_rss_kib())
        self.hwm.append(peak_rss_kib())
        self.stamps.append(time.perf_counter())

    def step_ms(self) -> float | None:
        """The median time between consecutive steps (a side figure: memory is what is measured)."""
        gaps = [later - earlier for earlier, later in itertools.pairwise(self.stamps)]
        return 1000 * statistics.median(gaps) if gaps else None

    def on_step(self, stats: Any) -> None:  # leantrain's callback
        self.record()


def make_loader(job: Job) -> Any:
    """In order, whole micro-batches, loaded in the main process."""
    from torch.utils.data import DataLoader

    return DataLoader(job.dataset, batch_size=MICRO_BATCH, shuffle=False, drop_last=True, num_workers=0)


def endless(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        yield from loader


def to_device(batch: Any, device: str) -> Any:
    return [tensor.to(device) for tensor in batch]


class LossLog:
    """The loops' loss logging: each micro-batch's loss added, the mean read every LOG_EVERY steps.

    ``running_sum=False`` keeps every detached loss in a list until the read (what leantrain's
    tracker does); ``True`` adds them in place into one device scalar (no tensor kept per loss).
    """

    def __init__(self, device: str, running_sum: bool) -> None:
        import torch

        self.losses: list[Any] = []
        self.total = torch.zeros((), device=device) if running_sum else None
        self.count = 0
        self.logged: list[float] = []

    def add(self, loss: Any) -> None:
        if self.total is None:
            self.losses.append(loss.detach())
        else:
            self.total += loss.detach()
            self.count += 1

    def read(self) -> None:
        import torch

        if self.total is None:
            self.logged.append(float(torch.stack(self.losses).mean()))  # the log point's host sync
            self.losses.clear()
        else:
            self.logged.append(float(self.total) / self.count)
            self.total.zero_()
            self.count = 0


def run_hand(job: Job, steps: int, device: str, trace: Trace, running_sum: bool = False) -> Any:
    model = job.model().to(device)
    optimizer = job.optimizer(model.parameters())
    model.train()
    batches = endless(make_loader(job))
    log = LossLog(device, running_sum)
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(ACCUMULATION):
            loss = job.loss(model, to_device(next(batches), device))
            (loss / ACCUMULATION).backward()
            log.add(loss)
        optimizer.step()
        trace.record()
        if step % LOG_EVERY == 0 or step == steps:
            log.read()
    return model


def run_leantrain(job: Job, steps: int, device: str, trace: Trace, **settings: Any) -> Any:
    import leantrain as lt

    class JobTask(lt.Task):
        """The job as a leantrain task; no ``val_data``: the other contenders do not validate."""

        def model(self) -> Any:
            return job.model()

        def train_data(self) -> Any:
            return job.dataset

        def loss(self, model: Any, batch: Any) -> Any:
            return job.task_loss(model, batch)

        def optimizer(self, params: Iterable[Any]) -> Any:
            return job.optimizer(params)

    with tempfile.TemporaryDirectory(prefix="leantrain-memory-") as scratch:
        config = lt.TrainConfig(
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=MICRO_BATCH,
            max_steps=steps,
            shuffle=False,
            seed=SEED,
            out_dir=str(Path(scratch) / "run"),
            progress="none",
            device=device,
            **settings,
        )
        result = lt.Trainer(config, callbacks=[trace]).fit(JobTask())
    return result.model


def import_lightning() -> Any:
    """``lightning.pytorch`` (the unified package) or the standalone ``pytorch_lightning``."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("neither lightning nor pytorch_lightning is installed")


def run_lightning(job: Job, steps: int, device: str, trace: Trace) -> Any:
    import logging
    import warnings

    import torch

    pl = import_lightning()
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class JobModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = job.model()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return job.loss(self.net, batch)  # Lightning divides by accumulate_grad_batches

        def configure_optimizers(self) -> Any:
            return job.optimizer(self.parameters())

    class StepTrace(pl.Callback):
        # Called after every micro-batch; global_step counts the optimizer steps.
        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if trainer.global_step > len(trace.rss):
                trace.record()

    module = JobModule()
    with tempfile.TemporaryDirectory(prefix="lightning-memory-") as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "does not have many workers": num_workers=0 is deliberate
        trainer = pl.Trainer(
            accelerator="gpu" if device.startswith("cuda") else "cpu",
            devices=1,
            max_steps=steps,
            max_epochs=-1,
            accumulate_grad_batches=ACCUMULATION,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=scratch,
            callbacks=[StepTrace()],
        )
        torch.set_num_threads(THREADS)
        trainer.fit(module, train_dataloaders=make_loader(job))
    return module.net


def run_accelerate(job: Job, steps: int, device: str, trace: Trace) -> Any:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not device.startswith("cuda"), gradient_accumulation_steps=ACCUMULATION)
    torch.set_num_threads(THREADS)
    model = job.model()
    optimizer = job.optimizer(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(job))
    model.train()
    log = LossLog(device, running_sum=True)
    step = 0
    for batch in endless(loader):
        with accelerator.accumulate(model):
            loss = job.loss(model, batch)
            accelerator.backward(loss)  # divides by gradient_accumulation_steps
            optimizer.step()  # a no-op until the last micro-batch of the step
            optimizer.zero_grad(set_to_none=True)
        log.add(loss)
        if accelerator.sync_gradients:
            step += 1
            trace.record()
            if step % LOG_EVERY == 0 or step == steps:
                log.read()
            if step == steps:
                break
    return accelerator.unwrap_model(model)


def state_sha(state: dict[str, Any]) -> str:
    """sha256 of the names and bytes of a state dict's tensors, in name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def probe(engine: str, job_name: str, steps: int, device: str, weights_out: Path | None) -> dict[str, Any]:
    """The probe process: import, build, train ``steps`` steps; the figures of the run."""
    import torch

    torch.set_num_threads(THREADS)
    if engine.startswith(LEANTRAIN):
        import leantrain  # noqa: F401  (its import cost lands in "before", as a user's run pays it)
    elif engine == "lightning":
        import_lightning()
    elif engine == "accelerate":
        import accelerate  # noqa: F401
    job = make_job(job_name)
    before = current_rss_kib()
    trace = Trace()
    started = time.perf_counter()
    settings: dict[str, Any] = {}
    if engine == BUILD:
        model = job.model().to(device)
    elif engine == HAND:
        model = run_hand(job, steps, device, trace)
    elif engine == HAND_SUM:
        model = run_hand(job, steps, device, trace, running_sum=True)
    elif engine.startswith(LEANTRAIN):
        import leantrain as lt

        settings = {
            "leantrain": {},
            "leantrain-log1": {"log_every_n_steps": 1},
            "leantrain-no-tb": {"logger": "none"},
        }[engine]
        model = run_leantrain(job, steps, device, trace, **settings)
        settings.setdefault("log_every_n_steps", lt.TrainConfig().log_every_n_steps)
    elif engine == "lightning":
        model = run_lightning(job, steps, device, trace)
    elif engine == "accelerate":
        model = run_accelerate(job, steps, device, trace)
    else:
        raise ValueError(f"unknown engine {engine!r}")
    seconds = time.perf_counter() - started
    peak = peak_rss_kib()  # before the checksum and the weights file, which are no part of the run
    figures: dict[str, Any] = {
        "engine": engine,
        "job": job_name,
        "steps": len(trace.rss),
        "before_kib": before,
        "peak_kib": peak,
        "end_kib": current_rss_kib(),
        "step_rss_kib": trace.rss,
        "step_hwm_kib": trace.hwm,
        "seconds": seconds,
        "step_ms": trace.step_ms(),
        "threads": torch.get_num_threads(),
        "log_every": settings.get("log_every_n_steps"),
    }
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        figures["cuda_allocated"] = torch.cuda.max_memory_allocated()
        figures["cuda_reserved"] = torch.cuda.max_memory_reserved()
    if engine != BUILD:
        if steps and len(trace.rss) != steps:
            raise RuntimeError(f"{engine} recorded {len(trace.rss)} steps, expected {steps}")
        state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
        figures["sha256"] = state_sha(state)
        if weights_out is not None:
            torch.save(state, weights_out)
    return figures


# ---------------------------------------------------------------------------------------
# Measuring: one fresh process per run, one at a time, in alternating rounds


@dataclass
class Entry:
    job: str
    engine: str
    skipped: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)  # one per round, in round order
    weight_diffs: list[float] = field(default_factory=list)  # max |w - w_hand| per round
    same_sha: list[bool] = field(default_factory=list)

    @property
    def label(self) -> str:
        return ENGINES[self.engine]

    def mib(self, key: str) -> list[float]:
        return [run[key] / 1024 for run in self.runs]


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def skip_reason(job: str, engine: str) -> str | None:
    if job == "gpt2" and not importable("transformers"):
        return f"transformers {HINT}"
    if engine == "lightning" and not (importable("lightning") or importable("pytorch_lightning")):
        return HINT
    if engine == "accelerate" and not importable("accelerate"):
        return HINT
    return None


def measure(args: argparse.Namespace, scratch: Path) -> list[Entry]:
    entries = [Entry(job, engine, skip_reason(job, engine)) for job in args.jobs for engine in args.engines]
    script = Path(__file__).resolve()
    for job in args.jobs:
        measured = [entry for entry in entries if entry.job == job and not entry.skipped]
        for round_index in range(args.rounds):
            order = measured if round_index % 2 == 0 else measured[::-1]
            for entry in order:
                stem = scratch / f"{job}-{entry.engine}-{round_index}"
                arguments = [
                    "--probe", entry.engine, "--job", job, "--steps", str(args.steps),
                    "--device", args.device, "--probe-out", f"{stem}.json",
                ]  # fmt: skip
                if entry.engine != BUILD:
                    arguments += ["--weights-out", f"{stem}.pt"]
                started = time.perf_counter()
                figures = run_probe_script(script, arguments, Path(f"{stem}.json"))
                figures["weights"] = f"{stem}.pt" if entry.engine != BUILD else None
                figures["wall"] = time.perf_counter() - started
                entry.runs.append(figures)
                print(
                    f"{job} round {round_index + 1}/{args.rounds}  {entry.label:<50} "
                    f"peak {figures['peak_kib'] / 1024:7.1f} MiB  ({figures['wall']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    compare_weights(entries)
    return entries


def compare_weights(entries: list[Entry]) -> None:
    """Each run's final weights against the hand-written loop's of the same round."""
    import torch

    for entry in entries:
        hand = next((e for e in entries if e.job == entry.job and e.engine == HAND and not e.skipped), None)
        if (
            entry.engine in (BUILD, HAND)
            or entry.skipped
            or hand is None
            or len(hand.runs) != len(entry.runs)
        ):
            continue
        for run, base in zip(entry.runs, hand.runs, strict=True):
            mine, theirs = torch.load(run["weights"]), torch.load(base["weights"])
            if mine.keys() != theirs.keys():
                entry.weight_diffs.append(float("nan"))
            else:
                entry.weight_diffs.append(max((mine[k] - theirs[k]).abs().max().item() for k in mine))
            entry.same_sha.append(run["sha256"] == base["sha256"])


# ---------------------------------------------------------------------------------------
# Report


def git_state() -> str:
    def git(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("diff", "--quiet", "--", "src").returncode
    return f"{head}, src/ {'with uncommitted changes' if dirty else 'clean'}"


def versions() -> str:
    parts = []
    for name in ("torch", "leantrain", "transformers", "lightning", "pytorch_lightning", "accelerate"):
        try:
            parts.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(parts)


def leantrain_origin() -> str:
    """Where the probes import leantrain from (``PYTHONPATH`` can point them at another checkout)."""
    spec = importlib.util.find_spec("leantrain")
    if spec is None or spec.origin is None:
        return "not installed"
    path = Path(spec.origin).parent
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def memory_total() -> str:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB RAM"
    except OSError:
        pass
    return "RAM unknown"


def fmt(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def signed(value: float, digits: int = 1) -> str:
    return f"{value:+,.{digits}f}"


def trace_steps(steps: int) -> list[int]:
    marks = [1, *range(5, steps + 1, 5)]
    if marks[-1] != steps:
        marks.append(steps)
    return sorted(set(marks))


def representative(entry: Entry) -> dict[str, Any]:
    """The run whose peak is nearest the median peak of its contender."""
    middle = statistics.median(run["peak_kib"] for run in entry.runs)
    return min(entry.runs, key=lambda run: abs(run["peak_kib"] - middle))


def peak_reached(run: dict[str, Any]) -> str:
    """When the run's peak was reached: the first step whose high-water mark is the final one."""
    hwm = run["step_hwm_kib"]
    if not hwm or run["peak_kib"] > hwm[-1]:
        return f"after the last step ({signed((run['peak_kib'] - hwm[-1]) / 1024)})" if hwm else "-"
    return f"step {next(i for i, value in enumerate(hwm, 1) if value == hwm[-1])}"


def paired_ratio(entry: Entry, reference: Entry | None) -> str:
    """The median over rounds of the entry's peak over the reference's of the same round, and the range."""
    if reference is None or len(reference.runs) != len(entry.runs):
        return "n/a"
    ratios = [
        mine / base for mine, base in zip(entry.mib("peak_kib"), reference.mib("peak_kib"), strict=True)
    ]
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f} to {max(ratios):.3f}]"


def target_line(default: Entry, reference: Entry, what: str) -> str:
    """Whether leantrain's median peak is within 1 % of the reference's median and its max within 3 %."""
    peaks, base = default.mib("peak_kib"), statistics.median(reference.mib("peak_kib"))
    median_ratio, max_ratio = statistics.median(peaks) / base, max(peaks) / base
    met = median_ratio <= TARGET_MEDIAN and max_ratio <= TARGET_MAX
    return (
        f"{what}: leantrain (defaults) median peak within {100 * (TARGET_MEDIAN - 1):.0f} % of the "
        f"{reference.label}'s median ({fmt(base)} MiB), its max within {100 * (TARGET_MAX - 1):.0f} % of "
        f"it: {'met' if met else 'NOT met'}: median {fmt(statistics.median(peaks))} MiB "
        f"({signed(100 * (median_ratio - 1), 2)} %), max {fmt(max(peaks))} MiB "
        f"({signed(100 * (max_ratio - 1), 2)} %)."
    )


def render_job(job: str, entries: list[Entry], steps: int) -> list[str]:
    mine = [entry for entry in entries if entry.job == job]
    done = [entry for entry in mine if not entry.skipped and entry.runs]
    by_engine = {entry.engine: entry for entry in done}
    lines = [f"## Job `{job}`", ""]
    if not done:
        return [*lines, *(f"- {entry.label}: skipped, {entry.skipped}" for entry in mine), ""]
    hand, build, hand_sum = by_engine.get(HAND), by_engine.get(BUILD), by_engine.get(HAND_SUM)
    hand_median = statistics.median(hand.mib("peak_kib")) if hand else None
    build_median = statistics.median(build.mib("peak_kib")) if build else None
    lines += [
        "| Contender | Peak MiB median | min | max | Over build only (MiB) | Over hand loop (MiB) "
        "| Over hand loop (%) | Ratio to hand loop [range] | Ratio to running-sum loop [range] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in mine:
        if entry.skipped or not entry.runs:
            lines.append(f"| {entry.label} | skipped: {entry.skipped} | | | | | | | |")
            continue
        peaks = entry.mib("peak_kib")
        median = statistics.median(peaks)
        over_build = signed(median - build_median) if build_median is not None else "n/a"
        if hand is not None and hand_median is not None:
            over_hand = signed(median - hand_median)
            over_pct = signed(100 * (median / hand_median - 1))
        else:
            over_hand = over_pct = "n/a"
        lines.append(
            f"| {entry.label} | {fmt(median)} | {fmt(min(peaks))} | {fmt(max(peaks))} | {over_build} "
            f"| {over_hand} | {over_pct} | {paired_ratio(entry, hand)} | {paired_ratio(entry, hand_sum)} |"
        )
    lines.append("")
    default = by_engine.get(LEANTRAIN)
    for reference, what in ((hand, "Target"), (hand_sum, "The same against the running-sum loop")):
        if default is not None and reference is not None:
            lines += [target_line(default, reference, what), ""]
    cuda = any("cuda_allocated" in run for entry in done for run in entry.runs)
    lines += [
        "Details (medians over rounds, MiB). *Before*: RSS after the imports and the data, before the "
        "model. *Peak by last step*: `VmHWM` read right after the last optimizer step. *End of run*: "
        "what the peak rose after that (leantrain: its last log point, final checkpoint, "
        "`model.safetensors`, `summary.json`). *Step 1 -> last*: RSS after the last step minus after "
        "step 1. *Step*: the median time between steps (a side figure, on a shared machine). "
        "*Weights*: the final weights against the hand loop's of the same round "
        "(bit-identical in how many rounds, and the largest absolute difference).",
        "",
        "| Contender | Before | Peak by last step | End of run | Step 1 -> last | Step (ms) "
        f"| Weights vs hand loop |{' CUDA max allocated / reserved |' if cuda else ''}",
        f"|---|---:|---:|---:|---:|---:|---|{'---:|' if cuda else ''}",
    ]
    for entry in done:
        before = statistics.median(entry.mib("before_kib"))
        if entry.engine == BUILD:
            by_last = end = climb = step_ms = weights = "-"
        else:
            by_last_values = [run["step_hwm_kib"][-1] / 1024 for run in entry.runs]
            by_last = fmt(statistics.median(by_last_values))
            end = signed(
                statistics.median((run["peak_kib"] - run["step_hwm_kib"][-1]) / 1024 for run in entry.runs)
            )
            step_ms = f"{statistics.median(run['step_ms'] for run in entry.runs):.0f}"
            climb = signed(
                statistics.median(
                    (run["step_rss_kib"][-1] - run["step_rss_kib"][0]) / 1024 for run in entry.runs
                )
            )
            if entry.engine == HAND:
                same = len({run["sha256"] for run in entry.runs}) == 1
                weights = "reference" + ("" if same else " (differs between rounds)")
            elif entry.weight_diffs:
                identical = sum(entry.same_sha)
                weights = (
                    f"identical {identical}/{len(entry.same_sha)}, max diff {max(entry.weight_diffs):.2g}"
                )
            else:
                weights = "n/a"
        row = f"| {entry.label} | {fmt(before)} | {by_last} | {end} | {climb} | {step_ms} | {weights} |"
        if cuda:
            allocated = statistics.median(run.get("cuda_allocated", 0) for run in entry.runs) / 2**20
            reserved = statistics.median(run.get("cuda_reserved", 0) for run in entry.runs) / 2**20
            row += f" {fmt(allocated)} / {fmt(reserved)} |"
        lines.append(row)
    lines.append("")
    return lines


def render_trace(job: str, entries: list[Entry], steps: int) -> list[str]:
    traced = [e for e in entries if e.job == job and e.engine != BUILD and not e.skipped and e.runs]
    if not traced:
        return []
    runs = [representative(entry) for entry in traced]
    lines = [
        f"## RSS after each optimizer step (`{job}`, MiB)",
        "",
        "One representative run per contender (the run whose peak is nearest its median): the RSS "
        "(`/proc/self/statm`) read right after the optimizer step (leantrain `on_step`, Lightning "
        "`on_train_batch_end` at each new `global_step`, in the loops after `optimizer.step()`), "
        f"before the step's log point. The loops and leantrain read their losses every {LOG_EVERY} "
        "steps (*lt log=1* every step). *peak reached*: the first step whose `VmHWM` is the run's "
        "highest before its end, or after the last step (by how much it rose then).",
        "",
        "| Step | " + " | ".join(SHORT[entry.engine] for entry in traced) + " |",
        "|---:|" + "---:|" * len(traced),
    ]
    for step in trace_steps(steps):
        cells = [fmt(run["step_rss_kib"][step - 1] / 1024) for run in runs]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if steps >= LOG_EVERY:
        cells = [signed((run["step_rss_kib"][LOG_EVERY - 1] - run["step_rss_kib"][0]) / 1024) for run in runs]
        lines.append(f"| {LOG_EVERY} - 1 | " + " | ".join(cells) + " |")
    lines.append("| peak | " + " | ".join(fmt(run["peak_kib"] / 1024) for run in runs) + " |")
    lines.append("| peak reached | " + " | ".join(peak_reached(run) for run in runs) + " |")
    return [*lines, ""]


def render(entries: list[Entry], args: argparse.Namespace, header: dict[str, str]) -> str:
    skipped = [e for e in entries if e.skipped]
    lines = [
        "# Peak process memory of one training job: leantrain against a hand-written loop",
        "",
        f"- Date: {header['date']}; {platform.system()} {platform.machine()}, {cpu_model()}, "
        f"{os.cpu_count()} CPU cores visible, {memory_total()}, Python {platform.python_version()}; "
        f"load average before / after: {header['load_before']} / {load_now()}; "
        f"the full run took {header['minutes']} min",
        f"- Code measured: commit {header['git_before']} at the start, {header['git_after']} at the end; "
        f"leantrain imported from `{leantrain_origin()}`",
        f"- Versions: {versions()}",
        f"- Command: `{' '.join(['python benchmarks/memory.py', *header['argv']])}`; device `{args.device}`",
        f"- Jobs, each trained for {args.steps} optimizer steps of global batch {GLOBAL_BATCH} "
        f"(micro-batch {MICRO_BATCH} x {ACCUMULATION} accumulation), fp32, data in order (no shuffle), "
        f"`num_workers=0`, `torch.set_num_threads({THREADS})`, weights initialised under "
        f"`torch.manual_seed({SEED})`:",
        f"  - `gpt2`: `transformers.GPT2LMHeadModel(GPT2Config(n_layer={GPT2_LAYERS}, n_embd={GPT2_WIDTH}, "
        f"n_head={GPT2_HEADS}, vocab_size={GPT2_VOCAB}, n_positions={SEQUENCE}))`, dropout 0; "
        f"{GPT2_SEQUENCES} sequences of {SEQUENCE} tokens from `torch.randint` "
        f"(`torch.Generator().manual_seed({SEED})`); loss `model(input_ids=x, labels=x).loss` "
        f"(next-token cross entropy); AdamW (lr {GPT2_LR})",
        "  - `charlm`: leantrain's example as `leantrain fit --example charlm` builds it (`CharLMTask()`: "
        "4 blocks, width 128, 64 characters of Python's pydoc topics per sample), without its "
        "validation; its model, training data, AdamW (lr 3e-3, weight decay 0.01) and loss (leantrain: "
        "the task's `LossSum`; the others: its sum / count, the mean per token)",
        f"- Contenders: *build only*: the imports, the data and the model, no training (what every "
        "contender pays anyway). *hand-written loop*: `zero_grad`, then per micro-batch "
        f"`(loss / {ACCUMULATION}).backward()` keeping `loss.detach()` in a list, `optimizer.step()`; the "
        f"mean of the list read every {LOG_EVERY} steps and at the last (the logging work leantrain does "
        "by default). *hand-written loop, running loss sum*: the same, each loss added in place into "
        "one device scalar instead of kept in a list (the same host syncs, no tensor kept alive per "
        "micro-batch). *leantrain (defaults)*: a `leantrain.Task` subclass, "
        f"`Trainer(TrainConfig(global_batch_size={GLOBAL_BATCH}, micro_batch_size={MICRO_BATCH}, "
        f'max_steps={args.steps}, shuffle=False, seed={SEED}, out_dir=<temp dir>, progress="none"))'
        ".fit(task)`, everything else at its default (TensorBoard on, `log_every_n_steps` "
        f"{LOG_EVERY}, the final checkpoint, `model.safetensors` and `summary.json`). *leantrain, "
        "log_every_n_steps=1*: the same with one log point per step (a diagnostic, not the default). "
        f"*PyTorch Lightning*: a `LightningModule`, `Trainer(accumulate_grad_batches={ACCUMULATION}, "
        f"max_steps={args.steps}, logger=False, enable_checkpointing=False, enable_progress_bar=False, "
        'accelerator="cpu", devices=1)`. *HF Accelerate*: `Accelerator(gradient_accumulation_steps='
        f"{ACCUMULATION})`, `accelerator.accumulate(model)`, `accelerator.backward(loss)`, and the "
        "running-sum loop's logging.",
        f"- Method: every run is a fresh process, `python benchmarks/memory.py --probe ENGINE --job JOB`, "
        "that imports only what its contender needs, builds the job, trains, and prints one JSON line: "
        "the peak resident set of the whole process (`VmHWM` of `/proc/self/status`, imports "
        "included, read when the training call returns), the RSS before the model is built, the RSS and "
        "`VmHWM` after every optimizer step, and the sha256 of the final state dict (the weights are "
        "saved too, and compared with the hand loop's of the same round). One run at a time; "
        f"{args.rounds} round(s), the contenders in the order of the table in odd rounds and reversed in "
        "even ones. *Peak*: median, min and max over rounds. *Over build only* and *Over hand loop*: "
        "median minus the other's median. *Ratio to hand loop* (and *to running-sum loop*): the median "
        "over rounds of the peak over that loop's peak of the same round, its range in brackets.",
    ]
    if skipped:
        lines.append("- Skipped: " + "; ".join(f"{e.label} on `{e.job}` ({e.skipped})" for e in skipped))
    lines.append("")
    for job in args.jobs:
        lines += render_job(job, entries, args.steps)
    for job in args.jobs:
        lines += render_trace(job, entries, args.steps)
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------
# Command line


def comma_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"allowed: {', '.join(allowed)} (got {text!r})")
        return names

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help=f"rounds of every contender (default {ROUNDS})"
    )
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    parser.add_argument(
        "--jobs", type=comma_list(JOBS), default=list(JOBS), help=f"comma list of {', '.join(JOBS)}"
    )
    parser.add_argument(
        "--engines",
        type=comma_list(list(ENGINES)),
        default=list(DEFAULT_ENGINES),
        help=f"comma list of contenders (default {','.join(DEFAULT_ENGINES)}; also leantrain-no-tb)",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (default) or cuda[:N]: adds torch.cuda's peak allocated/reserved"
    )
    add_output_options(parser, "smoke run: 1 round of 12 steps; writes only with --out", DEFAULT_OUT)
    parser.add_argument("--probe", choices=list(ENGINES), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job", choices=JOBS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--weights-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is not None:
        if args.job is None:
            parser.error("--probe needs --job")
        return args
    if args.quick:
        args.rounds, args.steps = 1, 12
    args.out = output_path(args, DEFAULT_OUT)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error("--device must be cpu or cuda[:N]")
    if HAND not in args.engines:
        parser.error("--engines must include hand (the reference)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe is not None:
        figures = probe(args.probe, args.job, args.steps, args.device, args.weights_out)
        line = json.dumps(figures)
        if args.probe_out is not None:
            args.probe_out.write_text(line)
        print(line)
        return 0
    started = time.perf_counter()
    header = {
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "load_before": load_now(),
        "git_before": git_state(),
        "argv": list(sys.argv[1:] if argv is None else argv),
    }
    with tempfile.TemporaryDirectory(prefix="leantrain-memory-bench-") as scratch:
        entries = measure(args, Path(scratch))
    header["git_after"] = git_state()
    header["minutes"] = f"{(time.perf_counter() - started) / 60:.1f}"
    publish(render(entries, args, header), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
