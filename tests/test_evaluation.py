from __future__ import annotations

from collections import deque

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import leantrain as lt
from leantrain.step.evaluation import batch_size_of, evaluate, even_forwards
from leantrain.step.precision import Fp32
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.single import Single
from tests.conftest import RegressionTask, TinyClassifier


def test_batch_size_of_nested_batches():
    assert batch_size_of(torch.ones(5, 2)) == 5
    assert batch_size_of({"meta": "x", "ids": torch.ones(3)}) == 3
    assert batch_size_of(("name", [torch.ones(7, 1)])) == 7
    with pytest.raises(lt.TaskError, match="of a tuple batch: it holds no tensor"):
        batch_size_of(("a", 1))


def test_evaluate_weights_uneven_batches_by_samples():
    task = TinyClassifier(samples=10)
    model = task.model()
    data = TensorDataset(task.x, task.y)
    loader = DataLoader(data, batch_size=4)  # batches of 4, 4, 2
    strategy = Single(lt.TrainConfig(), torch.device("cpu"), ParallelDims())
    strategy.wrap(model, None)
    metrics = evaluate(strategy, task, loader, Fp32())
    with torch.no_grad():
        logits = model(task.x)
        expected_loss = torch.nn.functional.cross_entropy(logits, task.y)
        expected_accuracy = (logits.argmax(1) == task.y).float().mean()
    assert metrics["val_loss"] == pytest.approx(float(expected_loss), rel=1e-6)
    assert metrics["val_accuracy"] == pytest.approx(float(expected_accuracy))
    assert model.training  # the mode is restored


def test_a_loss_sum_is_validated_as_its_total_over_its_total_count():
    """A LossSum task's val_loss is the whole set's sum over the whole set's count (token-level
    losses with padding), not a mean of per-batch means."""
    task = RegressionTask(samples=10, loss_kind="sum")
    model = task.model()
    loader = DataLoader(task.train_data(), batch_size=4)  # batches of 4, 4, 2, unequal counts
    strategy = Single(lt.TrainConfig(), torch.device("cpu"), ParallelDims())
    strategy.wrap(model, None)
    metrics = evaluate(strategy, task, loader, Fp32())
    with torch.no_grad():
        expected = (((model(task.x) - task.y) ** 2) * task.mask).sum() / task.mask.sum()
    assert set(metrics) == {"val_loss"}
    assert metrics["val_loss"] == pytest.approx(float(expected), rel=1e-12)


def test_a_process_that_computed_no_loss_adds_nothing():
    """A pipeline's first stage computes no loss in validation: its share is empty, not zeros
    that would count as samples (the gather adds every process's share)."""
    strategy = Single(lt.TrainConfig(), torch.device("cpu"), ParallelDims())
    strategy.wrap(TinyClassifier().model(), None)
    assert evaluate(strategy, TinyClassifier(), [], Fp32()) == {}


def test_a_shorter_share_runs_spare_forwards_up_to_the_common_count():
    """fsdp's forwards gather parameters from every rank: a rank with fewer validation batches runs
    its last one again until every rank has run as many; those results count for nothing."""
    counted = deque()
    fed = list(even_forwards(["a", "b"], 4, lambda flag: pytest.fail("no agreement needed"), None, counted))
    assert fed == ["a", "b", "b", "b"]
    assert list(counted) == [True, True, False, False]


def test_a_share_of_the_common_count_runs_no_spare_forward():
    counted = deque()
    assert list(even_forwards(["a", "b"], 2, bool, None, counted)) == ["a", "b"]
    assert list(counted) == [True, True]


def test_a_rank_without_a_batch_runs_the_spare_one():
    counted = deque()
    assert list(even_forwards([], 2, bool, lambda: "spare", counted)) == ["spare", "spare"]
    assert list(counted) == [False, False]


def test_a_stream_of_unknown_length_agrees_before_each_batch():
    """Without a count, the ranks ask each other before each batch whether any has one left (here
    another rank has two more than this one)."""
    others_left = iter([True, True, False])
    asked = []

    def any_rank(flag: bool) -> bool:
        asked.append(flag)
        return flag or next(others_left)

    counted = deque()
    assert list(even_forwards(["a", "b", "c"], None, any_rank, None, counted)) == ["a", "b", "c", "c", "c"]
    assert asked == [True, True, True, False, False, False]
    assert list(counted) == [True, True, True, False, False]


def test_spare_forwards_leave_the_metrics_as_they_are():
    """Evaluating 3 batches, padded to 5 forwards with spare ones, gives the 3 batches' metrics."""
    task = TinyClassifier(samples=10)
    model = task.model()
    loader = DataLoader(TensorDataset(task.x, task.y), batch_size=4)  # batches of 4, 4, 2
    strategy = Single(lt.TrainConfig(), torch.device("cpu"), ParallelDims())
    strategy.wrap(model, None)
    padded = evaluate(strategy, task, loader, Fp32(), forwards=5)
    assert padded == evaluate(strategy, task, loader, Fp32())


def test_a_rank_without_a_batch_and_no_spare_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^a rank without validation batches needs a spare batch to run$"):
        list(even_forwards([], 1, bool, None, deque()))
