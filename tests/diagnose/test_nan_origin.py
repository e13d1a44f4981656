"""Where a non-finite value came from: the first module named, and the replay leaves no trace."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from transformers import GPT2Config, GPT2LMHeadModel

from leantrain.diagnose.nan_origin import find_nan_origin, origin_line, short_float
from leantrain.examples.charlm import CharGPT
from leantrain.examples.digits import DigitsCNN
from leantrain.step.accumulator import TaskLoss
from leantrain.step.precision import make_precision
from leantrain.task import LossSum

CPU = torch.device("cpu")
# A weight value near the largest of the compute dtype: the layer it is planted in overflows.
OVERFLOWS = {"16-mixed": 6e4, "16-true": 6e4, "32": 3e38}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def gpt2_forward(precision_name: str, ids: torch.Tensor):
    precision = make_precision(precision_name, CPU)

    def forward(model: nn.Module) -> torch.Tensor:
        with precision.autocast():
            return model(input_ids=ids, labels=ids).loss

    return forward


def plant(module: nn.Module, value: float) -> None:
    """Every weight ``value``: the layer's output overflows where its (non-negative, after a GELU)
    inputs sum to more than ~1."""
    with torch.no_grad():
        module.weight.fill_(value)


class InfGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient infinite."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def infinite_gradient_below(module: nn.Module) -> None:
    """The module's own backward receives an infinite gradient: its inputs' gradient is non-finite."""
    module.register_forward_hook(lambda m, args, output: InfGradient.apply(output))


def hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
    )


@pytest.mark.parametrize("precision", ["16-mixed", "32"])
@pytest.mark.parametrize("layer", ["transformer.h.0.mlp.c_proj", "transformer.h.2.mlp.c_proj"])
def test_a_planted_overflow_in_gpt2_is_named_at_its_layer(precision, layer):
    model = gpt2()
    ids = torch.randint(0, 64, (2, 16))
    plant(model.get_submodule(layer), OVERFLOWS[precision])
    origin = find_nan_origin(model, gpt2_forward(precision, ids), step=1234)
    assert origin is not None and (origin.kind, origin.module) == ("output", layer)
    dtype = "float16" if precision == "16-mixed" else "float32"
    assert origin.given.finite and origin.given.dtype == dtype
    assert origin.describe().startswith(f"non-finite output in {layer} at step 1234 (input max ")
    assert origin.describe().endswith(f" in {dtype})")


def test_an_fp16_overflow_is_not_one_in_fp32():
    """The same weights: fp16's range overflows, fp32's does not (so nothing is named)."""
    model = gpt2()
    ids = torch.randint(0, 64, (2, 16))
    plant(model.transformer.h[1].mlp.c_proj, OVERFLOWS["16-mixed"])
    assert find_nan_origin(model, gpt2_forward("32", ids)) is None
    assert find_nan_origin(model, gpt2_forward("16-mixed", ids)).module == "transformer.h.1.mlp.c_proj"


@pytest.mark.parametrize("precision", ["16-true", "32"])
def test_a_planted_overflow_in_the_charlm_example_is_named_through_the_run_seam(precision):
    """``origin_line`` over a TaskLoss's micro-batches, as the loop calls it; 16-true: a half model."""
    torch.manual_seed(0)
    model = CharGPT(vocab=20, block=8, layers=2, heads=2, width=32, dropout=0.0)
    run_precision = make_precision(precision, CPU)
    run_precision.prepare(model)
    plant(model.blocks[1].mlp[2], OVERFLOWS[precision])

    class Task:
        def loss(self, model, batch):
            inputs, targets = batch
            logits = model(inputs)
            return LossSum(nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()), 1)

    task_loss = TaskLoss(Task())
    task_loss.start_step(57, 2)
    for _ in range(2):
        task_loss(model, (torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))))
    dtype = "float16" if precision == "16-true" else "float32"
    line = origin_line(model, task_loss, run_precision, 57, gradients=False)
    assert line.startswith("non-finite output in blocks.1.mlp.2 at step 57, micro-batch 1 of 2 (input max ")
    assert line.endswith(f" in {dtype})")


