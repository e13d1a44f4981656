"""The Task contract, checked where the engine first uses each method: one TaskError line naming
the method and the fix, or, for an error raised in the task's own code, the original exception
with a note saying where it happened."""

from __future__ import annotations

import gc
import multiprocessing
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import leantrain as lt
from leantrain.data.loader import NamedItemErrors, collate
from leantrain.errors import DataError, LeantrainWarning, TaskError
from leantrain.memory.estimate import estimate_memory
from leantrain.step.accumulator import TaskLoss
from leantrain.task import note_task_error


class Linear:
    """The smallest task: a 4 -> 1 linear regression on 16 samples."""

    def model(self) -> nn.Module:
        return nn.Linear(4, 1)

    def train_data(self) -> Dataset:
        gen = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen))

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)


class Items(Dataset):
    """16 items (x[4], y[1]); item 5 is None, or item 3's x is one longer (ragged)."""

    def __init__(self, broken: str) -> None:
        self.broken = broken

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        if self.broken == "none" and index == 5:
            return None
        length = 5 if self.broken == "ragged" and index == 3 else 4
        return torch.zeros(length), torch.zeros(1)


class BrokenItems(Linear):
    def __init__(self, broken: str) -> None:
        self.broken = broken

    def train_data(self) -> Dataset:
        return Items(self.broken)


def train(fit, task, **fields):
    fields = {"max_steps": 2, "global_batch_size": 8, "shuffle": False, **fields}
    return fit(task, **fields)


def test_a_workers_traceback_is_reduced_to_its_last_line_after_the_first_marker():
    traceback = (
        "Caught DataError in DataLoader worker process 1.\nTraceback (most recent call last):\n"
        '  File "loader.py", line 48, in __getitem__\n'
        "leantrain.errors.DataError: train_data item 3 failed: DataError: the inner one"
    )
    error = DataError(traceback)
    assert str(error) == "train_data item 3 failed: DataError: the inner one" and error.details == traceback
    assert (
        str(DataError("train_data item 3 failed: DataError: one line"))
        == "train_data item 3 failed: DataError: one line"
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_a_none_item_names_the_dataset_and_its_index(fit, workers):
    with pytest.raises(TaskError) as caught:
        train(fit, BrokenItems("none"), num_workers=workers)
    assert isinstance(caught.value, DataError)  # a worker's traceback is reduced to the line
    assert str(caught.value).startswith("train_data item 5 is None: __getitem__ must return a tensor")


@pytest.mark.parametrize("workers", [0, 1])
def test_ragged_items_name_both_items_the_field_their_shapes_and_the_remedy(fit, workers):
    with pytest.raises(TaskError) as caught:
        train(fit, BrokenItems("ragged"), num_workers=workers)
    message = str(caught.value)
    assert message.startswith("train_data items 0 and 3 differ at field [0]: shape [4] vs shape [5]")
    assert "pad them in __getitem__" in message and "lt.LossSum" in message
    assert "\n" not in message


class RaggedStream(BrokenItems):
    """The ragged items as a stream (no __len__): batched by the stream's shard, not the loader."""

    def train_data(self):
        items = Items(self.broken)

        class Stream(IterableDataset):
            def __iter__(inner):
                return (items[i] for i in range(len(items)))

        return Stream()


@pytest.mark.parametrize("workers", [0, 1])
def test_ragged_stream_items_name_their_positions(fit, workers):
    with pytest.raises(TaskError, match=r"^train_data items 0 and 3 differ at field \[0\]: shape \[4\]"):
        train(fit, RaggedStream("ragged"), num_workers=workers)


class BrokenValidation(Linear):
    """Trains, then fails at validation: both loaders have started their workers."""

    def val_data(self) -> Dataset:
        return Items("none")


@pytest.mark.parametrize("task", [BrokenItems("none"), BrokenValidation()], ids=["train", "validation"])
def test_the_workers_of_a_failed_fit_stop_when_it_raises(fit, task):
    """The error's traceback holds the run in a reference cycle. Left to the garbage collector, the
    workers would live on and each cost a 5 s wait whenever it next ran (in the user's next cell)."""
    before = set(multiprocessing.active_children())
    gc.disable()  # the collector must not do the job the run should have done
    try:
        with pytest.raises(DataError):
            train(fit, task, num_workers=2)
        still_running = set(multiprocessing.active_children()) - before
    finally:
        gc.enable()
    assert not still_running


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{"x": torch.zeros(2)}, {"x": None}], "val_data item 11 has None at field ['x']"),
        ([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}], "items 10 and 11 differ at field ['x']"),
        ([[1, 2], [1, 2, 3]], "items 10 and 11 differ: length 2 vs length 3"),
    ],
)
def test_collate_names_the_field_at_fault(items, message):
    with pytest.raises(TaskError, match=message.replace("[", r"\[")):
        collate(items, [10, 11], "val_data")


