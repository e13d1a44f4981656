from __future__ import annotations

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain.parallel.apply import DataParallelPlan, SingleProcess, parallelize, resolve_strategy
from leantrain.parallel.dims import ParallelDims
from leantrain.parallel.env import ClusterEnv

ONE = ClusterEnv("single")
TWO = ClusterEnv("torchrun", rank=0, world_size=2)


@pytest.mark.parametrize(
    ("strategy", "env", "resolved"),
    [
        ("auto", ONE, "single"),
        ("auto", TWO, "ddp"),
        ("ddp", TWO, "ddp"),
        ("single", ONE, "single"),
        ("dp", ONE, "dp"),
    ],
)
def test_resolve_strategy(strategy, env, resolved):
    assert resolve_strategy(strategy, env) == resolved


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_multi_process_strategies_in_one_process_say_how_to_launch(strategy):
    with pytest.raises(lt.ConfigError, match="needs several processes: run `leantrain launch"):
        resolve_strategy(strategy, ONE)


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_one_process_strategies_refuse_a_multi_process_launch(strategy):
    with pytest.raises(lt.ConfigError, match="runs in one process, but 2 were launched"):
        resolve_strategy(strategy, TWO)


def test_single_process_plan_communicates_nothing():
    model = nn.Linear(2, 2)
    plan = parallelize(model, ParallelDims(), lt.TrainConfig(), "single", torch.device("cpu"))
    assert isinstance(plan, SingleProcess) and plan.module is model and plan.model is model
    tensor = torch.ones(3)
    assert plan.all_reduce_sum(tensor) is tensor and plan.any_rank(True) and plan.gather(5) == [5]


def test_dp_warns_why_ddp_is_faster():
    with pytest.warns(UserWarning, match="DDP runs one process per GPU and communicates only gradients"):
        plan = parallelize(nn.Linear(2, 2), ParallelDims(), lt.TrainConfig(), "dp", torch.device("cpu"))
    assert isinstance(plan, DataParallelPlan) and plan.strategy == "dp"


def test_dp_trains_like_single_on_one_device(fit):
    from tests.conftest import RegressionTask

    with pytest.warns(UserWarning):
        dp = fit(RegressionTask(), global_batch_size=16, max_steps=3, strategy="dp")
    single = fit(RegressionTask(), global_batch_size=16, max_steps=3)
    assert dp.strategy == "dp"
    assert all(
        torch.equal(a, b) for a, b in zip(dp.model.parameters(), single.model.parameters(), strict=True)
    )
