from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import leantrain as lt
from leantrain.step.evaluation import batch_size_of, evaluate
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