class NoGrad(Linear):
    def __init__(self, loss_sum: bool) -> None:
        self.loss_sum = loss_sum

    def loss(self, model, batch):
        with torch.no_grad():
            loss = super().loss(model, batch)
        return lt.LossSum(loss * 8, 8) if self.loss_sum else loss


@pytest.mark.parametrize("loss_sum", [False, True])
@pytest.mark.parametrize("search", [False, True], ids=["fixed", "micro-batch-search"])
def test_a_loss_without_grad_fn_says_how_it_lost_it(fit, loss_sum, search):
    # micro_batch_size auto runs the loss's backward itself, in its search, before the first step.
    fields = dict(micro_batch_size="auto", memory_budget="1GiB") if search else {}
    with pytest.raises(TaskError, match=r"task\.loss returned .* does not require grad") as caught:
        train(fit, NoGrad(loss_sum), **fields)
    assert "(no grad_fn): it was computed under torch.no_grad()" in str(caught.value)
    remedy = "or only from frozen parameters; compute it from the model's output with autograd on"
    assert str(caught.value).endswith(remedy)


class Identity(Linear):
    def model(self) -> nn.Module:
        return nn.Identity()

    def loss(self, model, batch):
        x, y = batch
        return (model(x).sum(1, keepdim=True) - y).pow(2).mean()


class Frozen(Linear):
    def model(self) -> nn.Module:
        return nn.Linear(4, 1).requires_grad_(False)


@pytest.mark.parametrize(
    ("task", "held"),
    [(Identity(), "(no parameters at all)"), (Frozen(), "(2 parameters, all with requires_grad=False)")],
)
def test_a_model_with_nothing_to_train_is_refused_when_built(fit, task, held):
    with pytest.raises(TaskError) as caught:
        train(fit, task)
    assert str(caught.value).startswith(f"task.model() has no trainable parameters {held}")


class ForeignOptimizer(Linear):
    def optimizer(self, params):
        list(params)
        return torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)


def test_an_optimizer_over_tensors_it_was_not_given_is_refused(fit):
    with pytest.raises(TaskError) as caught:
        train(fit, ForeignOptimizer())
    message = str(caught.value)
    assert message.startswith("task.optimizer(params) built an optimizer over 1 tensor(s) that are not among")
    assert "not model.parameters()" in message


class PartialOptimizer(Linear):
    """The optimizer takes the weight only; with ``frozen_bias`` the bias is frozen anyway."""

    def __init__(self, frozen_bias: bool) -> None:
        self.frozen_bias = frozen_bias

    def model(self) -> nn.Module:
        model = nn.Linear(4, 1)
        model.bias.requires_grad_(not self.frozen_bias)
        return model

    def optimizer(self, params):
        weight, _bias = params
        return torch.optim.SGD([weight], lr=0.1)


def test_an_optimizer_that_leaves_trainable_parameters_out_is_warned_about(fit):
    with pytest.warns(LeantrainWarning, match=r"holds 1 of the 2 trainable parameters .* 1 are left"):
        train(fit, PartialOptimizer(frozen_bias=False), max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeantrainWarning)  # a frozen parameter left out is no mistake
        train(fit, PartialOptimizer(frozen_bias=True), max_steps=1)


class FailsAtCall(Linear):
    """Its ``method`` raises the user's own error on call ``at`` (1-based), as a bug would."""

    def __init__(self, method: str, at: int = 1) -> None:
        self.method, self.at, self.calls = method, at, 0

    def _maybe_fail(self, method: str) -> None:
        if method == self.method:
            self.calls += 1
            if self.calls == self.at:
                raise KeyError("the user's bug")

    def model(self):
        self._maybe_fail("model")
        return super().model()

    def optimizer(self, params):
        self._maybe_fail("optimizer")
        return super().optimizer(params)

    def loss(self, model, batch):
        self._maybe_fail("loss")
        return super().loss(model, batch)

    def augment(self, batch):
        self._maybe_fail("augment")
        return batch

    def train_data(self):
        self._maybe_fail("train_data")
        return super().train_data()

    def val_data(self):
        self._maybe_fail("val_data")
        return super().train_data()

    def metrics(self, model, batch):
        self._maybe_fail("metrics")
        return {}


