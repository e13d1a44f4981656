"""Micro-batches that fit: the search, the budget, halving after out-of-memory; the math never changes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain.memory.adaptive import AllocatorRetries, next_smaller, search_micro_batch
from leantrain.memory.estimate import estimate_memory
from leantrain.run import data
from leantrain.step.accumulator import Accumulator, StepStatus
from leantrain.step.batching import BatchSplit
from leantrain.step.losses import LossTracker
from leantrain.step.precision import Fp32
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.single import Single
from tests.conftest import HeavyFromStep, RegressionTask
from tests.data.test_stream_resume import StreamTask


def test_the_search_doubles_then_bisects():
    choices = [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    tried = []

    def fits(size):
        tried.append(size)
        return size <= 12

    assert search_micro_batch(fits, choices) == 12
    assert tried == [1, 2, 4, 8, 16, 12]  # doubling up to 16 (too big), then between 8 and 16
    assert search_micro_batch(lambda size: True, choices) == 48
    tried.clear()
    assert search_micro_batch(lambda size: tried.append(size) or size <= 10, choices) == 8
    assert tried == [1, 2, 4, 8, 16, 12]  # 12 does not fit either: 8 is the largest
    # none twice as large as the last that fits: the next one, then the one after it
    assert search_micro_batch(lambda size: True, [4, 6]) == 6
    assert search_micro_batch(lambda size: True, [4, 6, 7]) == 7
    with pytest.raises(lt.LeantrainError) as error:
        search_micro_batch(lambda size: False, choices)
    assert str(error.value) == (
        "even a micro-batch of 1 does not fit in memory: raise memory_budget, use 16-bit precision or "
        "activation_checkpointing"
    )


def test_the_search_runs_micro_batches_as_training_feeds_them_and_says_what_it_tried():
    """Its trial batches are collated and cast as the run's are (here bf16 inputs for a bf16 model),
    a batch that cannot be collated names its items, and the run log gets what was tried."""
    from leantrain.cluster import ClusterEnv
    from leantrain.errors import CollateError
    from leantrain.memory.adaptive import MicroBatchSizer
    from leantrain.step.precision import make_precision

    task, cpu = RegressionTask(), torch.device("cpu")
    precision = make_precision("bf16-true", cpu)
    model = task.model()
    precision.prepare(model)
    cfg = lt.TrainConfig(global_batch_size=16, micro_batch_size="auto", memory_budget="1GB")
    sizer = MicroBatchSizer(task, cfg, precision, model, cpu, ClusterEnv("single"))
    assert sizer.search(BatchSplit(16, 16), task.train_data()) == 16
    assert sizer.notes[-1] == "micro_batch_size auto: 16 (tried 1, 2, 4, 8, 16)"
    uneven = [
        (torch.zeros(6), torch.zeros(1), torch.ones(1)),
        (torch.zeros(7), torch.zeros(1), torch.ones(1)),
    ] * 8
    with pytest.raises(CollateError, match=r"^train_data items 0 and 1 differ"):
        sizer.search(BatchSplit(16, 16), uneven)


def test_auto_on_a_gpu_needs_no_budget_its_allocator_says_what_does_not_fit(monkeypatch):
    """Through fakes of the two CUDA calls the search makes here (the allocator's statistics, the copy
    of each trial batch to the GPU): the CPU plays the GPU."""
    from leantrain.cluster import ClusterEnv
    from leantrain.memory import adaptive

    copied = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    monkeypatch.setattr(
        adaptive, "move_to_device", lambda batch, device, dtype: copied.append(device) or batch
    )
    task, gpu = RegressionTask(), torch.device("cuda")
    cfg = lt.TrainConfig(global_batch_size=16, micro_batch_size="auto")
    sizer = adaptive.MicroBatchSizer(task, cfg, Fp32(), task.model(), gpu, ClusterEnv("single"))
    assert sizer.search(BatchSplit(16, 16), task.train_data()) == 16
    assert copied == [gpu] * 5  # each trial's batch to the GPU: 1, 2, 4, 8, 16


def test_halving_takes_the_largest_choice_at_most_half():
    assert next_smaller([1, 2, 3, 4, 6, 12], 12) == 6
    assert next_smaller([1, 2, 3, 4, 6, 12], 6) == 3
    assert next_smaller([1, 2, 4], 1) is None


def test_allocator_retries_in_several_steps_in_a_row_call_for_smaller_micro_batches():
    counts = iter([0, 1, 2, 3, 3, 4, 5, 6])
    retries = AllocatorRetries(lambda: {"num_alloc_retries": next(counts)}, steps_in_a_row=3)
    assert [retries.too_many() for _ in range(7)] == [False, False, True, False, False, False, True]


def budget_for(task, micro: int, **config) -> str:
    """A budget in which exactly the micro-batches up to ``micro`` fit (no margin)."""
    rows = {row.micro_batch_size: row for row in estimate_memory(task, lt.TrainConfig(**config)).rows}
    fits, too_big = (
        rows[micro].memory.total_bytes,
        min(r.memory.total_bytes for s, r in rows.items() if s > micro),
    )
    return str((fits + too_big) // 2)


def test_auto_picks_what_fits_and_trains_exactly_as_that_micro_batch_fixed(fit):
    budget = budget_for(HeavyFromStep(), 4, global_batch_size=16)
    auto = fit(
        HeavyFromStep(), global_batch_size=16, micro_batch_size="auto", memory_budget=budget, max_steps=6
    )
    assert auto.micro_batch_size == 4 and auto.accumulation_steps == 4
    fixed = fit(HeavyFromStep(), global_batch_size=16, micro_batch_size=4, max_steps=6)
    for name, value in fixed.model.state_dict().items():
        assert float((auto.model.state_dict()[name] - value).abs().max()) <= 1e-10, name


def test_an_out_of_memory_step_halves_the_micro_batch_and_is_run_again(fit):
    """After step 3, each micro-batch of 8 needs more than the budget allows."""
    budget = budget_for(HeavyFromStep(), 4, global_batch_size=16)
    with pytest.warns(
        lt.LeantrainWarning, match=r"out of memory at step 4: micro-batch 8 -> 4 \(x 4 accumulation\)"
    ):
        task = HeavyFromStep(heavy=False, after_step=3)
        result = fit(task, callbacks=[task], global_batch_size=16, micro_batch_size=8, memory_budget=budget,
                     max_steps=8)  # fmt: skip
    assert result.micro_batch_size == 4 and result.steps == 8
    reference = fit(RegressionTask(), global_batch_size=16, micro_batch_size=16, max_steps=8)
    for name, value in reference.model.state_dict().items():
        assert float((result.model.state_dict()[name] - value).abs().max()) <= 1e-10, name
    assert math.isfinite(result.final_train_loss)


class HeavyStream(HeavyFromStep, StreamTask):
    """HeavyFromStep's loss over RegressionTask's data as a stream that counts what it reads and says
    where it is (``state_dict``); ``streams``: every one it made."""

    def train_data(self):
        self.streams = [*getattr(self, "streams", []), super().train_data()]
        return self.streams[-1]


def test_after_out_of_memory_a_stream_goes_on_from_its_saved_state(fit):
    """The smaller micro-batches come from the stream's next samples, read from where the stream was,
    not again from its start (the fallback of a stream without state: 3 steps re-read here)."""
    budget = budget_for(HeavyFromStep(), 4, global_batch_size=16)
    task = HeavyStream(heavy=False, after_step=3)
    with pytest.warns(lt.LeantrainWarning, match=r"out of memory at step 4: micro-batch 8 -> 4"):
        result = fit(task, callbacks=[task], global_batch_size=16, micro_batch_size=8, memory_budget=budget,
                     max_steps=8, num_workers=0)  # fmt: skip
    read = max(stream.produced for stream in task.streams)  # the training stream's (others: a probe)
    assert read <= 8 * 16 + 16, read  # at most the step that ran out of memory, twice
    reference = fit(StreamTask(), global_batch_size=16, micro_batch_size=16, max_steps=8, num_workers=0)
    for name, value in reference.model.state_dict().items():
        assert float((result.model.state_dict()[name] - value).abs().max()) <= 1e-10, name


def test_a_restart_hands_the_new_loader_this_processs_position_and_token_counts(monkeypatch):
    """What each process restarts from after out of memory: its own token counts (rank 0's checkpoint
    default would be wrong on the others) and the streams' positions after the step."""
    position = SimpleNamespace(
        names=["web"], tokens=lambda step: [700 + step], after=lambda step: [{"read": step}]
    )
    calls = []
    monkeypatch.setattr(data, "build_train_loader", lambda *args: calls.append(args) or (None, 0, 0))
    schedule = SimpleNamespace(total_steps=8)
    part = data.DataPart(SimpleNamespace(cfg="cfg", data_env="env"), "train", schedule, BatchSplit(16, 8), 0,
                         (SimpleNamespace(position=position), None), 0, "pinned", None)  # fmt: skip
    part.restart(BatchSplit(16, 4), 3)
    saved = {"step": 3, "sources": ["web"], "positions": [{"read": 3}], "tokens": [703]}
    assert calls == [("train", "cfg", "env", BatchSplit(16, 4), 8, 3, "pinned", saved, [703])]


