"""BatchNorm layers normalise over the micro-batch: the one place where the split changes the math.
The run says so once, naming the layers and the remedies; it stays silent where nothing splits."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

import leantrain as lt
from leantrain.memory.estimate import estimate_memory
from leantrain.step.batch_norm import batch_norm_layers, split_statistics_warning
from leantrain.step.batching import BatchSplit
from tests.conftest import HeavyFromStep, RegressionTask
from tests.memory.test_adaptive import budget_for


class WithBatchNorm(RegressionTask):
    """The regression MLP with a BatchNorm1d after its first layer."""

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double()


def batch_norm_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "BatchNorm" in str(w.message)]


def test_accumulation_with_batch_norm_is_told_once_and_the_weights_do_follow_the_split(fit):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fit(WithBatchNorm(), global_batch_size=16, micro_batch_size=4, max_steps=3, shuffle=False)
    told = batch_norm_warnings(caught)
    assert len(told) == 1
    assert told[0] == (
        "1 BatchNorm layer(s) (1) normalise each micro-batch of 4 samples, not the global batch of 16: "
        "their statistics, and so the gradients, follow the split (the one place it changes the math). "
        "Remedies: no accumulation (micro_batch_size 16); GroupNorm or LayerNorm in place of BatchNorm"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole = fit(WithBatchNorm(), global_batch_size=16, max_steps=3, shuffle=False)
    assert batch_norm_warnings(caught) == []  # one forward over the global batch: nothing to say
    # What the warning claims, for real: the same data and steps, other weights.
    difference = max(
        float((split.model.state_dict()[name] - value).abs().max())
        for name, value in whole.model.state_dict().items()
        if value.is_floating_point()
    )
    assert difference > 1e-6


def test_a_model_without_batch_norm_is_not_warned_about(fit):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(RegressionTask(), global_batch_size=16, micro_batch_size=4, max_steps=1)
    assert batch_norm_warnings(caught) == []


class HeavyWithBatchNorm(HeavyFromStep):
    def model(self) -> nn.Module:
        return nn.Sequential(nn.BatchNorm1d(6), super().model()).double()


def test_a_micro_batch_halved_after_out_of_memory_is_told_with_its_new_size(fit):
    budget = budget_for(HeavyWithBatchNorm(), 4, global_batch_size=16)
    task = HeavyWithBatchNorm(heavy=False, after_step=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            task,
            callbacks=[task],
            global_batch_size=16,
            micro_batch_size=8,
            memory_budget=budget,
            max_steps=4,
        )
    told = batch_norm_warnings(caught)
    assert [text.split(":")[0] for text in told] == [
        "1 BatchNorm layer(s) (0) normalise each micro-batch of 8 samples, not the global batch of 16",
        "1 BatchNorm layer(s) (0) normalise each micro-batch of 4 samples, not the global batch of 16",
    ]


def test_several_processes_name_their_share_and_sync_batch_norm_where_it_helps():
    layers = {"features.1": False, "features.4": False, "head.0": False, "head.2": False}
    text = split_statistics_warning(layers, BatchSplit(32, 16, world_size=2))
    assert text is not None
    assert text.startswith(
        "4 BatchNorm layer(s) (features.1, features.4, head.0 and 1 more) normalise each micro-batch "
        "of 16 samples on each of 2 processes, not the global batch of 32"
    )
    assert text.endswith(
        "Remedies: GroupNorm or LayerNorm in place of BatchNorm; "
        "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) in task.model() (CUDA only)"
    )  # no accumulation to remove
    # A SyncBatchNorm normalises over every process's micro-batch: only accumulation splits it.
    assert split_statistics_warning({"bn": True}, BatchSplit(32, 16, world_size=2)) is None
    synced = split_statistics_warning({"bn": True}, BatchSplit(32, 8, world_size=2))
    assert synced is not None and "micro-batch of 8 samples on each of 2 processes" in synced
    assert "(micro_batch_size 16)" in synced and "SyncBatchNorm.convert" not in synced  # it is one already


def test_every_kind_of_batch_norm_is_found_by_its_name():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyBatchNorm1d(), nn.LayerNorm(4)
    )
    model[3] = nn.SyncBatchNorm(4)
    assert batch_norm_layers(model) == {"1": False, "3": True}
    assert batch_norm_layers(nn.BatchNorm1d(3)) == {"BatchNorm1d": False}  # the model itself
    assert batch_norm_layers(nn.Linear(2, 2)) == {}
    assert split_statistics_warning({}, BatchSplit(16, 4)) is None


def test_the_warning_is_a_leantrain_warning(fit):
    with pytest.warns(
        lt.LeantrainWarning, match=r"^1 BatchNorm layer\(s\) \(1\) normalise each micro-batch of 8"
    ):
        fit(WithBatchNorm(), global_batch_size=16, micro_batch_size=8, max_steps=1)


def test_plan_leaves_out_the_micro_batch_that_batch_norm_cannot_train_on():
    """BatchNorm needs more than one value per channel in training: no micro-batch of one sample."""
    estimate = estimate_memory(WithBatchNorm(), lt.TrainConfig(global_batch_size=8))
    assert [row.micro_batch_size for row in estimate.rows] == [2, 4, 8]
    assert [
        row.micro_batch_size
        for row in estimate_memory(RegressionTask(), lt.TrainConfig(global_batch_size=8)).rows
    ] == [1, 2, 4, 8]
    with pytest.raises(lt.ConfigError) as caught:
        estimate_memory(WithBatchNorm(), lt.TrainConfig(global_batch_size=8, micro_batch_size=1))
    assert str(caught.value).startswith(
        "invalid micro_batch_size=1: task.loss fails in training on a micro-batch"
    )


def test_a_loss_that_fails_at_every_micro_batch_is_the_tasks_own_error():
    class Broken(RegressionTask):
        def loss(self, model, batch):
            raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        estimate_memory(Broken(), lt.TrainConfig(global_batch_size=8))
