"""The builders: each part of a run from the config and the parts it needs, in the order ``Run`` calls them.

A builder takes what it needs as arguments, so the order cannot be wrong: the model first, the
optimizer over what the strategy made of it, then the resume (``Persistence.resume``: it loads into
the model and optimizer, and tells where the run starts), the data from that step on, and the
observers last (they log what the others decided).

1. ``prepare_model``: the task's model, its precision (true 16-bit converts it; the optimizer
   then gets fp32 masters), activation checkpointing (``auto`` resolved here), ``--compile``
   (``step/compilation.py``). It comes before the training data is loaded: ``task.model()``
   draws its initial weights first, whatever ``task.train_data()`` draws;
   ``build_model_part``: the strategy, which wraps or cuts the prepared model as it will run (a
   strategy that traces the model gets the task's loss and a first micro-batch: ``example_of``);
   every rank draws its own random numbers from there on;
2. ``build_optimization``: the optimizer over what the strategy says it updates, learning-rate
   scaling, the scheduler (the task's or a built-in one: ``step/schedules.py``), and the memory
   policy that sizes the micro-batch;
3. ``build_data``: the loaders from the resumed step on, cut as the (searched) split says;
4. ``build_observers``: the log, the callbacks (their state restored), the health of the numbers,
   the heartbeat and the hang watchdog, the compiler's events.

The out-of-memory rebuild calls ``strategy.reset_after_out_of_memory``, ``Optimization.use_split``
and ``DataPart.restart``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from leantrain.adapters import FrozenBase, adapter_summary, with_lora
from leantrain.blocks import BlockPolicy
from leantrain.config import TrainConfig
from leantrain.data.build import TrainData, build_train_loader, build_val_loader
from leantrain.data.loader import collate, move_to_device
from leantrain.data.workers import cpus_per_process
from leantrain.errors import LeantrainWarning, TaskError
from leantrain.log.precision_health import PrecisionHealth
from leantrain.log.run_logger import RunLogger
from leantrain.memory.adaptive import MicroBatchSizer, scale_learning_rates
from leantrain.memory.estimate import fewest_checkpointed_blocks, first_items
from leantrain.memory.recompute import apply_activation_checkpointing, cache_note
from leantrain.run.context import RunContext
from leantrain.run.data import DataPart, Schedule
from leantrain.run.hooks import Callback
from leantrain.run.model import ModelPart
from leantrain.run.observers import Observers, restore_callbacks, say_error
from leantrain.run.optimization import Optimization
from leantrain.run.persistence import Persistence, Resumed
from leantrain.run.watchdog import Heartbeat, Watchdog
from leantrain.run.watchers import built_in_callbacks
from leantrain.runtime import derived_seed, leave_cpus_to_workers, seed_everything
from leantrain.step.batch_norm import batch_norm_layers
from leantrain.step.batching import BatchSplit
from leantrain.step.compilation import CompileWatch, compile_model
from leantrain.step.evaluation import metric_names
from leantrain.step.precision import Precision, make_precision
from leantrain.step.schedules import BuiltInSchedule, make_scheduler, shorter_than_the_run
from leantrain.strategies.base import Example, Strategy
from leantrain.strategies.process_group import group_store
from leantrain.task import call_task
from leantrain.units import parse_bytes


class PreparedModel(NamedTuple):
    """The task's model before the strategy: precision applied, blocks recomputed, compiled."""

    model: nn.Module  # on the strategy's build device
    frozen: FrozenBase | None  # an adapter model's base, as task.model() made it
    precision: Precision
    prepared: list[nn.Parameter]  # what precision.prepare returned: the optimizer's, before wrapping
    recompute: str | None  # the activation checkpointing policy, ``auto`` resolved
    recomputed: list[str]  # the blocks it recomputes
    notes: list[str]


