from __future__ import annotations

import gc
import sys
import textwrap

import pytest
import torch
from torch import nn

import leantrain as lt
import leantrain.strategies
from leantrain.strategies.base import Strategy
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.registry import check_config, names, strategies, strategy_class
from tests.conftest import RegressionTask

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "world", "resolved"),
    [("auto", 1, "single"), ("auto", 2, "ddp"), ("ddp", 2, "ddp"), ("single", 1, "single"), ("dp", 1, "dp")],
)
def test_auto_resolves_by_the_number_of_processes(name, world, resolved):
    assert check_config(lt.TrainConfig(strategy=name), world).name == resolved


def test_an_unknown_strategy_lists_the_known_ones():
    with pytest.raises(
        lt.ConfigError, match=r"invalid strategy='ddpp': allowed: auto, ddp, dp, fsdp, pipeline"
    ):
        check_config(lt.TrainConfig(strategy="ddpp"))


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_multi_process_strategies_in_one_process_say_how_to_launch(name):
    cfg = lt.TrainConfig(strategy=name, precision="32")
    check_config(cfg)  # alone, before a launch: nothing is known of the processes yet
    with pytest.raises(lt.ConfigError, match="needs several processes: run `leantrain launch"):
        check_config(cfg, 1)


@pytest.mark.parametrize("name", ["single", "dp"])
def test_one_process_strategies_refuse_a_multi_process_launch(name):
    with pytest.raises(
        lt.ConfigError, match="runs in one process, but 2 were launched; use ddp, fsdp, pipeline"
    ):
        check_config(lt.TrainConfig(strategy=name), 2)


@pytest.mark.parametrize(
    ("fields", "field", "rule"),
    [
        ({"shard_blocks": "Block"}, "shard_blocks", "is used with strategy fsdp only"),
        ({"device_map": "cpu,cpu"}, "device_map", "is needed with strategy split, and only with it"),
        ({"pipeline_stages": 2}, "pipeline_stages", "is needed with strategy pipeline, and only with it"),
        ({"strategy": "split"}, "device_map", "is needed with strategy split, and only with it"),
        ({"strategy": "pipeline"}, "pipeline_stages", "is needed with strategy pipeline, and only with it"),
        (
            {"strategy": "split", "device_map": "cpu"},
            "device_map",
            "needs two or more comma-separated devices",
        ),
        (
            {"strategy": "split", "device_map": "cpu,cpu", "precision": "bf16-true"},
            "precision",
            "with strategy split: 32, bf16-mixed or 16-mixed",
        ),
    ],
)
def test_a_field_of_one_strategy_is_refused_with_any_other(fields, field, rule):
    cfg = lt.TrainConfig(**fields)  # a single field is fine alone: the rule is the strategy's
    with pytest.raises(lt.ConfigError) as caught:
        check_config(cfg)
    assert caught.value.field == field and rule in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("fields", "field", "allowed"),
    [
        ({"precision": "16-mixed"}, "precision", "with strategy fsdp: 32 or bf16-mixed (fp32 parameters"),
        ({"precision": "bf16-true"}, "precision", "with strategy fsdp: 32 or bf16-mixed"),
        ({"micro_batch_size": "auto"}, "strategy", "does not yet adapt the micro-batch"),
        ({"memory_budget": "1GiB"}, "strategy", "does not yet adapt the micro-batch"),
        ({"shard_blocks": "every:0"}, "shard_blocks", "comma-separated module class names"),
    ],
)
def test_fsdp_settings_it_cannot_run_are_refused(fields, field, allowed):
    with pytest.raises(lt.ConfigError) as caught:
        check_config(lt.TrainConfig(strategy="fsdp", **fields))
    assert caught.value.field == field and allowed in str(caught.value)
    cfg = lt.TrainConfig(strategy="fsdp", precision="bf16-mixed", shard_blocks="Block")
    assert check_config(cfg, 2).name == "fsdp"


def test_the_pipeline_stages_must_divide_the_processes_and_the_batch_the_pipelines():
    cfg = lt.TrainConfig(strategy="pipeline", pipeline_stages=2, global_batch_size=8, micro_batch_size=2)
    assert check_config(cfg, 4).dims(cfg, 4) == ParallelDims(dp=2, pp=2)
    with pytest.raises(
        lt.ConfigError, match="invalid pipeline_stages=2: must divide the number of processes 3"
    ):
        check_config(cfg, 3)
    with pytest.raises(lt.ConfigError, match="global_batch_size=8: must be a multiple of the world size 3"):
        check_config(cfg, 6)  # 3 pipelines of 2 stages share the global batch


def test_fit_checks_the_strategy_before_it_builds_anything(tmp_path):
    task = RegressionTask()
    with pytest.raises(lt.ConfigError, match="is needed with strategy split"):
        lt.Trainer(lt.TrainConfig(strategy="split", out_dir=str(tmp_path / "run"))).fit(task)
    assert not (tmp_path / "run").exists()