def test_an_error_in_the_users_loss_keeps_its_type_and_says_where(fit):
    """The fourth loss call: step 2, micro-batch 2 of 2 (micro-batches of 4)."""
    with pytest.raises(KeyError, match="the user's bug") as caught:
        train(fit, FailsAtCall("loss", at=4), micro_batch_size=4)
    (note,) = caught.value.__notes__
    assert note == (
        "leantrain: raised in task.loss, at optimizer step 2, micro-batch 2 of 2; "
        "batch: [float32[4, 4], float32[4, 1]]"
    )


def test_the_users_shape_bug_keeps_torchs_error_and_gets_the_note(fit):
    class UserBug(Linear):
        def loss(self, model, batch):
            x, y = batch
            return ((model(x.T) - y) ** 2).mean()

    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as caught:
        train(fit, UserBug())
    (note,) = caught.value.__notes__
    assert note.startswith("leantrain: raised in task.loss, at optimizer step 1, micro-batch 1 of 1")
    assert "float32[8, 4], float32[8, 1]" in note


@pytest.mark.parametrize(
    ("method", "note"),
    [
        ("model", "leantrain: raised in task.model()"),
        ("train_data", "leantrain: raised in task.train_data()"),
        ("val_data", "leantrain: raised in task.val_data()"),
        ("optimizer", "leantrain: raised in task.optimizer(params)"),
        ("augment", "leantrain: raised in task.augment, at optimizer step 1, micro-batch 1 of 1; batch: ["),
        ("metrics", "leantrain: raised in task.metrics, in validation; batch: [float32[8, 4], float32["),
    ],
)
def test_errors_in_the_other_task_methods_name_the_method(fit, method, note):
    with pytest.raises(KeyError) as caught:
        train(fit, FailsAtCall(method), max_steps=1)
    (added,) = caught.value.__notes__
    assert added.startswith(note)


def test_the_engines_own_errors_get_no_note():
    """A LeantrainError raised during a task call (the memory budget's, say) says what is wrong already."""
    engine, users = TaskError("over the memory budget"), KeyError("x")
    for error in (engine, users):
        note_task_error(error, "task.loss")
    assert not hasattr(engine, "__notes__")
    assert users.__notes__ == ["leantrain: raised in task.loss"]


def test_a_second_call_on_the_same_batch_is_the_same_micro_batch():
    """A pipeline's last stage calls the loss twice on its first micro-batch when it starts."""
    task_loss = TaskLoss(FailsAtCall("loss", at=3))
    task_loss.start_step(3, 2)
    first, second = (torch.zeros(2, 4), torch.zeros(2, 1)), (torch.ones(2, 4), torch.ones(2, 1))
    model = nn.Linear(4, 1)
    task_loss(model, first)
    task_loss(model, first)
    with pytest.raises(KeyError) as caught:
        task_loss(model, second)
    assert (
        "at optimizer step 3, micro-batch 2 of 2; batch: (float32[2, 4], float32[2, 1])"
        in caught.value.__notes__[0]
    )


def test_the_plan_names_ragged_items_too():
    with pytest.raises(TaskError, match=r"^train_data items 0 and 3 differ at field \[0\]"):
        estimate_memory(BrokenItems("ragged"), lt.TrainConfig(global_batch_size=8))


def docs_errors_row(start: str) -> str:
    """The message that docs/errors.md's Task contract table shows for a row starting ``start``."""
    text = (Path(__file__).parents[1] / "docs" / "errors.md").read_text()
    [row] = [line for line in text.splitlines() if line.startswith(f"| {start}")]
    return row.split(" | ")[1].strip("` |")


def test_the_none_and_shape_messages_are_the_ones_docs_errors_md_shows():
    ragged = [(torch.zeros(4), torch.zeros(1)), (torch.zeros(5), torch.zeros(1))]
    with pytest.raises(TaskError) as caught:
        collate(ragged, [2, 3], "train_data")
    assert str(caught.value) == docs_errors_row("items of different shapes")
    shown = docs_errors_row("an item that is `None`")
    assert shown.endswith("; ...")
    with pytest.raises(TaskError) as caught:
        collate([(torch.zeros(4), 1)] * 5 + [None], [0, 1, 2, 3, 4, 5], "train_data")
    assert str(caught.value).startswith(shown.removesuffix("..."))