def digits_step_with_a_nan_in(micro: int) -> tuple[nn.Module, TaskLoss]:
    """The digits example's model, after a step of 3 micro-batches, one with a NaN pixel."""
    torch.manual_seed(0)
    model = DigitsCNN(width=4)

    class Task:
        def loss(self, model, batch):
            return nn.functional.cross_entropy(model(batch[0]), batch[1])

    task_loss = TaskLoss(Task())
    task_loss.start_step(3, 3)
    batches = [(torch.randn(2, 1, 8, 8), torch.tensor([1, 2])) for _ in range(3)]
    batches[micro - 1][0][0, 0, 2, 2] = float("nan")
    for batch in batches:
        task_loss(model, batch)
    return model, task_loss


def test_a_non_finite_batch_names_the_micro_batch_and_says_the_input_was_already_non_finite():
    model, task_loss = digits_step_with_a_nan_in(micro=2)
    line = origin_line(model, task_loss, make_precision("32", CPU), 3, gradients=False)
    assert line == (
        "non-finite output in features.0 at step 3, micro-batch 2 of 3 "
        "(its input was already non-finite, in float32: made before it)"
    )


def test_every_rank_gets_the_line_of_the_first_rank_that_found_an_origin():
    model, task_loss = digits_step_with_a_nan_in(micro=3)
    precision = make_precision("32", CPU)
    line = origin_line(
        model, task_loss, precision, 3, gradients=False, gather=lambda mine: [None, mine, mine]
    )
    assert line.startswith(
        "non-finite output in features.0 at step 3, micro-batch 3 of 3 on rank 1 (its input"
    )


def test_a_loss_that_is_not_finite_from_finite_outputs_is_the_tasks():
    model = gpt2()
    ids = torch.randint(0, 64, (2, 16))

    def forward(model):
        return model(input_ids=ids).logits.mean() * float("inf")

    origin = find_nan_origin(model, forward, step=5)
    assert (origin.kind, origin.module, origin.given.dtype) == ("loss", None, "float32")
    described = origin.describe()
    assert described.startswith("non-finite loss at step 5, from finite model outputs (model output max")


@pytest.mark.parametrize(
    "layer", ["transformer.h.0.mlp.c_fc", "transformer.h.1.attn.c_attn", "transformer.h.0.mlp.act"]
)  # the activation holds no parameter: only the gradient of its input tells
def test_a_planted_non_finite_gradient_is_named_at_its_layer(layer):
    model = gpt2()
    ids = torch.randint(0, 64, (2, 16))
    infinite_gradient_below(model.get_submodule(layer))
    forward = gpt2_forward("32", ids)
    assert find_nan_origin(model, forward) is None  # the forward is finite
    origin = find_nan_origin(model, forward, gradients=True, step=9)
    assert (origin.kind, origin.module) == ("gradient", layer)
    assert origin.given.finite  # the gradient it was given (of its output) was finite
    assert origin.describe().startswith(f"non-finite gradient in {layer} at step 9 (output gradient max ")


@pytest.mark.parametrize(
    ("layer", "later"),
    [
        ("transformer.h.1.mlp.c_fc", None),
        ("transformer.wpe", None),
        ("transformer.h.1.mlp.c_fc", "transformer.h.0.mlp.c_fc"),
    ],
)
def test_a_non_finite_parameter_gradient_is_named_at_its_layer(layer, later):
    """A weight's own gradient (the gradient of the inputs stays finite); an embedding's hook runs
    before its weight's gradient exists. ``later``: a module further down the backward whose input
    gradient is non-finite too is not the first."""
    model = gpt2()
    ids = torch.randint(0, 64, (2, 16))
    model.get_submodule(layer).weight.register_hook(lambda grad: grad * float("inf"))
    if later is not None:
        infinite_gradient_below(model.get_submodule(later))
    origin = find_nan_origin(model, gpt2_forward("32", ids), gradients=True)
    assert (origin.kind, origin.module) == ("gradient", layer)