def test_the_single_strategy_communicates_nothing():
    strategy = strategy_class("single")(lt.TrainConfig(), CPU, ParallelDims())
    model = nn.Linear(2, 2)
    strategy.wrap(model, None)
    assert strategy.module is model and strategy.model is model
    tensor = torch.ones(3)
    assert strategy.all_reduce_sum(tensor) is tensor and strategy.any_rank(True) and strategy.gather(5) == [5]


def test_dp_warns_why_ddp_is_faster():
    strategy = strategy_class("dp")(lt.TrainConfig(), CPU, ParallelDims())
    with pytest.warns(UserWarning, match="DDP runs one process per GPU and communicates only gradients"):
        strategy.wrap(nn.Linear(2, 2), None)
    assert strategy.caveat is not None and "DistributedDataParallel" in strategy.caveat.title


@pytest.mark.parametrize(("gpus", "wrapped"), [(0, False), (1, False), (2, True)])
def test_dp_wraps_the_model_in_dataparallel_only_over_more_than_one_gpu(monkeypatch, gpus, wrapped):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    strategy = strategy_class("dp")(lt.TrainConfig(), CPU, ParallelDims())
    model = nn.Linear(2, 2)
    with pytest.warns(UserWarning):
        strategy.wrap(model, None)
    assert strategy.model is model
    if wrapped:  # (without CUDA, DataParallel holds the model and calls it as it is)
        assert isinstance(strategy.module, nn.DataParallel) and strategy.module.module is model
    else:
        assert strategy.module is model


def test_dp_trains_like_single_on_one_device(fit):
    with pytest.warns(UserWarning):
        dp = fit(RegressionTask(), global_batch_size=16, max_steps=3, strategy="dp")
    single = fit(RegressionTask(), global_batch_size=16, max_steps=3)
    assert dp.strategy == "dp"
    assert all(
        torch.equal(a, b) for a, b in zip(dp.model.parameters(), single.model.parameters(), strict=True)
    )


TOY = '''
"""A toy strategy: one process, float32 only, and a count of the steps it ran."""

from leantrain.strategies.base import Strategy


class Counting(Strategy):
    name = "counting"
    summary = "one process; counts its forward/backward calls"
    precisions = ("32",)
    steps = 0

    def forward_backward(self, *args, **kwargs):
        type(self).steps += 1
        return super().forward_backward(*args, **kwargs)
'''


@pytest.fixture
def toy_strategy(tmp_path, monkeypatch):
    """``counting.py`` as one more module of leantrain/strategies/ (a folder added to its path)."""
    (tmp_path / "counting.py").write_text(textwrap.dedent(TOY))
    monkeypatch.setattr(leantrain.strategies, "__path__", [*leantrain.strategies.__path__, str(tmp_path)])
    strategies.cache_clear()
    yield
    monkeypatch.undo()
    sys.modules.pop("leantrain.strategies.counting", None)
    gc.collect()  # the class is gone from Strategy.__subclasses__
    strategies.cache_clear()


def test_a_new_strategy_is_one_module_in_the_strategies_package(toy_strategy, fit, capsys):
    from leantrain.cli import build_parser

    assert "counting" in names()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", "--help"])
    assert "counting: one process; counts its forward/backward calls" in " ".join(
        capsys.readouterr().out.split()
    )
    with pytest.raises(lt.ConfigError, match="invalid precision='bf16-mixed': with strategy counting: 32"):
        check_config(lt.TrainConfig(strategy="counting", precision="bf16-mixed"))
    counted = fit(
        RegressionTask(), global_batch_size=16, micro_batch_size=4, max_steps=3, strategy="counting"
    )
    single = fit(RegressionTask(), global_batch_size=16, micro_batch_size=4, max_steps=3)
    counting = strategies()["counting"]
    assert counted.strategy == "counting" and counting.steps == 3 and issubclass(counting, Strategy)
    for name, value in single.model.state_dict().items():
        assert torch.equal(counted.model.state_dict()[name], value), name


def test_the_toy_strategy_leaves_no_trace():
    assert "counting" not in names()


def test_a_strategy_of_whole_checkpoints_refuses_sharded_ones_naming_itself(tmp_path):
    """The default of a new strategy that sets `sharded` without saving shards: a line naming it."""
    single = strategy_class("single")(lt.TrainConfig(), torch.device("cpu"), ParallelDims())
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match=r"^strategy single saves whole checkpoints$"):
        single.save_sharded(tmp_path, optimizer, {})
    with pytest.raises(NotImplementedError, match=r"^strategy single loads whole checkpoints$"):
        single.load_sharded(tmp_path, optimizer, tmp_path / "step-00000001.pt")
