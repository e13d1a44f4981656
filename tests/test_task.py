from __future__ import annotations

import sys
import textwrap

import pytest

import leantrain as lt
from leantrain.task import check_task


@pytest.fixture
def task_module(tmp_path, monkeypatch):
    source = textwrap.dedent(
        """
        import torch
        from torch import nn

        class Good:
            def model(self): return nn.Linear(2, 1)
            def train_data(self): return [(torch.zeros(2), torch.zeros(1))] * 4
            def loss(self, model, batch): return model(batch[0]).sum()
            def optimizer(self, params): return torch.optim.SGD(params, lr=0.1)

        def make_good():
            return Good()

        def needs_args(size):
            return Good()

        class Incomplete:
            def model(self): return nn.Linear(2, 1)

        NOT_CALLABLE = 3
        """
    )
    (tmp_path / "user_tasks.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_tasks"
    sys.modules.pop("user_tasks", None)


def test_load_task_from_class_and_factory(task_module):
    assert type(lt.load_task(f"{task_module}:Good")).__name__ == "Good"
    assert type(lt.load_task(f"{task_module}:make_good")).__name__ == "Good"
    assert isinstance(lt.load_task(f"{task_module}:Good"), lt.Task)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "is not of the form 'pkg.module:Name'"),
        (":Name", "is not of the form"),
        ("missing_module_xyz:Task", "cannot import module 'missing_module_xyz'"),
        ("user_tasks:Nope", "has no attribute 'Nope'"),
        ("user_tasks:NOT_CALLABLE", "neither a class nor a factory"),
        ("user_tasks:needs_args", "must be callable with no arguments"),
        ("user_tasks:Incomplete", "lacks the method(s) train_data, loss, optimizer"),
    ],
)
def test_load_task_errors_are_one_line(task_module, spec, message):
    with pytest.raises(lt.TaskError) as caught:
        lt.load_task(spec)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_loss_sum_is_a_named_pair():
    import torch

    pair = lt.LossSum(torch.tensor(3.0), 2)
    total, count = pair
    assert float(total) == 3.0 and count == 2 and pair.count == 2


def test_check_task_accepts_any_object_with_the_methods():
    class Duck:
        model = train_data = loss = optimizer = staticmethod(lambda *a: None)

    assert check_task(Duck(), "duck")
