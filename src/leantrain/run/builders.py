"""The pieces of a run, each built by one function from the config, in the order ``Run`` calls them.

1. ``build_model``: the task's model, its precision (true 16-bit converts it; the optimizer
   then gets fp32 masters) and activation checkpointing (``auto`` resolved here);
2. the training data (``data.build.load_train_data``), then ``example_of``: the task's loss and
   a first micro-batch, for a strategy that traces the model;
3. ``build_strategy``: the strategy wraps or cuts the model as it will run;
4. ``build_optimization``: the optimizer over what the strategy says it updates, learning-rate
   scaling, the task's scheduler;
5. ``schedule_length``: steps per epoch and the steps of the run.

The data loaders come from ``data/build.py``; resuming is ``run/state.py``. The out-of-memory
rebuild calls ``strategy.reset_after_out_of_memory`` and ``data.build.build_train_loader`` again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import default_collate

from leantrain.blocks import BlockPolicy
from leantrain.config import TrainConfig
from leantrain.data.loader import move_to_device
from leantrain.data.sampler import steps_per_epoch
from leantrain.errors import TaskError
from leantrain.memory.adaptive import scale_learning_rates
from leantrain.memory.estimate import fewest_checkpointed_blocks, first_items
from leantrain.memory.recompute import apply_activation_checkpointing
from leantrain.run.hooks import Instruments
from leantrain.step.batching import BatchSplit
from leantrain.step.precision import Precision, make_precision
from leantrain.strategies.base import Example, Strategy
from leantrain.strategies.dims import ParallelDims
from leantrain.units import parse_bytes


class ModelParts(NamedTuple):
    model: nn.Module  # unwrapped, on the strategy's build device
    precision: Precision
    prepared: list[nn.Parameter]  # what precision.prepare returned: the optimizer's, before wrapping
    recompute: str | None  # the activation checkpointing policy, ``auto`` resolved
    recomputed: list[str]  # the blocks it recomputes
    notes: list[str]  # set-up decisions, for the run log


def build_model(
    task: Any,
    cfg: TrainConfig,
    strategy: type[Strategy],
    device: torch.device,
    world_size: int,
    instruments: Instruments,
) -> ModelParts:
    """Precision first (before any wrapper), then activation checkpointing."""
    model = task.model()
    if not isinstance(model, nn.Module):
        raise TaskError(f"task.model() must return a torch.nn.Module, got {type(model).__name__}")
    model = model.to(strategy.build_device(device))
    precision = instruments.precision(make_precision(cfg.precision, device))
    prepared = precision.prepare(model)
    notes = []
    policy = cfg.activation_checkpointing
    if policy == "auto":
        budget = parse_bytes(cfg.memory_budget) or 0
        policy = fewest_checkpointed_blocks(task, cfg, budget, world_size)
        notes.append(f"activation checkpointing auto: {policy or 'none needed'}")
    recomputed = [] if policy is None else apply_activation_checkpointing(model, BlockPolicy.parse(policy))
    return ModelParts(model, precision, prepared, policy, recomputed, notes)


def example_of(task: Any, dataset: Any, split: BatchSplit, device: torch.device) -> Example:
    """The task's loss and one micro-batch of ``dataset`` on the device (loaded when asked)."""

    def first_batch() -> Any:
        return move_to_device(default_collate(first_items(dataset, split.micro_batch_size)), device)

    return Example(task.loss, first_batch)


def build_strategy(
    strategy: type[Strategy],
    cfg: TrainConfig,
    device: torch.device,
    dims: ParallelDims,
    model: nn.Module,
    example: Example,
    instruments: Instruments,
) -> Strategy:
    """The strategy, with the model wrapped (the process group, if any, is up)."""
    built = strategy(cfg, device, dims)
    built.wrap(model, example)
    instruments.strategy(built)
    return built


class Optimization(NamedTuple):
    params: list[nn.Parameter]  # what the optimizer updates
    optimizer: torch.optim.Optimizer
    scheduler: Any  # the task's learning-rate scheduler, or None
    notes: list[str]


def build_optimization(
    task: Any, cfg: TrainConfig, strategy: Strategy, prepared: list[nn.Parameter]
) -> Optimization:
    params = strategy.optimizer_params(prepared)
    optimizer = task.optimizer(iter(params))
    notes = []
    if cfg.lr_scaling != "none":  # before the scheduler, which records the base learning rates
        notes.append(scale_learning_rates(optimizer, cfg))
    scheduler_fn = getattr(task, "scheduler", None)
    scheduler = scheduler_fn(optimizer) if callable(scheduler_fn) else None
    return Optimization(params, optimizer, scheduler, notes)


def schedule_length(cfg: TrainConfig, dataset_size: int | None, split: BatchSplit) -> tuple[int | None, int]:
    """Optimizer steps per epoch (None for a stream of unknown length) and the steps of the run."""
    per_epoch = None if dataset_size is None else steps_per_epoch(dataset_size, split)
    epoch_steps = cfg.epoch_limit and per_epoch and cfg.epoch_limit * per_epoch
    return per_epoch, min(limit for limit in (cfg.max_steps, epoch_steps) if limit)


def pin_memory(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.pin_memory if cfg.pin_memory is not None else device.type == "cuda"
