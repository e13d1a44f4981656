from __future__ import annotations

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