def prepare_model(ctx: RunContext, strategy: type[Strategy]) -> PreparedModel:
    """Precision first (before any wrapper), then activation checkpointing, then compiling."""
    cfg, task = ctx.cfg, ctx.task
    model = _task_model(task, cfg).to(strategy.build_device(ctx.device))
    frozen = FrozenBase.of(model)  # before 16-bit: the base's values as a resume makes them again
    precision = ctx.instruments.precision(make_precision(cfg.precision, ctx.device))
    prepared = precision.prepare(model)
    notes = [] if frozen is None else [adapter_summary(model)]
    policy = cfg.activation_checkpointing
    if policy == "auto":
        budget = parse_bytes(cfg.memory_budget) or 0
        policy = fewest_checkpointed_blocks(task, cfg, budget, ctx.env.world_size)
        notes.append(f"activation checkpointing auto: {policy or 'none needed'}")
    recomputed = [] if policy is None else apply_activation_checkpointing(model, BlockPolicy.parse(policy))
    if recomputed and (note := cache_note(model)):
        notes.append(note)
    compiled = compile_model(model, cfg.compile, cfg.compile_options, policy)
    if compiled:
        shown = ", ".join(compiled[:3]) + (", ..." if len(compiled) > 3 else "")
        notes.append(f"compile {cfg.compile} (mode {cfg.compile_mode}): {len(compiled)} module(s) ({shown})")
    return PreparedModel(model, frozen, precision, prepared, policy, recomputed, notes)


def build_model_part(
    ctx: RunContext, strategy: type[Strategy], prepared: PreparedModel, train: TrainData, split: BatchSplit
) -> ModelPart:
    """The strategy, built and wrapping the prepared model (the process group, if any, is up)."""
    built = strategy(ctx.cfg, ctx.device, ctx.dims)
    built.wrap(prepared.model, example_of(ctx.task, train.dataset, split, ctx.device))
    ctx.instruments.strategy(built)
    if ctx.env.distributed:
        # Every rank drew the same initial weights above (DDP also broadcasts rank 0's).
        # From here on each rank draws its own numbers: dropout masks must differ by rank.
        # The ranks of a tensor-parallel group share theirs (``ParallelDims.seed_rank``).
        seed_everything(derived_seed(ctx.cfg.seed, ctx.dims.seed_rank(ctx.env.rank)))
    batch_norms = batch_norm_layers(prepared.model)  # as wrapped: --sync-batchnorm converts them in place
    return ModelPart(
        built, prepared.frozen, prepared.precision, prepared.prepared, prepared.recompute,
        prepared.recomputed, batch_norms, prepared.notes,
    )  # fmt: skip


def _task_model(task: Any, cfg: TrainConfig) -> nn.Module:
    """``task.model()`` (with the ``--lora-*`` adapters), checked: a Module with something to train."""
    model = call_task("task.model()", task.model)
    if not isinstance(model, nn.Module):
        raise TaskError(f"task.model() must return a torch.nn.Module, got {type(model).__name__}")
    model = with_lora(model, cfg.to_dict())
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

    plan = getattr(task, "tp_plan", None)

    def tp_plan(model: nn.Module) -> Any:
        return call_task("task.tp_plan(model)", plan, model)

    return Example(task.loss, first_batch, tp_plan if callable(plan) else None)


def build_optimization(ctx: RunContext, model: ModelPart, total_steps: int) -> Optimization:
    """The optimizer over what the strategy updates, scaled learning rates, the scheduler (the task's,
    given ``total_steps`` when it takes them, or a built-in one), the sizer."""
    cfg, task = ctx.cfg, ctx.task
    params = model.strategy.optimizer_params(model.prepared)
    optimizer = call_task("task.optimizer(params)", task.optimizer, iter(params))
    _check_optimizer_holds(optimizer, params)
    notes = []
    if cfg.lr_scaling != "none":  # before the scheduler, which records the base learning rates
        notes.append(scale_learning_rates(optimizer, cfg))
    scheduler = make_scheduler(task, optimizer, cfg, total_steps)
    if isinstance(scheduler, BuiltInSchedule):
        notes.append(f"learning-rate schedule: {scheduler.shape.describe()}")
    sizer = MicroBatchSizer(task, cfg, model.precision, model.model, ctx.device, ctx.env, model.recompute)
    averaged = cfg.ema_decay is not None
    part = Optimization(model, params, optimizer, scheduler, sizer, cfg.max_grad_norm, averaged, notes)
    if (too_short := shorter_than_the_run(scheduler, total_steps)) is not None:
        part.warnings.append(too_short)
    return part


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


