"""``--strategy pipeline --pipeline-stages N``: the model's consecutive parts on N processes.

Stages: the model must be an ``nn.Sequential`` (its children run one after the other). Its
repeated blocks are divided in order over the stages as for ``split``; the children around
them go to the first and last stage. Each process keeps its own children and replaces the
others by ``nn.Identity``, so parameter names stay those of the whole model (checkpoints and
weights merge without renaming) and the rest of the model's memory is freed.

A step: the accumulation micro-batches are the pipeline's micro-batches, run by
``torch.distributed.pipelining`` (``ScheduleGPipe``: all forwards, then all backwards;
``Schedule1F1B``: one forward, one backward once the pipe is full, fewer activations alive).
The task's own ``loss(model, batch)`` is used on both ends, unchanged: on the first stage
with a stand-in model that records what the loss passes to the model (the stage's inputs),
on the last stage with one that returns the pipeline's output. So the loss must call the
model exactly once per micro-batch (as under DDP).

With ``dp`` pipelines side by side (hybrid, ``ParallelDims``), gradients are averaged over
the data-parallel group after the schedule; loss normalisation is then the same as DDP's:
a mean loss weighted by micro x dp / global, a ``LossSum`` divided by the global count (one
all-reduce over all processes carries the count, the loss total and whether it is a sum,
which only the last stage knows). Gradient clipping uses the norm over all stages.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

from leantrain.batching import Accumulator, BatchPlan, LossFn, StepOutcome, StepStatus
from leantrain.data.loader import device_batches
from leantrain.errors import ConfigError, TaskError
from leantrain.evaluation import ValidationSums, batch_size_of
from leantrain.log.metrics import LossTracker
from leantrain.memory.checkpointing import CheckpointPolicy, matching_blocks
from leantrain.parallel.apply import Collectives
from leantrain.parallel.dims import ParallelDims
from leantrain.parallel.sharded_state import ShardedState
from leantrain.parallel.split import balanced_parts, placement
from leantrain.precision import GradReport
from leantrain.task import LossSum

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def example_inputs(
    task: Any, dataset: Any, micro_batch_size: int, device: torch.device
) -> tuple[tuple, dict]:
    """What the task's loss passes to the model for the first micro-batch (the tracer's example)."""
    from torch.utils.data import default_collate

    from leantrain.data.loader import move_to_device
    from leantrain.memory.plan import first_items

    batch = move_to_device(default_collate(first_items(dataset, micro_batch_size)), device)
    return _model_inputs(task.loss, batch)


def stage_children(model: nn.Sequential, stages: int) -> list[int]:
    """The stage of each child of ``model``: its repeated blocks divided in order, the other
    children with the block before them (or the first stage)."""
    where = placement(model, stages)
    found, current = [], 0
    for name, _ in model.named_children():
        current = where.get(name, current)
        found.append(current)
    return found


class PipelinePlan(ShardedState, Collectives):
    strategy = "pipeline"

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dims: ParallelDims,
        schedule: str,
        example_inputs: tuple[tuple, dict] | None = None,
    ) -> None:
        """``example_inputs``: the model's (args, kwargs) for one micro-batch, which the tracer
        needs for a model that is not an ``nn.Sequential``."""
        super().__init__(model, device)
        self.dims = dims
        rank = dist.get_rank()
        self.stage_index = self.dims.stage(rank)
        mesh = self.dims.mesh(device.type)
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.dims.pp - 1
        # Tied weights (one tensor, several names) may end up in several stages, as the same
        # tensor or as copies: their gradients are summed over the stages after each schedule.
        self.tied = [(names, model.get_parameter(names[0]).shape) for names in _shared_names(model)]
        if isinstance(model, nn.Sequential):
            for (name, _), stage in zip(
                list(model.named_children()), stage_children(model, self.dims.pp), strict=True
            ):
                if stage != self.stage_index:
                    model._modules[name] = nn.Identity()  # another process's part: freed here
            self.stage_module: nn.Module = model
            self.stage = PipelineStage(model, self.stage_index, self.dims.pp, device, group=self.pp_group)
        else:
            self.stage_module, self.stage = self._traced_stage(model, device, example_inputs)
            self.model = self.stage_module  # the whole model is not kept: its other stages are freed
        self.schedule_class = SCHEDULES[schedule]

    def _traced_stage(
        self, model: nn.Module, device: torch.device, example_inputs: tuple[tuple, dict] | None
    ) -> tuple[nn.Module, PipelineStage]:
        """Cut the model's traced graph before the first block of each stage but the first."""
        if example_inputs is None:
            raise ConfigError(
                "strategy", "pipeline", "needs example inputs to trace a model that is not a Sequential"
            )
        blocks = [name for name, _ in matching_blocks(model, CheckpointPolicy(field="pipeline_stages"))]
        parts = balanced_parts(len(blocks), self.dims.pp)
        split_spec = {
            blocks[i]: SplitPoint.BEGINNING for i in range(1, len(blocks)) if parts[i] != parts[i - 1]
        }
        args, kwargs = example_inputs
        try:
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None, split_spec=split_spec)
        except Exception as error:  # torch.export's errors: the model's forward could not be traced
            reason = " ".join(str(error).split())[:300]
            raise ConfigError(
                "strategy", "pipeline", f"could not trace the model into stages: {reason}"
            ) from None
        stage = pipe.build_stage(self.stage_index, device, group=self.pp_group)
        return stage.submod, stage

    @property
    def state_module(self) -> nn.Module:
        return self.stage_module

    def optimizer_params(self, prepared: list[nn.Parameter]) -> list[nn.Parameter]:
        return list(self.stage_module.parameters())  # this stage's: the others are gone

    def trained_weights(self, precision: Any) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0: every stage's part, merged (a collective)."""
        mine = {k: v.detach().cpu() for k, v in self.stage_module.state_dict().items()}
        for names, _ in self.tied:  # one name per tied tensor, as a single process exports it
            for name in sorted(names)[1:]:
                mine.pop(name, None)
        merged: dict[str, torch.Tensor] = {}
        for part in self.gather(mine if self.dims.pipeline(dist.get_rank()) == 0 else {}):
            merged.update(part)
        return merged if dist.get_rank() == 0 else {}

    def accumulator(
        self, plan: BatchPlan, precision: Any, max_grad_norm: float | None, agree_on_oom: Any
    ) -> Any:
        self._accumulator = PipelineAccumulator(plan, precision, self, max_grad_norm)
        return self._accumulator

    def evaluate(self, task: Any, batches: Any, precision: Any, all_reduce_sum: Any) -> dict[str, float]:
        """Validation through the pipeline (forward only), with the training step's schedule."""
        return self._accumulator.evaluate(task, batches)