class TwoEmbeddings(nn.Module):
    """``early`` is looked up first, ``late`` added just before the output: the backward reaches late,
    then the linear layer, then early; named in the order early, late, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.early, self.late, self.linear = nn.Embedding(10, 4), nn.Embedding(10, 4), nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(self.early(ids)) + self.late(ids)


def test_of_two_gradients_gone_bad_after_their_hooks_the_one_the_backward_reached_first_is_named():
    """Both embeddings' weights get an infinite gradient after their module's hook ran (their inputs need
    no gradient): the one nearer the loss is the origin, not the first registered nor the whole model."""
    torch.manual_seed(0)
    model = TwoEmbeddings()
    for embedding in (model.early, model.late):
        embedding.weight.register_hook(lambda grad: grad * float("inf"))
    ids = torch.randint(0, 10, (2, 5))
    origin = find_nan_origin(model, lambda m: m(ids).sum(), gradients=True)
    assert (origin.kind, origin.module) == ("gradient", "late")
    assert origin.describe() == "non-finite gradient in late (no tensor output gradient)"  # no step given


class Noisy(nn.Module):
    """Dropout and BatchNorm: a replay draws random numbers and would move the running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))

    def forward(self, x):
        noise = torch.randn(x.shape, dtype=x.dtype) * random.random() * float(np.random.rand())
        return self.inner(x + noise)


def noisy_step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def state_of(model: nn.Module) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()},
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
    }


