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

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils._pytree import tree_map_only

from leantrain.config import TrainConfig
from leantrain.errors import ConfigError, TaskError
from leantrain.step.accumulator import LossFn, MicroLoss, TermFn
from leantrain.step.batching import BatchSplit
from leantrain.step.compilation import compile_forward
from leantrain.step.evaluation import LossAndMetrics, batch_size_of
from leantrain.step.precision import Precision
from leantrain.strategies.base import Example
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.pipeline.stages import (
    Replay,
    concatenate,
    keep_stage,
    model_inputs,
    shared_names,
    traced_pipe,
)
from leantrain.strategies.process_group import Collectives, all_reduce_in_place
from leantrain.strategies.sharded_state import ShardedState
from leantrain.task import LossSum


class Pipeline(ShardedState, Collectives):
    name = "pipeline"
    summary = "the model's consecutive stages on pipeline_stages processes (pipelines side by side: hybrid)"
    needs = ("pipeline_stages",)
    simulated = False  # its stages hold different parts: plan --cluster simulates one rank for all

    @classmethod
    def check(cls, cfg: TrainConfig, world_size: int | None) -> None:
        if world_size and world_size > 1:  # one process: checked when launched
            cls.dims(cfg, world_size)

    @classmethod
    def dims(cls, cfg: TrainConfig, world_size: int) -> ParallelDims:
        return ParallelDims.of(world_size, cfg.pipeline_stages)

    @classmethod
    def check_task(cls, task: Any) -> None:
        if callable(getattr(task, "augment", None)):
            # The first and the last stage each run the task's loss: they would augment differently.
            raise TaskError("task.augment is not supported under strategy pipeline yet")

    def wrap(self, model: nn.Module, example: Example | None) -> None:
        from torch.distributed.pipelining import PipelineStage

        rank = dist.get_rank()
        self.stage_index = self.dims.stage(rank)
        mesh = self.dims.mesh(self.device.type)
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.dims.pp - 1
        # Tied weights (one tensor, several names) may end up in several stages, as the same
        # tensor or as copies: their gradients are summed over the stages after each schedule.
        self.tied = [(names, model.get_parameter(names[0]).shape) for names in shared_names(model)]
        self._uncounted: list[nn.Parameter] | None = None  # see _uncounted_copies
        if isinstance(model, nn.Sequential):
            keep_stage(model, self.stage_index, self.dims.pp)
            self.stage = PipelineStage(
                model, self.stage_index, self.dims.pp, self.device, group=self.pp_group
            )
        else:
            if example is None:
                raise ConfigError(
                    "strategy", "pipeline", "needs example inputs to trace a model that is not a Sequential"
                )
            pipe = traced_pipe(model, self.dims.pp, model_inputs(example.loss_fn, example.batch()))
            self.stage = pipe.build_stage(self.stage_index, self.device, group=self.pp_group)
            if self.cfg.compile != "none":
                # Tracing ran the blocks' code, not their compiled form: the stage is a new module,
                # compiled here as one (its blocks are no longer modules of their own class).
                compile_forward(self.stage.submod, self.cfg.compile_options)
                self.notes.append(f"compile {self.cfg.compile}: this traced stage compiled as one module")
        # This process keeps its stage only: a traced stage is a new module, and the whole
        # model, dropped by the caller, frees the other stages.
        self.model = self.module = self.stage.submod

    def optimizer_params(self, prepared: list[nn.Parameter]) -> list[nn.Parameter]:
        return list(self.model.parameters())  # this stage's: the others are gone

    def trained_weights(
        self, precision: Precision, frozen: frozenset[str] = frozenset()
    ) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0, but for the ``frozen`` names: every stage's part,
        merged (a collective)."""
        mine = {k: v.detach().cpu() for k, v in self.model.state_dict().items() if k not in frozen}
        # One name per tied tensor, its first (registration order), as a single process exports it.
        for names, _ in self.tied:
            for name in names[1:]:
                mine.pop(name, None)
        merged: dict[str, torch.Tensor] = {}
        for part in self.gather(mine if self.dims.data_rank(dist.get_rank()) == 0 else {}):
            merged.update(part)
        return merged if dist.get_rank() == 0 else {}

    # -- one step: the accumulation micro-batches are the pipeline's micro-batches ----------

    def prepare_step(self, split: BatchSplit, precision: Precision) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        k = split.accumulation_steps
        if self.cfg.pipeline_schedule == "1f1b" and k < self.dims.pp:
            raise ConfigError(
                "pipeline_schedule",
                "1f1b",
                f"needs at least as many micro-batches per step ({k}) as stages "
                f"({self.dims.pp}): set a smaller micro_batch_size, or gpipe",
            )
        schedule_class = Schedule1F1B if self.cfg.pipeline_schedule == "1f1b" else ScheduleGPipe
        self.split, self.precision = split, precision
        self._new_schedule = lambda: schedule_class(
            self.stage, n_microbatches=k, loss_fn=self._last_stage_loss, scale_grads=False
        )
        self.schedule = self._new_schedule()
        self._schedule_trained = False  # whether the schedule ran a training step
        self._micro: list[Any] = []
        self._loss_fn: LossFn | None = None
        self._term: TermFn | None = None
        # Per micro-batch index (last stage): its loss. By index, not in call order: the schedule
        # may call the loss once more at start-up.
        self._results: dict[int, MicroLoss] = {}

    def forward_backward(
        self,
        loss_fn: LossFn,
        batches: Iterator[Any],
        count: int,
        term: TermFn,
        precision: Precision,
        before_last_backward: Callable[[], None],
    ) -> list[MicroLoss]:
        micro = [next(batches) for _ in range(count)]
        before_last_backward()  # the schedule interleaves backwards: agree before any
        self._term = term
        self._schedule_trained = True
        self._run_schedule(micro, loss_fn, self.schedule.step)
        return [self._results[index] for index in range(count)] if self.is_last else []

    def _run_schedule(self, micro: list[Any], loss_fn: LossFn, run: Callable[..., Any]) -> None:
        """Feed ``micro`` through ``run`` (the schedule's step or eval): inputs on the first stage,
        micro-batch indices as the last stage's targets."""
        self._micro, self._loss_fn, self._results = micro, loss_fn, {}
        args: tuple = ()
        kwargs: dict = {}
        if self.is_first:
            inputs = [model_inputs(loss_fn, batch) for batch in micro]
            args = tuple(concatenate([a[i] for a, _ in inputs]) for i in range(len(inputs[0][0])))
            kwargs = {key: concatenate([kw[key] for _, kw in inputs]) for key in inputs[0][1]}
        with self.precision.autocast():
            if self.is_last:
                run(*args, target=torch.arange(len(micro)), **kwargs)
            else:
                run(*args, **kwargs)

    def _last_stage_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the task's loss of micro-batch ``index`` (a [1] tensor)."""
        assert self._loss_fn is not None and self._term is not None
        micro = int(index[0])
        result = self._term(self._loss_fn(Replay(output), self._micro[micro]), micro)
        self._results[micro] = result.after_backward()  # the schedule runs backward on the term
        return result.term

    def finish_gradients(self, params: list[torch.Tensor]) -> None:
        self._sum_tied_gradients(params)
        grads = [p.grad for p in params if p.grad is not None]
        if self.dims.dp > 1 and grads:
            all_reduce_in_place(grads, self.dp_group, divide_by=self.dims.dp)

    def _sum_tied_gradients(self, params: list[torch.Tensor]) -> None:
        """Each stage holding a tied weight (or a copy) gets the sum of every use's gradient."""
        if not self.tied:
            return
        grad_dtype = next((p.dtype for p in params), torch.float32)
        copies, sums = self._tied_copies(), []
        for mine, (_, shape) in zip(copies, self.tied, strict=True):
            grads = [p.grad for p in mine if p.grad is not None]
            sums.append(torch.stack(grads).sum(0) if grads else torch.zeros(shape, dtype=grad_dtype))
        flat = _flatten_dense_tensors(sums)
        dist.all_reduce(flat, group=self.pp_group)
        for mine, total in zip(copies, _unflatten_dense_tensors(flat, sums), strict=True):
            for parameter in mine:
                parameter.grad = total.clone()

    def _tied_copies(self) -> list[list[nn.Parameter]]:
        """For each tied weight, the parameters of this stage that hold it (none, one, or copies)."""
        held = dict(self.model.named_parameters(remove_duplicate=False))
        return [list({id(held[n]): held[n] for n in names if n in held}.values()) for names, _ in self.tied]

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of the whole model's gradient: each stage holds part of it, and a tied weight's
        gradient, summed into every copy, counts once (as in one process: clipping must agree)."""
        uncounted = {id(p.grad) for p in self._uncounted_copies() if p.grad is not None}
        counted = [g for g in grads if id(g) not in uncounted]
        squares = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        if counted:
            squares = torch.stack([g.double().pow(2).sum() for g in counted]).sum().to(self.comm_device)
        dist.all_reduce(squares, group=self.pp_group)
        return squares.sqrt()

    def _uncounted_copies(self) -> list[nn.Parameter]:
        """Every copy of a tied weight but one, the first copy on the first stage that holds it
        (agreed once, over the stages, at the first norm)."""
        if self._uncounted is None:
            copies = self._tied_copies()
            self._uncounted = []
            if copies:
                held_from = [self.stage_index if mine else self.dims.pp for mine in copies]
                first = torch.tensor(held_from, device=self.comm_device)
                dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.pp_group)
                for mine, owner in zip(copies, first.tolist(), strict=True):
                    self._uncounted += mine if owner != self.stage_index else mine[1:]
        return self._uncounted

    def forward_only(
        self, loss_and_metrics: LossAndMetrics, batches: Iterable[Any], precision: Precision
    ) -> Iterator[tuple[Any, dict[str, Any], int]]:
        """Validation through the pipeline, with the training step's schedule.

        Every stage reads the same validation batches; they go through the schedule ``k`` at a
        time (``k`` = the micro-batches of a training step), in the shape the stages were built
        for: a shorter last batch is padded with copies of its last sample, and a last incomplete
        group with copies of its last batch. The last stages yield the losses of the real samples
        only (the padded rows' outputs are cut off before the task's loss sees them).
        """
        # By the id of the batch the stages run (a new object for each entry, padded or not): the
        # batch as it came and its samples; the last stage's loss and metrics of it.
        real: dict[int, tuple[Any, int]] = {}
        outputs: dict[int, tuple[Any, dict[str, Any]]] = {}

        def evaluated(model: nn.Module, batch: Any) -> Any:
            if not isinstance(model, Replay):  # the first stage records the inputs: the padded batch's
                return loss_and_metrics(model, batch)[0]
            came, samples = real[id(batch)]
            outputs[id(batch)] = loss_and_metrics(Replay(_first_rows(model.output, samples)), came)
            return outputs[id(batch)][0]

        def run(group: list[Any]) -> Iterator[tuple[Any, dict[str, Any], int]]:
            padded = [*group, *[group[-1]] * (self.split.accumulation_steps - len(group))]
            with torch.no_grad():
                self._run_schedule(padded, evaluated, self.schedule.eval)
            for batch in group if self.is_last else ():
                yield *outputs[id(batch)], real[id(batch)][1]
            real.clear()
            outputs.clear()

        self._term = _schedule_term
        was_training = self.model.training
        self.model.eval()
        try:
            group: list[Any] = []
            for batch in batches:
                samples = batch_size_of(batch)
                full = _padded_rows(batch, samples, self.split.micro_batch_size)
                real[id(full)] = (batch, samples)
                group.append(full)
                if len(group) == self.split.accumulation_steps:
                    yield from run(group)
                    group = []
            if group:
                yield from run(group)
        finally:
            self.model.train(was_training)
            if not self._schedule_trained:
                # A schedule prepares its stage once, for what it runs first. torch 2.11's, prepared
                # by eval() (the stage's received activations need no gradient), failed at its first
                # training step: "for chunk 0 has gradients None and is expecting to send gradients
                # to stage 0" (later torch prepares it again). Validating before any step (a metric
                # other than val_loss is checked on one batch) leaves a fresh one to training.
                self.schedule = self._new_schedule()


def _padded_rows(batch: Any, samples: int, rows: int) -> Any:
    """``batch`` with ``rows`` samples: its tensors' batch dimension filled up with its last sample
    (always a new object, the tensors views where nothing is added)."""

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != samples or samples == rows:
            return tensor.view_as(tensor)
        return torch.cat([tensor, tensor[-1:].expand(rows - samples, *tensor.shape[1:])])

    return tree_map_only(torch.Tensor, pad, batch)


def _first_rows(output: Any, samples: int) -> Any:
    """The pipeline's output for the first ``samples`` rows (the others were padding)."""
    return tree_map_only(torch.Tensor, lambda t: t[:samples] if t.dim() else t, output)


def _schedule_term(loss: Any, micro: int) -> MicroLoss:
    """A validation loss as the schedule needs it: a tensor (nothing is weighted or logged)."""
    value = loss.sum if isinstance(loss, LossSum) else loss
    return MicroLoss(value, value, None, 0)
