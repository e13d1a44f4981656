"""What a run did: ``FitResult``, whose ``summary()`` is ``summary.json``, read off the run's parts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leantrain.memory.accountant import MemoryBreakdown
from leantrain.run.context import RunContext
from leantrain.run.data import DataPart
from leantrain.run.model import ModelPart
from leantrain.run.observers import Observers
from leantrain.run.persistence import Persistence
from leantrain.run.recovery import Recovery
from leantrain.runtime import peak_memory_bytes
from leantrain.step.compilation import CompilerEvent


@dataclass
class FitResult:
    """What a run did; ``summary()`` is what ``summary.json`` holds."""

    steps: int  # optimizer steps trained (fewer than scheduled when the run stopped early)
    samples: int
    final_train_loss: float
    samples_per_second: float
    wall_seconds: float
    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    precision: str
    strategy: str
    peak_memory_bytes: int
    global_batch_size: int
    device: str
    num_workers: int = 0  # the DataLoader workers used (as resolved from auto / tune)
    compute_threads: int = 1  # torch's intra-op threads in training (lowered beside workers on CPU)
    tensor_parallel: int = 1  # --tp: ranks per tensor-parallel group; world_size / it are data-parallel
    skipped_steps: int = 0  # steps without an update: fp16 overflows and, with on_nan=skip, non-finite ones
    nonfinite_steps: int = 0  # of those, the steps whose loss or gradient was NaN/inf
    nan_origin: str | None = None  # where the first non-finite value came from (a module, the loss)
    loss_spikes: int = 0  # steps whose loss stood out (--on-spike warn or rollback)
    # --on-spike rollback: each spike's step and loss, the step restored, the steps and samples skipped
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False  # early stopping ended the run at `steps`, before the schedule's end
    checkpoint_blocked_seconds: float = (
        0.0  # training time lost to saving checkpoints (all processes of the run)
    )
    compile_seconds: float = 0.0  # torch.compile's time (--compile); samples_per_second leaves it out
    params_bytes: int = 0  # parameters (and fp32 masters); see memory/accountant.py
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0  # saved for backward by one micro-batch, measured at the first step
    ema_bytes: int = 0  # the moving average of the weights (--ema-decay), when kept
    mixture: dict[str, dict[str, int]] = field(default_factory=dict)  # samples and tokens per source
    val_metrics: dict[str, float] = field(default_factory=dict)
    compiler_events: list[CompilerEvent] = field(default_factory=list)  # recompilations, graph breaks
    out_dir: Path | None = None  # the run's files on this machine (a URL run's staging folder)
    out_url: str | None = None  # where a run at a URL keeps them (--out s3://...)
    model: nn.Module | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        # Not asdict(): it deep-copies every field, the model too (and FSDP models refuse).
        data = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("val_metrics", "compiler_events", "out_dir", "out_url", "model")
            and (f.name != "mixture" or self.mixture)  # only for a mixture
        }
        return {**data, **self.val_metrics, "out_dir": self.out_url or str(self.out_dir)}


def fit_result(
    ctx: RunContext,
    steps: int,
    model: ModelPart,
    data: DataPart,
    persistence: Persistence,
    observers: Observers,
    recovery: Recovery,
    memory: MemoryBreakdown | None,
    val_metrics: dict[str, float],
) -> FitResult:
    """What the run did after ``steps`` optimizer steps, counting the earlier processes of the run."""
    split, progress, compiler = data.split, persistence.progress, observers.compiler
    samples = steps * split.global_batch_size
    return FitResult(
        steps=steps,
        samples=samples,
        final_train_loss=progress.final_train_loss,
        samples_per_second=samples / max(progress.train_seconds, 1e-9),
        wall_seconds=persistence.wall_seconds(),
        micro_batch_size=split.micro_batch_size,
        accumulation_steps=split.accumulation_steps,
        world_size=ctx.env.world_size,
        precision=model.precision.name,
        strategy=model.strategy.name,
        peak_memory_bytes=peak_memory_bytes(ctx.device),
        global_batch_size=split.global_batch_size,
        device=str(ctx.device),
        num_workers=data.num_workers,
        compute_threads=torch.get_num_threads(),
        tensor_parallel=ctx.dims.tp,
        skipped_steps=int(progress.skipped_steps),
        nonfinite_steps=int(progress.nonfinite_steps),
        nan_origin=progress.nan_origin,
        loss_spikes=recovery.spikes,
        rollbacks=list(recovery.rollbacks),
        stopped_early=steps < data.schedule.total_steps,  # the only way to end short of it
        checkpoint_blocked_seconds=persistence.checkpoint_blocked_seconds(),
        compile_seconds=progress.compile_seconds + compiler.seconds,
        compiler_events=compiler.events,
        **(memory.as_dict() if memory is not None else {}),
        mixture=data.mixture_counts(steps, model.strategy.all_reduce_sum if ctx.env.distributed else None),
        val_metrics=dict(val_metrics),
        out_dir=ctx.run_dir,
        out_url=ctx.mirror.url if ctx.mirror is not None else None,
        model=model.model,
    )