@pytest.mark.parametrize(
    ("first", "other", "difference"),
    [
        (torch.zeros(2), 3, "Tensor vs int"),
        (3, torch.zeros(2), "int vs Tensor"),
        (5, (1, 2), "int vs tuple"),
        ({"x": 1, "y": 2}, {"x": 1}, "keys ['x', 'y'] vs keys ['x']"),
        ({1: 1}, {"1": 1}, "keys ['1'] vs keys ['1']"),  # the keys differ, their printed forms do not
        (np.zeros(2), np.zeros(3), "shape [2] vs shape [3]"),
        ([1, 2], [1, 2, 3], "length 2 vs length 3"),
    ],
)
def test_collate_says_how_two_items_differ(first, other, difference):
    with pytest.raises(
        TaskError, match=r"^val_data items 10 and 11 differ: .*; the items of a batch"
    ) as caught:
        collate([first, other], [10, 11], "val_data")
    assert str(caught.value).split(" differ: ")[1].split("; ")[0] == difference


def test_collate_of_fewer_items_than_indices_names_the_items_it_has():
    """A dataset's own __getitems__ may return fewer items than it was asked for."""
    with pytest.raises(TaskError, match=r"^train_data items 4 and 5 differ: length 1 vs length 2;"):
        collate([[1], [1, 2]], [4, 5, 6], "train_data")
    with pytest.raises(TaskError, match=r"^train_data item 5 is None:"):
        collate([[1], None], [4, 5, 6], "train_data")
    with pytest.raises(TaskError, match=r"^train_data items \[4, 5, 6\] cannot be put into one batch: "):
        collate([object(), object()], [4, 5, 6], "train_data")


def test_items_that_collation_refuses_for_another_reason_get_its_own_words():
    items = [object(), object()]
    with pytest.raises(TypeError) as torch_error:
        torch.utils.data.default_collate(items)
    words = " ".join(str(torch_error.value).split())
    with pytest.raises(TaskError) as caught:
        collate(items, [7, 8], "train_data")
    assert str(caught.value) == f"train_data items [7, 8] cannot be put into one batch: TypeError: {words}"


class KeywordsOnly(Mapping):
    """A read-only mapping item whose class cannot be rebuilt from a dict, as collation tries to."""

    def __init__(self, *args, **fields) -> None:
        if args:
            raise ValueError("KeywordsOnly takes keywords:\n    KeywordsOnly(x=...)")
        self.fields = fields

    def __getitem__(self, key):
        return self.fields[key]

    def __iter__(self):
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)


def test_a_collation_error_of_several_lines_is_told_on_one():
    with pytest.raises(TaskError) as caught:
        collate([KeywordsOnly(x=1), KeywordsOnly(x=2)], [0, 1], "train_data")
    assert str(caught.value) == (
        "train_data items [0, 1] cannot be put into one batch: ValueError: "
        "KeywordsOnly takes keywords: KeywordsOnly(x=...)"
    )


class FailsOnce(TensorDataset):
    """Item 3 fails the first time only (a read that a retry would fix)."""

    def __init__(self) -> None:
        super().__init__(torch.zeros(8, 2))
        self.failed = False

    def __getitem__(self, index):
        if index == 3 and not self.failed:
            self.failed = True
            raise OSError("connection reset")
        return super().__getitem__(index)


def test_a_batch_that_fails_once_but_whose_items_load_alone_names_the_batch():
    loader = NamedItemErrors(FailsOnce(), "train_data")
    with pytest.raises(DataError) as caught:
        loader.__getitems__([2, 3, 4])
    assert str(caught.value) == "train_data items [2, 3, 4] failed: OSError: connection reset"


def test_an_item_read_alone_names_its_index():
    """Indexed one item at a time (as any Dataset may be), a failing item names its index too."""
    with pytest.raises(DataError) as caught:
        NamedItemErrors(FailsOnce(), "train_data")[3]
    assert str(caught.value) == "train_data item 3 failed: OSError: connection reset"
    assert torch.equal(NamedItemErrors(FailsOnce(), "train_data")[2][0], torch.zeros(2))
