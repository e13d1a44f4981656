"""The pipeline's schedule, in one process (the stages' runs: tests/distributed/test_pipeline.py)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import ClassVar

import pytest
import torch
import torch.distributed.pipelining as pipelining
from torch import nn

import leantrain as lt
from leantrain.step.batching import BatchSplit
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.pipeline import Pipeline


class RecordingSchedule:
    """What a schedule ran first: torch prepares a stage once, for that (``eval`` or ``step``)."""

    made: ClassVar[list[RecordingSchedule]] = []

    def __init__(self, stage, n_microbatches, loss_fn, scale_grads) -> None:
        self.ran: list[str] = []
        RecordingSchedule.made.append(self)

    def eval(self, *args, **kwargs) -> None:
        self.ran.append("eval")

    def step(self, *args, **kwargs) -> None:
        self.ran.append("step")


class Precision:
    def autocast(self):
        return nullcontext()


def middle_stage(monkeypatch) -> Pipeline:
    """Stage 1 of 3 (neither first nor last: it feeds the schedule nothing), its schedule recorded."""
    RecordingSchedule.made = []
    monkeypatch.setattr(pipelining, "ScheduleGPipe", RecordingSchedule)
    pipeline = Pipeline(lt.TrainConfig(pipeline_schedule="gpipe"), torch.device("cpu"), ParallelDims(pp=3))
    pipeline.stage, pipeline.model = None, nn.Linear(3, 3)
    pipeline.is_first = pipeline.is_last = False
    pipeline.prepare_step(BatchSplit(4, 2), Precision())  # type: ignore[arg-type]
    return pipeline


def validate(pipeline: Pipeline) -> None:
    batches = [torch.zeros(2, 3)] * 2
    assert list(pipeline.forward_only(lambda model, batch: None, batches, pipeline.precision)) == []


def train(pipeline: Pipeline) -> None:
    no_agreement = lambda: None  # noqa: E731
    pipeline.forward_backward(lambda m, b: None, iter([torch.zeros(2, 3)] * 2), 2, None, None, no_agreement)


def test_a_validation_before_the_first_step_leaves_the_step_a_schedule_that_ran_nothing(monkeypatch):
    """torch 2.11 prepared a stage for what its schedule ran first: after eval(), the first training
    step failed ("for chunk 0 has gradients None and is expecting to send gradients to stage 0");
    a validation before training checks a metric's name (--early-stop-metric val_abs_error)."""
    pipeline = middle_stage(monkeypatch)
    validate(pipeline)
    train(pipeline)
    assert [schedule.ran for schedule in RecordingSchedule.made] == [["eval"], ["step"]]


def test_validations_after_training_keep_its_schedule(monkeypatch):
    pipeline = middle_stage(monkeypatch)
    train(pipeline)
    validate(pipeline)
    train(pipeline)
    assert [schedule.ran for schedule in RecordingSchedule.made] == [["step", "eval", "step"]]


def test_a_model_without_repeated_blocks_cannot_be_cut_into_stages_and_the_error_names_the_field():
    from leantrain.strategies.pipeline.stages import split_points

    with pytest.raises(lt.ConfigError, match="no ModuleList or Sequential of repeated blocks") as refused:
        split_points(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 2)
    assert refused.value.field == "pipeline_stages"


class FourBlocks(nn.Module):
    """Repeated blocks, and an input the model takes by keyword (as transformers' models do)."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(blocks))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x if scale is None else x * scale


def test_a_traced_model_is_cut_before_the_first_block_of_each_stage():
    from leantrain.strategies.pipeline.stages import split_points

    assert list(split_points(FourBlocks(), 2)) == ["blocks.2"]
    assert list(split_points(FourBlocks(2), 2)) == ["blocks.1"]
    assert list(split_points(FourBlocks(), 4)) == ["blocks.1", "blocks.2", "blocks.3"]


def test_a_model_is_traced_with_its_keyword_inputs_and_one_that_cannot_be_is_one_line():
    from leantrain.strategies.pipeline.stages import traced_pipe

    model, x, scale = FourBlocks(), torch.ones(2, 4), torch.tensor(2.0)
    pipe = traced_pipe(model, 2, ((x,), {"scale": scale}))
    assert pipe.num_stages == 2 and torch.allclose(pipe(x, scale=scale)[0], model(x, scale=scale))

    class Branches(FourBlocks):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2 if x.sum() > 0 else super().forward(x)  # data-dependent

    with pytest.raises(lt.ConfigError) as refused:
        traced_pipe(Branches(), 2, ((x,), {}))
    message = str(refused.value)
    assert message.startswith("invalid strategy='pipeline': could not trace the model into stages: ")
    assert len(message) > 100 and "\n" not in message  # torch's reason, on one line