def _shared_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that name one tensor (tied weights)."""
    by_tensor: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(parameter), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.args, self.kwargs = args, kwargs


class _Recorder(nn.Module):
    """Stands in for the model on the first stage: records the inputs the loss gives it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)


class _Replay(nn.Module):
    """Stands in for the model on the last stage: returns the pipeline's output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _model_inputs(loss_fn: LossFn, batch: Any) -> tuple[tuple, dict]:
    try:
        loss_fn(_Recorder(), batch)
    except _Captured as captured:
        return captured.args, captured.kwargs
    raise TaskError("task.loss did not call the model: a pipeline needs the model's inputs")


def _concatenate(values: list[Any]) -> Any:
    """Micro-batch inputs joined along the batch dimension (the schedule cuts them again)."""
    first = values[0]
    return torch.cat(values) if isinstance(first, torch.Tensor) else first


class PipelineAccumulator(Accumulator):
    """One optimizer step through the pipeline schedule; the same outcome as ``Accumulator``."""

    def __init__(self, plan: BatchPlan, precision: Any, pipeline: PipelinePlan, max_grad_norm: float | None):
        super().__init__(
            plan,
            precision,
            pipeline.stage_module.parameters(),
            max_grad_norm,
            all_reduce_sum=pipeline.all_reduce_sum,
        )
        self.pipeline = pipeline
        self._micro: list[Any] = []
        self._loss_fn: LossFn | None = None
        # Per micro-batch index (last stage): its LossSum count (or None), loss term, log entry.
        # By index, not in call order: the schedule may call the loss once more at start-up.
        self._results: dict[int, tuple[Any, torch.Tensor, LossTracker]] = {}
        self._step_index = 0
        if pipeline.schedule_class is Schedule1F1B and plan.accumulation_steps < pipeline.dims.pp:
            raise ConfigError(
                "pipeline_schedule",
                "1f1b",
                f"needs at least as many micro-batches per step ({plan.accumulation_steps}) as stages "
                f"({pipeline.dims.pp}): set a smaller micro_batch_size, or gpipe",
            )
        self.schedule = pipeline.schedule_class(
            pipeline.stage,
            n_microbatches=plan.accumulation_steps,
            loss_fn=self._last_stage_loss,
            scale_grads=False,
        )

    def evaluate(self, task: Any, batches: Any) -> dict[str, float]:
        """The task's loss and metrics over the validation data, run through the pipeline.

        Every stage reads the same validation batches; they go through the schedule ``k`` at
        a time (``k`` = the micro-batches of a training step: the stages were built for that
        shape), and a last incomplete group is left out. The last stages hold the sums; one
        gather over all processes gives every rank the same result.
        """
        pipeline, k = self.pipeline, self.plan.accumulation_steps
        metrics_fn = getattr(task, "metrics", None)
        sums = ValidationSums()

        outputs: dict[int, tuple[Any, dict[str, Any]]] = {}  # by batch: once, however often called

        def evaluated(model: nn.Module, batch: Any) -> torch.Tensor:
            loss = task.loss(model, batch)
            outputs[id(batch)] = (loss, metrics_fn(model, batch) if callable(metrics_fn) else {})
            return loss.sum if isinstance(loss, LossSum) else loss

        stage_module = pipeline.stage_module
        was_training = stage_module.training
        stage_module.eval()
        try:
            group: list[Any] = []
            for batch in device_batches(batches, pipeline.device, self.precision.input_dtype):
                if batch_size_of(batch) != self.plan.micro_batch_size:
                    break  # the last, shorter batch: the stages' shapes are fixed
                group.append(batch)
                if len(group) == k:
                    with torch.no_grad():
                        self._run_schedule(group, evaluated, self.schedule.eval)
                    for done in group if pipeline.is_last else ():
                        sums.add_batch(*outputs.pop(id(done)), batch_size_of(done))
                    group = []
        finally:
            stage_module.train(was_training)
        names, totals = sums.totals(torch.device("cpu"))
        merged: dict[str, list[float]] = {}
        for part in pipeline.gather(dict(zip(names, totals.tolist(), strict=True))):
            for name, (total, weight) in part.items():
                merged.setdefault(name, [0.0, 0.0])
                merged[name][0] += total
                merged[name][1] += weight
        return {f"val_{name}": total / max(weight, 1e-12) for name, (total, weight) in sorted(merged.items())}

    def _run_schedule(self, micro: list[Any], loss_fn: LossFn, run: Any) -> None:
        """Feed ``micro`` through ``run`` (the schedule's step or eval): inputs on the first stage,
        micro-batch indices as the last stage's targets."""
        pipeline, k = self.pipeline, len(micro)
        self._micro, self._loss_fn, self._results = micro, loss_fn, {}
        args: tuple = ()
        kwargs: dict = {}
        if pipeline.is_first:
            inputs = [_model_inputs(loss_fn, batch) for batch in micro]
            args = tuple(_concatenate([a[i] for a, _ in inputs]) for i in range(len(inputs[0][0])))
            kwargs = {key: _concatenate([kw[key] for _, kw in inputs]) for key in inputs[0][1]}
        with self.precision.autocast():
            if pipeline.is_last:
                run(*args, target=torch.arange(k), **kwargs)
            else:
                run(*args, **kwargs)

    def _last_stage_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the task's loss of micro-batch ``index`` (a [1] tensor)."""
        assert self._loss_fn is not None
        micro = int(index[0])
        loss = self._loss_fn(_Replay(output), self._micro[micro])
        counts: list[Any] = []
        entry = LossTracker()
        term = self._backward_term(loss, 0, counts, self._step_index, entry)
        self._results[micro] = (counts[0] if counts else None, term.detach(), entry)
        return term

    def step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        batches: Iterator[Any],
        step_index: int,
        tracker: LossTracker,
        inspect_grads: bool = False,
    ) -> StepOutcome:
        pipeline, k = self.pipeline, self.plan.accumulation_steps
        self._step_index = step_index
        self._run_schedule([next(batches) for _ in range(k)], loss_fn, self.schedule.step)
        results = [self._results[micro] for micro in range(k)] if pipeline.is_last else []
        if len({count is None for count, _, _ in results}) > 1:
            raise TaskError("task.loss returned a LossSum for some micro-batches and a mean for others")
        for _, _, entry in results:
            tracker.extend(entry)
        if not pipeline.is_last:  # the same log entries as the last stage's, empty
            for _ in range(k):
                tracker.add(step_index, torch.zeros((), dtype=torch.float64), 0, True)
        self._sum_tied_gradients()
        grads = [p.grad for p in self.params if p.grad is not None]
        if pipeline.dims.dp > 1 and grads:
            self._average_over_pipelines(grads)
        total = self._reduce_loss_and_scale(grads, results)
        norm = None if self.max_grad_norm is None else self._clip_over_stages(grads)
        status = self._check_finite(total, GradReport(norm, None))
        if status is StepStatus.STEPPED:
            self.precision.step(optimizer)
        else:
            self.precision.skip_step(overflowed=False)
        self.precision.zero_grad(optimizer)
        return StepOutcome(status, norm, None)

    def _sum_tied_gradients(self) -> None:
        """Each stage holding a tied weight (or a copy) gets the sum of every use's gradient."""
        if not self.pipeline.tied:
            return
        held = dict(self.pipeline.stage_module.named_parameters(remove_duplicate=False))
        copies, sums = [], []
        for names, shape in self.pipeline.tied:
            mine = list({id(held[n]): held[n] for n in names if n in held}.values())
            grads = [p.grad for p in mine if p.grad is not None]
            copies.append(mine)
            sums.append(torch.stack(grads).sum(0) if grads else torch.zeros(shape, dtype=self._grad_dtype()))
        flat = _flatten_dense_tensors(sums)
        dist.all_reduce(flat, group=self.pipeline.pp_group)
        for mine, total in zip(copies, _unflatten_dense_tensors(flat, sums), strict=True):
            for parameter in mine:
                parameter.grad = total.clone()

    def _grad_dtype(self) -> torch.dtype:
        return next((p.dtype for p in self.params), torch.float32)

    def _average_over_pipelines(self, grads: list[torch.Tensor]) -> None:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.pipeline.dp_group)
        flat /= self.pipeline.dims.dp
        torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))

    def _reduce_loss_and_scale(self, grads: list[torch.Tensor], results: list[tuple]) -> torch.Tensor:
        """One all-reduce over every process: [is a LossSum, its count, the loss total].

        Only the last stages know them; the others add zeros. A LossSum's gradients are then
        scaled by dp / global count (after the average over pipelines), on the device."""
        counts = [count for count, _, _ in results if count is not None]
        device = self.pipeline._comm_device()  # NCCL reduces device tensors, gloo host ones
        zero = torch.zeros((), dtype=torch.float64, device=device)
        local = torch.stack([
            torch.tensor(1.0 if counts else 0.0, dtype=torch.float64, device=device),
            torch.as_tensor(sum(counts), dtype=torch.float64).to(device) if counts else zero,
            torch.stack([term.double().to(device) for _, term, _ in results]).sum() if results else zero,
        ])  # fmt: skip
        is_sum, count, total = self.all_reduce_sum(local)
        if grads:
            factor = torch.where(is_sum > 0, self.pipeline.dims.dp / count.clamp(min=1), 1.0)
            torch._foreach_mul_(grads, factor.to(grads[0].device, grads[0].dtype))
        return total

    def _clip_over_stages(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: each stage holds part of it."""
        device = self.pipeline._comm_device()
        squares = torch.zeros((), dtype=torch.float64, device=device)
        if grads:
            squares = torch.stack([g.double().pow(2).sum() for g in grads]).sum().to(device)
        dist.all_reduce(squares, group=self.pipeline.pp_group)
        norm = squares.sqrt()
        if grads:
            coefficient = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coefficient.to(grads[0].device, grads[0].dtype))
        return norm
