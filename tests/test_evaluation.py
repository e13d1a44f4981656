from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import leantrain as lt
from leantrain.step.evaluation import batch_size_of, evaluate
from leantrain.step.precision import Fp32
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.single import Single
from tests.conftest import TinyClassifier


def test_batch_size_of_nested_batches():
    assert batch_size_of(torch.ones(5, 2)) == 5
    assert batch_size_of({"meta": "x", "ids": torch.ones(3)}) == 3
    assert batch_size_of(("name", [torch.ones(7, 1)])) == 7
    with pytest.raises(lt.TaskError, match="holds no tensor"):
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
