from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import leantrain as lt
from leantrain.examples import EXAMPLES, load_example
from leantrain.examples.charlm import CharChunks, CharLMTask, corpus
from leantrain.examples.slowdata import SlowAugmentedStripes, SlowDataTask


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_example_satisfies_the_task_protocol(name):
    task = load_example(name)
    assert isinstance(task, lt.Task)


def test_charlm_trains_with_a_token_level_loss_sum(fit):
    task = CharLMTask(block=32, layers=2, width=64, heads=4, max_chars=60_000)
    batch = next(iter(torch.utils.data.DataLoader(task.train_data(), batch_size=4)))
    loss = task.loss(task.model(), batch)
    assert isinstance(loss, lt.LossSum) and loss.count == 4 * 32
    first = fit(
        CharLMTask(block=32, layers=2, width=64, heads=4, max_chars=60_000), global_batch_size=32, max_steps=1
    )
    trained = fit(
        CharLMTask(block=32, layers=2, width=64, heads=4, max_chars=60_000),
        global_batch_size=32,
        micro_batch_size=16,
        max_steps=40,
    )
    assert trained.final_train_loss < 0.75 * first.final_train_loss
    assert trained.val_metrics["val_loss"] < first.val_metrics["val_loss"]


def test_charlm_model_is_made_of_blocks_with_tied_embeddings():
    task = CharLMTask(layers=3)
    model = task.model()
    assert sum(type(m).__name__ == "Block" for m in model.modules()) == 3
    assert model.head.weight is model.token.weight


def test_char_chunks_are_shifted_pairs():
    codes = torch.arange(10)
    chunks = CharChunks(codes, block=4)
    assert len(chunks) == 2
    x, y = chunks[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    with pytest.raises(IndexError):
        chunks[2]
    assert len(corpus()) > 100_000


def test_slowdata_items_are_deterministic_per_index_and_learnable(fit):
    data = SlowAugmentedStripes(size=64, passes=2)
    a, label_a = data[5]
    b, label_b = data[5]
    assert torch.equal(a, b) and label_a == label_b and a.shape == (1, 48, 48)
    assert not torch.equal(data[6][0], a)
    result = fit(SlowDataTask(size=512, passes=1), global_batch_size=64, max_steps=40)
    assert result.val_metrics["val_accuracy"] > 0.5  # 8 classes: chance is 0.125


def test_digits_are_scikit_learns_read_without_importing_it(monkeypatch):
    """The bundled file read with NumPy (1.2 s of import saved per process) gives scikit-learn's digits;
    where the file is not found, scikit-learn's own reader gives them."""
    from sklearn.datasets import load_digits

    from leantrain.examples import digits

    images, labels = digits._digits.__wrapped__()
    reference = load_digits()
    assert images.dtype == np.float32 and labels.dtype == np.int64 and images.shape == (1797, 8, 8)
    assert np.array_equal(images, (reference.images / 16.0).astype(np.float32))
    assert np.array_equal(labels, reference.target)
    monkeypatch.setattr(digits.importlib.util, "find_spec", lambda name: None)
    moved = digits._digits.__wrapped__()
    assert np.array_equal(moved[0], images) and np.array_equal(moved[1], labels)
    code = "import sys; from leantrain.examples.digits import DigitsTask; DigitsTask().train_data(); "
    code += "print('sklearn' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
