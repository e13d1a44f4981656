"""Steps that made no update, the fp16 loss scale, gradient underflow: counted, logged, warned about.

The run reports every skipped step here and asks for the metrics at each log point;
each warning is given once per run, through ``warn`` (a ``LeantrainWarning`` on rank 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from leantrain.step.accumulator import StepStatus

# Warn when this share of a log window's steps made no update, or of fp16 gradient values underflows.
SKIPPED_SHARE_WARNING = 0.25
UNDERFLOW_SHARE_WARNING = 0.25


class SkipCounts(Protocol):
    """Where the run counts its steps without an update (its progress, checkpointed)."""

    skipped_steps: int
    nonfinite_steps: int


class PrecisionHealth:
    def __init__(self, counts: SkipCounts, warn: Callable[[str], None]) -> None:
        self.counts = counts
        self.warn = warn
        self.worrying_skips = 0  # skipped steps, less the fp16 scale's calibration at the start
        self.worrying_skips_at_last_log = 0
        self.warned: set[str] = set()

    def count_skip(self, step: int, status: StepStatus) -> None:
        # Overflows before the first update are the fp16 scale settling from its initial value.
        calibrating = status is StepStatus.OVERFLOW and step == self.counts.skipped_steps
        self.worrying_skips += not calibrating
        self.counts.skipped_steps += 1
        if status is not StepStatus.OVERFLOW:
            self.counts.nonfinite_steps += 1

    def metrics(
        self,
        done: int,
        window_steps: int,
        loss_scale: torch.Tensor | None,
        underflow_share: torch.Tensor | None,
    ) -> dict[str, float]:
        """Skipped steps, loss scale and gradient underflow (reading the device values: a log point)."""
        metrics: dict[str, float] = {"skipped_steps": self.counts.skipped_steps}
        skipped = self.worrying_skips - self.worrying_skips_at_last_log
        self.worrying_skips_at_last_log = self.worrying_skips
        scale = None if loss_scale is None else float(loss_scale)
        if scale is not None:
            metrics["loss_scale"] = scale
        if underflow_share is not None:
            metrics["grad_underflow_share"] = float(underflow_share)
        scale_text = "" if scale is None else f" (loss scale now {scale:g})"
        if window_steps >= 4 and skipped > window_steps * SKIPPED_SHARE_WARNING:
            self._warn_once(
                "skipped",
                f"{skipped} of the last {window_steps} steps were skipped{scale_text}: training is "
                "losing updates; try bf16, a lower learning rate, or gradient clipping",
            )
        if scale is not None and scale < 1.0:
            self._warn_once(
                "collapsed",
                f"the fp16 loss scale collapsed to {scale:g} at step {done}: gradients overflow even "
                "unscaled; try bf16-mixed or a lower learning rate",
            )
        underflow = metrics.get("grad_underflow_share", 0.0)
        if underflow > UNDERFLOW_SHARE_WARNING:
            self._warn_once(
                "underflow",
                f"{underflow:.0%} of the non-zero fp16 gradient values are below fp16's smallest normal "
                f"at step {done}{scale_text}: small gradients lose precision or flush to 0; try bf16",
            )
        return metrics

    def _warn_once(self, kind: str, text: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            self.warn(text)
