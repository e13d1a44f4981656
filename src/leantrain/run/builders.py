"""The pieces of a run, each built by one function from the config, in the order ``Run`` calls them.

1. ``build_model``: the task's model, its precision (true 16-bit converts it; the optimizer
   then gets fp32 masters), activation checkpointing (``auto`` resolved here), then
   ``--compile`` (``step/compilation.py``);
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

import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from leantrain.blocks import BlockPolicy
from leantrain.config import TrainConfig
from leantrain.data.loader import collate, move_to_device
from leantrain.data.sampler import steps_per_epoch
from leantrain.errors import LeantrainWarning, TaskError
from leantrain.memory.adaptive import scale_learning_rates
from leantrain.memory.estimate import fewest_checkpointed_blocks, first_items
from leantrain.memory.recompute import apply_activation_checkpointing, cache_note
from leantrain.run.hooks import Instruments
from leantrain.step.batching import BatchSplit
from leantrain.step.compilation import compile_model
from leantrain.step.precision import Precision, make_precision
from leantrain.strategies.base import Example, Strategy
from leantrain.strategies.dims import ParallelDims
from leantrain.task import call_task
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
    """Precision first (before any wrapper), then activation checkpointing, then compiling."""
    model = _task_model(task).to(strategy.build_device(device))
    precision = instruments.precision(make_precision(cfg.precision, device))
    prepared = precision.prepare(model)
    notes = []
    policy = cfg.activation_checkpointing
    if policy == "auto":
        budget = parse_bytes(cfg.memory_budget) or 0
        policy = fewest_checkpointed_blocks(task, cfg, budget, world_size)
        notes.append(f"activation checkpointing auto: {policy or 'none needed'}")
    recomputed = [] if policy is None else apply_activation_checkpointing(model, BlockPolicy.parse(policy))
    if recomputed and (note := cache_note(model)):
        notes.append(note)
    compiled = compile_model(model, cfg.compile, cfg.compile_options, policy)
    if compiled:
        shown = ", ".join(compiled[:3]) + (", ..." if len(compiled) > 3 else "")
        notes.append(f"compile {cfg.compile} (mode {cfg.compile_mode}): {len(compiled)} module(s) ({shown})")
    return ModelParts(model, precision, prepared, policy, recomputed, notes)


def _task_model(task: Any) -> nn.Module:
    """``task.model()``, checked: a Module with something to train."""
    model = call_task("task.model()", task.model)
    if not isinstance(model, nn.Module):
        raise TaskError(f"task.model() must return a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        held = f"{len(params)} parameters, all with requires_grad=False" if params else "no parameters at all"
        raise TaskError(
            f"task.model() has no trainable parameters ({held}): the optimizer would have nothing to "
            "update; return a model with at least one parameter that requires grad"
        )
    return model


def example_of(task: Any, dataset: Any, split: BatchSplit, device: torch.device) -> Example:
    """The task's loss and one micro-batch of ``dataset`` on the device (loaded when asked)."""

    def first_batch() -> Any:
        items = first_items(dataset, split.micro_batch_size)
        return move_to_device(collate(items, range(len(items)), "train_data"), device)

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
    optimizer = call_task("task.optimizer(params)", task.optimizer, iter(params))
    _check_optimizer_holds(optimizer, params)
    notes = []
    if cfg.lr_scaling != "none":  # before the scheduler, which records the base learning rates
        notes.append(scale_learning_rates(optimizer, cfg))
    scheduler_fn = getattr(task, "scheduler", None)
    scheduler = scheduler_fn(optimizer) if callable(scheduler_fn) else None
    return Optimization(params, optimizer, scheduler, notes)


def _check_optimizer_holds(optimizer: Any, params: list[nn.Parameter]) -> None:
    """TaskError when the optimizer updates tensors it was not given; a warning when it leaves
    trainable ones out. By identity: under fsdp or 16-true the engine gives the optimizer other
    tensors than the model's parameters (shards, fp32 masters), and an optimizer built over the
    model's own would train nothing."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise TaskError(
            f"task.optimizer(params) must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    given = {id(p) for p in params}
    held = {id(p) for group in groups for p in group["params"]}
    foreign = len(held - given)
    if foreign:
        raise TaskError(
            f"task.optimizer(params) built an optimizer over {foreign} tensor(s) that are not among the "
            f"{len(params)} parameters it was given: build it over the params it receives, not "
            "model.parameters() (under fsdp or 16-true the engine passes other tensors)"
        )
    trainable = [p for p in params if p.requires_grad]
    left_out = sum(id(p) not in held for p in trainable)
    if left_out:
        warnings.warn(
            f"task.optimizer(params) holds {len(trainable) - left_out} of the {len(trainable)} trainable "
            f"parameters it was given: {left_out} are left untrained; build it over every parameter it "
            "receives (or freeze those with requires_grad_(False))",
            LeantrainWarning,
            stacklevel=2,
        )


def schedule_length(cfg: TrainConfig, dataset_size: int | None, split: BatchSplit) -> tuple[int | None, int]:
    """Optimizer steps per epoch (None for a stream of unknown length) and the steps of the run."""
    per_epoch = None if dataset_size is None else steps_per_epoch(dataset_size, split)
    epoch_steps = cfg.epoch_limit and per_epoch and cfg.epoch_limit * per_epoch
    return per_epoch, min(limit for limit in (cfg.max_steps, epoch_steps) if limit)


def pin_memory(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.pin_memory if cfg.pin_memory is not None else device.type == "cuda"
