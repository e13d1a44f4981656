"""Cutting a model into pipeline stages, and what the task's loss gives the model.

An ``nn.Sequential`` is cut between its children: each process keeps its own children and
replaces the others by ``nn.Identity``, so parameter names stay those of the whole model.
Any other model is traced (``torch.distributed.pipelining.pipeline``) and its graph cut before
the first block of each stage but the first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from leantrain.blocks import BlockPolicy, matching_blocks
from leantrain.errors import ConfigError, TaskError, one_line
from leantrain.step.accumulator import LossFn
from leantrain.strategies.split import balanced_parts, placement


def stage_children(model: nn.Sequential, stages: int) -> list[int]:
    """The stage of each child of ``model``: its repeated blocks divided in order, the other
    children with the block before them (or the first stage)."""
    where = placement(model, stages)
    found, current = [], 0
    for name, _ in model.named_children():
        current = where.get(name, current)
        found.append(current)
    return found


def keep_stage(model: nn.Sequential, stage: int, stages: int) -> None:
    """Replace the children of the other stages by ``nn.Identity`` (their memory is freed)."""
    for (name, _), where in zip(list(model.named_children()), stage_children(model, stages), strict=True):
        if where != stage:
            model._modules[name] = nn.Identity()


def split_points(model: nn.Module, stages: int) -> dict[str, Any]:
    """The tracer's split spec: cut before the first block of each stage but the first."""
    from torch.distributed.pipelining import SplitPoint

    blocks = [name for name, _ in matching_blocks(model, BlockPolicy(field="pipeline_stages"))]
    parts = balanced_parts(len(blocks), stages)
    return {blocks[i]: SplitPoint.BEGINNING for i in range(1, len(blocks)) if parts[i] != parts[i - 1]}


def traced_pipe(model: nn.Module, stages: int, inputs: tuple[tuple, dict]) -> Any:
    """The model traced and cut into ``stages``; a ConfigError when it cannot be traced."""
    from torch.distributed.pipelining import pipeline

    args, kwargs = inputs
    try:
        return pipeline(model, mb_args=args, mb_kwargs=kwargs or None, split_spec=split_points(model, stages))
    except Exception as error:  # torch.export's errors: the model's forward could not be traced
        reason = f"could not trace the model into stages: {one_line(error)}"
        raise ConfigError("strategy", "pipeline", reason) from None


def shared_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that name one tensor (tied weights)."""
    by_tensor: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(parameter), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


class _Captured(BaseException):
    """Not an Exception: ``except Exception`` in the task's loss, or around it (the engine's notes
    on errors raised in the task's code), must let it through."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.args, self.kwargs = args, kwargs


class _Recorder(nn.Module):
    """Stands in for the model on the first stage: records the inputs the loss gives it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)


class Replay(nn.Module):
    """Stands in for the model on the last stage: returns the pipeline's output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def model_inputs(loss_fn: LossFn, batch: Any) -> tuple[tuple, dict]:
    """What ``loss_fn`` passes to the model for ``batch``: the first stage's inputs."""
    try:
        loss_fn(_Recorder(), batch)
    except _Captured as captured:
        return captured.args, captured.kwargs
    raise TaskError("task.loss did not call the model: a pipeline needs the model's inputs")


def concatenate(values: list[Any]) -> Any:
    """Micro-batch inputs joined along the batch dimension (the schedule cuts them again)."""
    first = values[0]
    return torch.cat(values) if isinstance(first, torch.Tensor) else first