def bits(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor's bytes: NaN equals NaN, and -0.0 differs from 0.0."""
    return None if tensor is None else tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same(before: dict, after: dict) -> None:
    for part in ("params", "grads", "buffers"):
        assert before[part].keys() == after[part].keys()
        for key, value in before[part].items():
            old, new = bits(value), bits(after[part][key])
            assert (old is None and new is None) or torch.equal(old, new), (part, key)
    assert torch.equal(before["torch"], after["torch"])
    assert before["python"] == after["python"]
    assert np.array_equal(before["numpy"], after["numpy"])


@pytest.mark.parametrize("gradients", [False, True])
def test_the_replay_leaves_parameters_gradients_buffers_and_random_streams_as_they_were(gradients):
    torch.manual_seed(0)
    model = Noisy().double().train()
    noisy_step(model, torch.randn(6, 4, dtype=torch.float64)).backward()  # gradients already there
    bad = torch.randn(6, 4, dtype=torch.float64)
    bad[2, 1] = float("inf")
    before = state_of(model)
    origin = find_nan_origin(model, lambda m: noisy_step(m, bad), gradients=gradients)
    assert origin is not None and origin.module == "inner.0"
    assert_same(before, state_of(model))
    assert hook_count(model) == 0


def test_a_run_that_replays_its_skipped_step_ends_bit_identical_to_one_that_does_not():
    def train(replay: bool) -> dict:
        torch.manual_seed(1)
        random.seed(1)
        np.random.seed(1)
        model = Noisy().double().train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        task_loss = TaskLoss(type("Task", (), {"loss": staticmethod(noisy_step)})())
        precision = make_precision("32", CPU)
        for step in range(1, 6):
            task_loss.start_step(step, 2)
            for micro in range(2):
                batch = torch.randn(4, 4, dtype=torch.float64)
                if step == 3 and micro == 1:
                    batch[0, 0] = float("nan")
                task_loss(model, batch).backward()
            finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
            if finite:
                optimizer.step()
            elif replay:
                assert "micro-batch 2 of 2" in origin_line(model, task_loss, precision, step, gradients=True)
            optimizer.zero_grad()
        return state_of(model)

    assert_same(train(replay=False), train(replay=True))


def test_hooks_are_removed_and_the_state_restored_after_an_exception():
    torch.manual_seed(0)
    model = Noisy().double()
    before = state_of(model)

    def failing(model):
        model(torch.randn(3, 4, dtype=torch.float64))
        raise KeyError("inside the replay")

    for gradients in (False, True):
        with pytest.raises(KeyError, match="inside the replay"):
            find_nan_origin(model, failing, gradients=gradients)
        assert hook_count(model) == 0
        assert_same(before, state_of(model))


def test_a_failing_replay_is_a_line_not_an_error():
    model = nn.Linear(2, 1)

    class Task:
        def loss(self, model, batch):
            raise KeyError("boom")

    task_loss = TaskLoss(Task())
    task_loss.start_step(4, 1)
    task_loss.batches.append(torch.zeros(1, 2))  # as if the step had called it
    line = origin_line(model, task_loss, make_precision("32", CPU), 4, gradients=False)
    assert line.startswith("replaying step 4 to find where the non-finite value came from failed: KeyError")
    assert hook_count(model) == 0


def test_a_replay_that_finds_everything_finite_says_so_and_no_batch_is_no_line():
    model = nn.Linear(2, 1)
    task_loss = TaskLoss(type("Task", (), {"loss": staticmethod(lambda m, b: m(b).sum())})())
    task_loss.start_step(2, 1)
    assert origin_line(model, task_loss, make_precision("32", CPU), 2, gradients=True) is None
    task_loss(model, torch.ones(1, 2))
    line = origin_line(model, task_loss, make_precision("32", CPU), 2, gradients=True)
    assert line.startswith("replaying step 2's 1 micro-batch(es) made only finite values")


def test_the_task_loss_keeps_the_steps_micro_batches_by_reference_until_the_next_step():
    task_loss = TaskLoss(type("Task", (), {"loss": staticmethod(lambda m, b: m(b).sum())})())
    model = nn.Linear(2, 1)
    first, second = torch.zeros(1, 2), torch.ones(1, 2)
    task_loss.start_step(1, 2)
    for batch in (first, first, second):  # a second call on the same batch is the same micro-batch
        task_loss(model, batch)
    assert len(task_loss.batches) == 2 and task_loss.batches[0] is first and task_loss.batches[1] is second
    task_loss.loss_of(model, torch.ones(1, 2))  # a replay's call is not counted
    assert task_loss.micro == 2
    task_loss.start_step(2, 2)
    assert task_loss.batches == []


def test_compiled_blocks_are_replayed_eagerly_and_compile_nothing():
    """leantrain compiles a module's forward in place (``compile_forward``): the replay's hooks
    would recompile it (graph breaks at each host read), twice."""
    model = gpt2()
    ids = torch.randint(0, 64, (2, 16))
    forward = gpt2_forward("32", ids)
    for block in model.transformer.h:
        block.forward = torch.compile(block.forward, backend="eager")
    forward(model)  # compiled now
    graphs = counters["stats"]["unique_graphs"]
    plant(model.transformer.h[1].mlp.c_proj, OVERFLOWS["32"])
    assert find_nan_origin(model, forward).module == "transformer.h.1.mlp.c_proj"
    forward(model)
    assert counters["stats"]["unique_graphs"] == graphs
    wrapped = torch.compile(model, backend="eager")
    assert find_nan_origin(wrapped, forward).module == "transformer.h.1.mlp.c_proj"  # not _orig_mod.


def test_a_ddp_model_is_named_as_the_users_and_its_next_step_still_synchronises(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)))
        model(torch.randn(2, 3)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        bad = torch.tensor([[1.0, float("inf"), 0.0]])
        origin = find_nan_origin(model, lambda m: m(bad).sum(), gradients=True)
        assert origin.module == "0"  # not module.0
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
        model(torch.randn(2, 3)).sum().backward()  # the reducer was left ready for the next step
    finally:
        dist.destroy_process_group()


def test_short_float():
    assert [short_float(v) for v in (65504.0, 0.00123, 3.0, 0.0, float("inf"))] == [
        "6.6e4", "1.2e-3", "3e0", "0", "inf"
    ]  # fmt: skip
