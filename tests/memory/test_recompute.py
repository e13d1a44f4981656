"""Activation checkpointing: the same gradients as without, fewer saved bytes, the blocks it names."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain.blocks import BlockPolicy, block_classes, matching_blocks
from leantrain.examples.charlm import CharLMTask
from leantrain.memory.estimate import estimate_memory, fewest_checkpointed_blocks
from leantrain.memory.recompute import apply_activation_checkpointing
from tests.conftest import RegressionTask, without_validation


def small_charlm(dropout: float = 0.1) -> CharLMTask:
    task = CharLMTask(block=32, layers=4, width=64, heads=4, max_chars=60_000, dropout=dropout)
    return without_validation(task)


def saved_bytes_and_grads(task: CharLMTask, model: nn.Module, batch) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd saves for backward in one forward (each tensor once), and the gradients."""
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor):
        saved[id(tensor)] = tensor
        return tensor

    torch.manual_seed(1)  # the same dropout masks for both models
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = task.loss(model, batch).sum
    loss.backward()
    params = {id(p) for p in model.parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in saved.values() if id(t) not in params)
    return nbytes, [p.grad.clone() for p in model.parameters()]


def test_checkpointing_gives_the_same_gradients_with_dropout_and_saves_fewer_bytes():
    task = small_charlm(dropout=0.1)
    torch.manual_seed(0)
    plain = task.model().double()
    recomputed = copy.deepcopy(plain)
    assert apply_activation_checkpointing(recomputed, BlockPolicy.parse("Block")) == [
        f"blocks.{i}" for i in range(4)
    ]
    batch = next(iter(torch.utils.data.DataLoader(task.train_data(), batch_size=4)))
    plain_bytes, plain_grads = saved_bytes_and_grads(task, plain, batch)
    recomputed_bytes, grads = saved_bytes_and_grads(task, recomputed, batch)
    for a, b in zip(plain_grads, grads, strict=True):
        assert float((a - b).abs().max()) <= 1e-10
    assert recomputed_bytes < plain_bytes * (1 - 2 / 4)  # at least 1 - 2/L of the bytes saved


def test_the_repeated_blocks_are_found_and_every_n_picks_among_them():
    model = small_charlm().model()
    assert block_classes(model) == ("Block",)  # not the two Linear of each block's MLP
    names = [name for name, _ in matching_blocks(model, BlockPolicy.parse("every:2"))]
    assert names == ["blocks.0", "blocks.2"]
    assert block_classes(nn.Linear(2, 2)) == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Attention", "the model has no module of class Attention; its classes: Block, CharGPT"),
        ("every:2", None),
    ],
)
def test_a_policy_that_names_nothing_in_the_model_is_a_clear_error(text, message):
    model = small_charlm().model() if message else nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    expected = message or "needs module class names: this model has no ModuleList or Sequential of repeated"
    with pytest.raises(lt.ConfigError, match=expected):
        matching_blocks(model, BlockPolicy.parse(text))


def test_checkpointing_recomputes_in_training_only():
    """Recomputation runs a block's forward a second time in backward; in evaluation (even with
    grad on, as for input attributions) a block must run once: nothing is saved to trade."""
    model = small_charlm(dropout=0.0).model()
    apply_activation_checkpointing(model, BlockPolicy.parse("Block"))
    calls = []
    model.blocks[0].qkv.register_forward_hook(lambda module, args, output: calls.append(module.training))
    for training in (True, False):
        model.train(training)
        calls.clear()
        model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
        assert len(calls) == (2 if training else 1)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_fit_with_checkpointing_trains_exactly_as_without(fit, precision):
    settings = dict(global_batch_size=16, micro_batch_size=8, max_steps=4, precision=precision)
    plain = fit(small_charlm(), **settings)
    recomputed = fit(small_charlm(), activation_checkpointing="Block", **settings)
    for name, value in plain.model.state_dict().items():
        assert torch.equal(recomputed.model.state_dict()[name], value), name


def test_auto_recomputes_the_fewest_blocks_that_fit_the_budget(fit):
    task = small_charlm(dropout=0.0)
    config = dict(global_batch_size=16, micro_batch_size=8)
    rows = {
        policy: estimate_memory(task, lt.TrainConfig(**config, activation_checkpointing=policy)).chosen
        for policy in (None, "Block,first:1", "Block,first:2", "Block,first:3", "Block")
    }
    totals = [row.memory.total_bytes for row in rows.values()]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 5  # each block recomputed saves
    # a budget between each two: the fewest blocks with which it fits, by name
    between = [(total + after) // 2 for total, after in itertools.pairwise(totals)]
    fewest = [fewest_checkpointed_blocks(task, lt.TrainConfig(**config), budget) for budget in between]
    assert fewest == ["Block,first:1", "Block,first:2", "Block,first:3", "Block"]  # all four: the plain name
    budget = between[1]
    assert fewest_checkpointed_blocks(task, lt.TrainConfig(**config), rows[None].memory.total_bytes) is None
    # no micro-batch set: each process's share of the global batch (one process unless told)
    assert fewest_checkpointed_blocks(task, lt.TrainConfig(global_batch_size=8), budget) == "Block,first:2"
    assert (
        fewest_checkpointed_blocks(task, lt.TrainConfig(global_batch_size=16), budget, 2) == "Block,first:2"
    )
    result = fit(task, activation_checkpointing="auto", memory_budget=str(budget), max_steps=2, **config)
    plain = fit(small_charlm(dropout=0.0), max_steps=2, **config)
    for name, value in plain.model.state_dict().items():
        assert torch.equal(result.model.state_dict()[name], value), name
    with pytest.raises(
        lt.LeantrainError, match="does not fit memory_budget 1000 even with all 4 Block blocks"
    ):
        fewest_checkpointed_blocks(task, lt.TrainConfig(**config, memory_budget="1000"), 1000)
    with pytest.raises(lt.LeantrainError) as error:  # a model without repeated blocks
        fewest_checkpointed_blocks(
            OneLayer(), lt.TrainConfig(global_batch_size=16, memory_budget="1000"), 1000
        )
    assert str(error.value) == (
        "activation_checkpointing auto: the model has no repeated blocks to recompute; name them instead"
    )


class OneLayer(RegressionTask):
    def model(self) -> torch.nn.Module:
        return torch.nn.Linear(6, 1, dtype=torch.float64)


def test_auto_needs_a_budget_and_a_fixed_micro_batch():
    with pytest.raises(lt.ConfigError, match="activation_checkpointing='auto': needs memory_budget"):
        lt.TrainConfig(activation_checkpointing="auto")
    with pytest.raises(lt.ConfigError, match="activation_checkpointing='auto'"):
        lt.TrainConfig(activation_checkpointing="auto", memory_budget="1GiB", micro_batch_size="auto")


def test_first_n_keeps_the_first_matching_blocks():
    model = small_charlm().model()
    names = [name for name, _ in matching_blocks(model, BlockPolicy.parse("Block,first:3"))]
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
