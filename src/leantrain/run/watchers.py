"""The built-in callbacks a config asks for: the weight average, early stopping, best checkpoints,
trackers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leantrain.checkpoint import CheckpointFolder
from leantrain.config import TrainConfig
from leantrain.errors import ConfigError
from leantrain.extensions.best_checkpoints import BestCheckpoints
from leantrain.extensions.early_stopping import EarlyStopping
from leantrain.extensions.metric_watch import MetricWatch
from leantrain.extensions.trackers import open_trackers
from leantrain.extensions.weight_average import WeightAverage
from leantrain.step.precision import Precision


def built_in_callbacks(
    cfg: TrainConfig,
    *,
    validates: bool,
    is_main: bool,
    run_dir: Path,
    checkpoints: CheckpointFolder,
    write_weights: Callable[[str], None],
    warn: Callable[[str], None],
    model: nn.Module,
    optimizer_params: list[torch.Tensor],
    precision: Precision,
    validation_names: Callable[[], list[str]],
) -> list[Any]:
    """The weight average, early stopping and best checkpoints on every process (they decide
    alike, from reduced validation metrics, and saving is collective); trackers on rank 0 only.
    ``optimizer_params`` line up with ``model``'s parameters (the masters of the true 16-bit modes
    are made from them, in order). ``validation_names()``: the metrics validation logs (a forward
    of one batch, on every process), asked only to check a watched metric other than val_loss
    before training rather than at the first validation."""
    callbacks: list[Any] = []
    needs_validation = (
        ("early_stop_metric", cfg.early_stop_metric),
        ("best_metric", cfg.best_metric),
        ("ema_validate", cfg.ema_validate or None),
    )
    for field, value in needs_validation:
        if value is not None and not validates:
            raise ConfigError(field, value, "needs validation data: the task has no val_data()")
    if cfg.ema_decay is not None:
        names = [name for name, _ in model.named_parameters()]
        callbacks.append(
            WeightAverage(
                cfg.ema_decay, names, optimizer_params, precision, write_weights, warn, cfg.ema_validate
            )
        )
    watches = []
    if cfg.early_stop_metric is not None:
        stalls = MetricWatch(
            cfg.early_stop_metric, cfg.early_stop_mode, "early_stop_metric", cfg.early_stop_min_delta
        )
        callbacks.append(EarlyStopping(stalls, cfg.early_stop_patience))
        watches.append(stalls)
    if cfg.best_metric is not None:
        watch = MetricWatch(cfg.best_metric, cfg.best_mode, "best_metric")
        callbacks.append(
            BestCheckpoints(watch, cfg.keep_best, checkpoints, lambda: write_weights("best.safetensors"))
        )
        watches.append(watch)
    if any(watch.metric != "val_loss" for watch in watches):  # val_loss is always there
        logged = dict.fromkeys(validation_names(), 0.0)
        for watch in watches:
            watch.value_in(logged)  # a ConfigError naming the field and what there is
    if is_main:
        callbacks += open_trackers(cfg, run_dir, warn)
    return callbacks
