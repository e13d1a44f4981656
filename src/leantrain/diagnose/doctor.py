"""``leantrain doctor``: a short, instrumented training run, and what it says.

``run_doctor`` trains the task for warm-up + timed + 2 audited (+ traced) steps with the
run's own settings, through the same Trainer as ``fit`` (a ``StepProbe`` plugged into its
instruments seam), then turns the measurements into a :class:`Diagnosis`: seconds per step
by phase, samples/s, MFU, memory by kind, the user's host syncs and retained graphs, a
verdict and ranked advice. Validation is skipped; checkpoints and outputs go to a temporary
folder unless ``out_dir`` is set.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from leantrain.blocks import block_classes
from leantrain.cluster import detect
from leantrain.config import TrainConfig
from leantrain.data.cache import items_repeat
from leantrain.data.hf import torch_rows
from leantrain.data.packing import padding_share
from leantrain.data.workers import auto_workers, available_cpus
from leantrain.diagnose.advice import Advice, CompileTrial, Measurements, RunFacts, advise, verdict
from leantrain.diagnose.flops import PeakFlops, at_least, compute_dtype, mfu, peak_flops
from leantrain.diagnose.probe import DEFAULT_STEPS, DEFAULT_WARMUP, TRACED_STEPS, Schedule, StepProbe
from leantrain.diagnose.syncs import HostSync, RetainedGraph
from leantrain.memory.accountant import MemoryBreakdown
from leantrain.runtime import resolve_device
from leantrain.step.compilation import CompilerEvent
from leantrain.strategies.registry import strategy_class
from leantrain.trainer import FitResult, Trainer
from leantrain.units import parse_bytes


@dataclass
class Diagnosis:
    verdict: str
    phases: dict[str, float]  # mean seconds per step by phase, and "total"
    step_phases: list[dict[str, float]]  # the same, for every timed step
    samples_per_second: float
    flops_per_step: int
    peak: PeakFlops
    mfu: float
    memory: MemoryBreakdown | None
    peak_memory_bytes: int
    host_syncs: list[HostSync]
    engine_host_syncs: list[HostSync]  # leantrain's own: one planned read per step, log points
    audited_steps: int
    retained_graphs: list[RetainedGraph]
    compiler_events: list[CompilerEvent]  # --compile: graph breaks and recompilations, by place
    compile_trial: CompileTrial | None  # a compute-bound eager run measured again, compiled
    advice: list[Advice]
    facts: RunFacts
    schedule: Schedule
    trace_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    nan_origin: str | None = None  # a non-finite step's (--on-nan skip): where its value came from

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        steps = max(self.audited_steps, 1)
        return {
            "verdict": self.verdict,
            "phases": {k: v for k, v in self.phases.items() if k != "total"},
            "step_seconds": self.phases["total"],
            "samples_per_second": self.samples_per_second,
            "mfu": self.mfu,
            "flops_per_step": self.flops_per_step,
            "peak_flops": dataclasses.asdict(self.peak),
            "memory": None if self.memory is None else self.memory.as_dict(),
            "peak_memory_bytes": self.peak_memory_bytes,
            "host_syncs": [_sync_dict(s, steps) for s in self.host_syncs],
            "engine_host_syncs": [_sync_dict(s, steps) for s in self.engine_host_syncs],
            "retained_graphs": [dataclasses.asdict(g) for g in self.retained_graphs],
            "compiler_events": [dataclasses.asdict(e) for e in self.compiler_events],
            "compile_trial": None if self.compile_trial is None else dataclasses.asdict(self.compile_trial),
            "advice": [a.as_dict() for a in self.advice],
            "run": dataclasses.asdict(self.facts),
            "steps": dataclasses.asdict(self.schedule),
            "step_phases": self.step_phases,
            "trace_dir": self.trace_dir,
            "nan_origin": self.nan_origin,
        }


def _sync_dict(sync: HostSync, steps: int) -> dict[str, Any]:
    return {"call": sync.call, "file": sync.file, "line": sync.line, "per_step": sync.per_step(steps),
            "seconds_per_step": sync.seconds / steps}  # fmt: skip


class _TrainOnly:
    """The task without validation data: the doctor measures training steps only."""

    def __init__(self, task: Any) -> None:
        self._task = task

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def val_data(self) -> None:
        return None


def run_doctor(
    task: Any,
    cfg: TrainConfig,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    trace_dir: str | Path | None = None,
    name: str | None = None,
    task_flags: str = "--task pkg.module:Task",
    try_compile: bool = True,
) -> Diagnosis:
    """Measure ``steps`` training steps of ``task`` under ``cfg`` (after ``warmup``) and diagnose them.

    With ``try_compile``, a compute-bound eager run in one process is measured again with
    ``--compile`` (its warm-up covers the compiling): the advice to compile rests on that trial."""
    schedule = Schedule(warmup, steps, TRACED_STEPS if trace_dir else 0)
    device = resolve_device(cfg.device)
    result, probe = _probed_run(task, cfg, schedule, device, trace_dir, name)
    diagnosis = diagnose_run(task, cfg, result, probe, device, task_flags)
    scope = diagnosis.facts.compile_to_try
    if not (try_compile and scope and diagnosis.verdict == "compute-bound" and detect().world_size == 1):
        return diagnosis
    # Step 1 runs eagerly (the memory accountant's) and step 2 compiles: both in the warm-up.
    trial_schedule = Schedule(max(warmup, COMPILE_TRIAL_WARMUP), steps, audited=0)
    trial_cfg = dataclasses.replace(cfg, compile=scope, out_dir=None)  # a scratch folder of its own
    compiled, trial_probe = _probed_run(task, trial_cfg, trial_schedule, device, None, name)
    trial = CompileTrial(scope, trial_probe.timer.mean()["total"], compiled.compile_seconds)
    return diagnose_run(task, cfg, result, probe, device, task_flags, trial)


# The compiled trial's warm-up: the eager first step, the compiling second, one more to settle.
COMPILE_TRIAL_WARMUP = 3


def _probed_run(
    task: Any, cfg: TrainConfig, schedule: Schedule, device: torch.device, trace_dir: str | Path | None,
    name: str | None,
) -> tuple[FitResult, StepProbe]:  # fmt: skip
    """``task`` trained for the schedule's steps under ``cfg``, measured by a probe."""
    probe = StepProbe(device, schedule, Path(trace_dir) if trace_dir else None)
    with tempfile.TemporaryDirectory(prefix="leantrain-doctor-") as scratch:
        run_cfg = dataclasses.replace(
            cfg,
            max_steps=schedule.total,
            max_epochs=None,
            log_every_n_steps=schedule.total,  # no metric reads inside the measured steps
            val_every_n_steps=None,
            checkpoint_every="never",  # a measurement, not a run to continue
            resume=None,
            logger="none",
            out_dir=cfg.out_dir or str(Path(scratch) / "run"),
        )
        try:
            result = Trainer(run_cfg, callbacks=[probe], instruments=probe).fit(
                _TrainOnly(task), name=name or type(task).__name__
            )
        finally:
            probe.close()
    return result, probe


