"""What a run did: ``FitResult``, whose ``summary()`` is ``summary.json``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from torch import nn

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
    skipped_steps: int = 0  # steps without an update: fp16 overflows and, with on_nan=skip, non-finite ones
    nonfinite_steps: int = 0  # of those, the steps whose loss or gradient was NaN/inf
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
    val_metrics: dict[str, float] = field(default_factory=dict)
    compiler_events: list[CompilerEvent] = field(default_factory=list)  # recompilations, graph breaks
    out_dir: Path | None = None
    model: nn.Module | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        # Not asdict(): it deep-copies every field, the model too (and FSDP models refuse).
        data = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("val_metrics", "compiler_events", "out_dir", "model")
        }
        return {**data, **self.val_metrics, "out_dir": str(self.out_dir)}