def build_data(
    ctx: RunContext,
    model: ModelPart,
    train: TrainData,
    schedule: Schedule,
    split: BatchSplit,
    resumed: Resumed,
) -> DataPart:
    """The training loader from the resumed step on, the validation loader; on the CPU, the main
    process's threads budgeted beside the loader's workers."""
    cfg, data_env = ctx.cfg, ctx.data_env
    pin = cfg.pin_memory if cfg.pin_memory is not None else ctx.device.type == "cuda"
    train_loader, workers, prefetch = build_train_loader(
        train, cfg, data_env, split, schedule.total_steps, resumed.step, pin, resumed.data
    )
    validation = build_val_loader(ctx.task, cfg, data_env, split, workers, prefetch, pin, train.notes)
    if ctx.device.type == "cpu":  # the workers and the step's compute share this node's CPUs
        threads = leave_cpus_to_workers(workers, cpus_per_process(ctx.env.local_world_size))
        train.notes.extend([threads] if threads else [])
    loaders = (train_loader, validation)
    return DataPart(
        ctx, train, schedule, split, resumed.step, loaders, workers, pin, model.precision.input_dtype
    )


def build_observers(
    ctx: RunContext,
    model: ModelPart,
    optimization: Optimization,
    data: DataPart,
    persistence: Persistence,
    resumed: Resumed,
    callbacks: Sequence[Callback],
) -> Observers:
    """The log, the callbacks (built-in ones first, their state restored), the watchers."""
    cfg, env = ctx.cfg, ctx.env
    logger = RunLogger(
        ctx.run_dir, data.schedule.total_steps, cfg.progress, "tensorboard" in cfg.loggers, resumed.step,
        enabled=env.is_main,
    )  # fmt: skip
    built_ins = built_in_callbacks(
        cfg,
        validates=data.validation is not None,
        is_main=env.is_main,
        run_dir=ctx.run_dir,
        checkpoints=persistence.checkpoints,
        write_weights=lambda name: model.write_weights(ctx.run_dir / name, env.is_main),
        warn=logger.warning,
        model=model.model,
        optimizer_params=optimization.params,
        precision=model.precision,
        validation_names=lambda: _validation_names(ctx, model, data),
    )
    all_callbacks = [*built_ins, *callbacks]
    if resumed.step:
        restore_callbacks(
            all_callbacks, resumed.callbacks, resumed.callback_from_shards, resumed.step, logger.warning
        )
    heartbeat = Heartbeat()
    compiler = CompileWatch(cfg.compile != "none", lambda event: logger.message(event.line()))
    watchdog = Watchdog(
        cfg.hang_timeout, heartbeat, ctx.run_dir, env.rank, env.world_size, group_store(), say_error,
        paused=lambda: compiler.compiling,
    )  # fmt: skip
    health = PrecisionHealth(persistence.progress, logger.warning)
    return Observers(logger, all_callbacks, health, heartbeat, compiler, watchdog)


def _validation_names(ctx: RunContext, model: ModelPart, data: DataPart) -> list[str]:
    """The metrics validation will log, from one validation batch (see ``metric_names``)."""
    batches, _, spare = data.validation_batches(Heartbeat())
    return metric_names(model.strategy, ctx.task, batches, model.precision, spare)