def diagnose_run(
    task: Any,
    cfg: TrainConfig,
    result: FitResult,
    probe: StepProbe,
    device: torch.device,
    task_flags: str,
    compile_trial: CompileTrial | None = None,
) -> Diagnosis:
    """Turn a probed run's measurements into the diagnosis."""
    phases = probe.timer.mean()
    step_phases = probe.timer.steps()
    reached = probe.flops_per_step / phases["total"] if phases["total"] > 0 else 0.0
    peak = at_least(peak_flops(device, compute_dtype(cfg.precision)), reached)
    memory = MemoryBreakdown(
        result.params_bytes, result.grads_bytes, result.optimizer_bytes, result.activation_bytes,
        result.ema_bytes,
    )  # fmt: skip
    measurements = Measurements(
        phases=phases,
        memory=memory,
        host_syncs=probe.syncs.sites(),
        audited_steps=probe.audited_steps,
        retained_graphs=probe.retained,
        backward_calls=probe.backward_calls,
        backwards_with_all_reduce=probe.backwards_with_all_reduce,
        compiler_events=result.compiler_events,
        compile_trial=compile_trial,
    )
    facts = _facts(task, cfg, result, device, task_flags)
    return Diagnosis(
        verdict=verdict(facts, measurements),
        phases=phases,
        step_phases=step_phases,
        samples_per_second=result.global_batch_size / max(phases["total"], 1e-12),
        flops_per_step=probe.flops_per_step,
        peak=peak,
        mfu=mfu(probe.flops_per_step, phases["total"], peak),
        memory=memory,
        peak_memory_bytes=result.peak_memory_bytes,
        host_syncs=measurements.host_syncs,
        engine_host_syncs=probe.syncs.sites(engine=True),
        audited_steps=probe.audited_steps,
        retained_graphs=probe.retained,
        compiler_events=result.compiler_events,
        compile_trial=compile_trial,
        advice=advise(facts, measurements),
        facts=facts,
        schedule=probe.schedule,
        trace_dir=None if probe.trace_dir is None else str(probe.trace_dir),
        nan_origin=result.nan_origin,
    )