def test_auto_on_the_cpu_needs_a_budget_and_a_budget_must_hold_the_weights(fit):
    with pytest.raises(lt.LeantrainError) as error:
        fit(RegressionTask(), global_batch_size=16, micro_batch_size="auto", max_steps=1)
    assert str(error.value) == (
        "micro_batch_size auto needs memory_budget on this device: nothing else says how much memory "
        "there is on cpu"
    )
    with pytest.raises(lt.LeantrainError, match="memory_budget 1KB is smaller than the parameters"):
        fit(RegressionTask(), global_batch_size=16, memory_budget="1KB", max_steps=1)


def test_a_step_that_does_not_fit_even_at_micro_batch_one_is_a_clear_error(fit):
    budget = budget_for(HeavyFromStep(), 1, global_batch_size=16)
    with pytest.raises(
        lt.LeantrainError,
        match=r"^out of memory at step 1 with a micro-batch of 1, the smallest: raise memory_budget, use "
        r"16-bit precision or activation_checkpointing$",
    ):
        fit(HeavyFromStep(), global_batch_size=16, micro_batch_size=1,
            memory_budget=str(int(budget) // 3), max_steps=2)  # fmt: skip


class LearningRates:
    def __init__(self):
        self.rates = []

    def on_log(self, step, metrics):
        self.rates.append(metrics["lr"])


@pytest.mark.parametrize(("rule", "factor"), [("linear", 4.0), ("sqrt", 2.0)])
def test_learning_rates_scale_with_the_global_batch(fit, rule, factor):
    rates = LearningRates()
    fit(RegressionTask(), callbacks=[rates], global_batch_size=32, max_steps=1, lr_scaling=rule,
        reference_batch_size=8)  # fmt: skip
    assert rates.rates == [pytest.approx(0.05 * factor)]


def test_lr_scaling_and_its_reference_come_together():
    with pytest.raises(lt.ConfigError, match="reference_batch_size=None: is needed with lr_scaling"):
        lt.TrainConfig(lr_scaling="linear")
    with pytest.raises(lt.ConfigError, match="reference_batch_size=64"):
        lt.TrainConfig(reference_batch_size=64)


def test_a_budget_that_is_not_a_size_is_refused():
    with pytest.raises(lt.ConfigError, match="memory_budget='lots': must be a size"):
        lt.TrainConfig(memory_budget="lots")


class OutOfMemoryInBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("simulated: out of memory in backward")


class AsOneOfSeveralProcesses(Single):
    multi_process = True  # its collectives are still the identity: one process plays a rank


def accumulator_asking(strategy_class: type[Single], asked: list[bool]) -> tuple[Accumulator, nn.Module]:
    model = nn.Linear(3, 1)
    strategy = strategy_class(lt.TrainConfig(), torch.device("cpu"), ParallelDims())
    strategy.wrap(model, None)

    def agree_on_oom(ran_out: bool) -> bool:
        asked.append(ran_out)
        return ran_out

    split = BatchSplit(global_batch_size=4, micro_batch_size=4)
    return Accumulator(split, Fp32(), strategy, list(model.parameters()), None, agree_on_oom), model


@pytest.mark.parametrize("strategy_class", [Single, AsOneOfSeveralProcesses])
def test_ranks_agree_once_a_step_and_an_error_after_the_agreement_is_not_agreed_again(strategy_class):
    """Every rank asks the others once per step, before its last backward (where DDP's all-reduce
    starts): an out-of-memory error after that cannot be agreed on any more. With several
    processes that is an error naming the remedy; one process abandons the step, asking nothing."""
    asked: list[bool] = []
    accumulator, model = accumulator_asking(strategy_class, asked)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(loss_fn):
        return accumulator.step(optimizer, loss_fn, iter([torch.ones(4, 3)]), 0, LossTracker())

    assert step(lambda m, b: m(b).pow(2).mean()).status is StepStatus.STEPPED
    assert asked == [False]
    late = lambda m, b: OutOfMemoryInBackward.apply(m(b)).pow(2).mean()  # noqa: E731
    if strategy_class.multi_process:
        with pytest.raises(lt.LeantrainError, match="out of memory in the last backward of a step, after"):
            step(late)
    else:
        assert step(late).status is StepStatus.OUT_OF_MEMORY
    assert asked == [False, False]


def test_an_out_of_memory_error_before_the_agreement_is_told_to_the_others():
    asked: list[bool] = []
    accumulator, model = accumulator_asking(Single, asked)

    def runs_out(model, batch):
        raise torch.OutOfMemoryError("simulated: out of memory in forward")

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outcome = accumulator.step(optimizer, runs_out, iter([torch.ones(4, 3)]), 0, LossTracker())
    assert outcome.status is StepStatus.OUT_OF_MEMORY
    assert asked == [True]


def test_micro_batch_choices_divide_the_batch_of_each_process():
    assert BatchSplit(12, 12).micro_batch_choices() == [1, 2, 3, 4, 6, 12]
    assert BatchSplit(24, 12, world_size=2).micro_batch_choices() == [1, 2, 3, 4, 6, 12]
    assert BatchSplit(14, 7, world_size=2).micro_batch_choices() == [1, 7]
    assert BatchSplit(16, 8, world_size=2).with_micro_batch(2) == BatchSplit(16, 2, world_size=2)