def _facts(task: Any, cfg: TrainConfig, result: FitResult, device: torch.device, task_flags: str) -> RunFacts:
    budget = parse_bytes(cfg.memory_budget) if cfg.memory_budget else None
    fast_16bit = None
    if device.type == "cuda":
        budget = budget or torch.cuda.get_device_properties(device).total_memory
        if torch.cuda.get_device_capability(device) >= (8, 0):
            fp32 = peak_flops(device, torch.float32).flops_per_second
            fast_16bit = peak_flops(device, torch.bfloat16).flops_per_second / fp32
    map_style, repeat, padding, length = _data_facts(task, cfg)
    return RunFacts(
        device_type=device.type,
        strategy=result.strategy,
        strategy_caveat=strategy_class(result.strategy).caveat,
        precision=result.precision,
        micro_batch_size=result.micro_batch_size,
        accumulation_steps=result.accumulation_steps,
        global_batch_size=result.global_batch_size,
        world_size=result.world_size,
        tensor_parallel=result.tensor_parallel,
        num_workers=result.num_workers,
        persistent_workers=True,  # leantrain's loaders keep their workers
        auto_workers=auto_workers(detect().local_world_size),
        torch_threads=result.compute_threads,
        available_cpus=available_cpus(),
        pin_memory=cfg.pin_memory if cfg.pin_memory is not None else device.type == "cuda",
        cache=cfg.cache,
        map_style=map_style,
        items_repeat=repeat,
        padding_share=padding,
        token_length=length,
        micro_batch_halved=isinstance(cfg.micro_batch_size, int)
        and result.micro_batch_size < cfg.micro_batch_size,
        memory_budget=budget,
        fast_16bit_ratio=fast_16bit,
        task_flags=task_flags,
        compile=cfg.compile,
        repeated_blocks=None if result.model is None else bool(block_classes(result.model)),
    )


# Items whose padding the doctor counts: enough for a share, few enough to cost nothing.
PADDING_SAMPLE = 64


def _data_facts(task: Any, cfg: TrainConfig) -> tuple[bool, bool | None, float | None, int | None]:
    """Whether the training data is map-style, whether its items load the same twice, and for token
    data the share of padding among a sample of items (0 when packed) and the items' length."""
    dataset = torch_rows(task.train_data(), "train_data")  # as fit reads it
    if isinstance(dataset, IterableDataset):
        return False, None, None, None
    try:
        repeat, first = items_repeat(dataset), dataset[0]
        if cfg.pack_length is not None:
            return True, repeat, 0.0, cfg.pack_length  # rows of exactly pack_length tokens: no padding
        if not (isinstance(first, dict) and isinstance(first.get("input_ids"), torch.Tensor)):
            return True, repeat, None, None  # not token data: nothing more to load
        items = [dataset[i] for i in range(min(len(dataset), PADDING_SAMPLE))]
        return True, repeat, padding_share(items), first["input_ids"].shape[-1]
    except Exception:  # the doctor only asks; the run itself already loaded this data
        return True, None, None, None
