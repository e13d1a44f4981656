"""BatchNorm layers normalise over the micro-batch: the one place where the split changes the math.
The run says so once, naming the layers and the remedies; it stays silent where nothing splits."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

import leantrain as lt
from leantrain.cli import main
from leantrain.memory.estimate import estimate_memory
from leantrain.step.batch_norm import batch_norm_layers, split_statistics_warning, to_sync_batch_norm
from leantrain.step.batching import BatchSplit
from leantrain.strategies import ddp
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.registry import check_config, strategy_class
from tests.conftest import HeavyFromStep, RegressionTask
from tests.memory.test_adaptive import budget_for

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class WithBatchNorm(RegressionTask):
    """The regression MLP with a BatchNorm1d after its first layer."""

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double()


def batch_norm_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "BatchNorm" in str(w.message)]


def test_accumulation_with_batch_norm_is_told_once_and_the_weights_do_follow_the_split(fit):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = fit(WithBatchNorm(), global_batch_size=16, micro_batch_size=4, max_steps=3, shuffle=False)
    told = batch_norm_warnings(caught)
    assert len(told) == 1
    assert told[0] == (
        "1 BatchNorm layer(s) (1) normalise each micro-batch of 4 samples, not the global batch of 16: "
        "their statistics, and so the gradients, follow the split (the one place it changes the math). "
        "Remedies: no accumulation (micro_batch_size 16); GroupNorm or LayerNorm in place of BatchNorm"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole = fit(WithBatchNorm(), global_batch_size=16, max_steps=3, shuffle=False)
    assert batch_norm_warnings(caught) == []  # one forward over the global batch: nothing to say
    # What the warning claims, for real: the same data and steps, other weights.
    difference = max(
        float((split.model.state_dict()[name] - value).abs().max())
        for name, value in whole.model.state_dict().items()
        if value.is_floating_point()
    )
    assert difference > 1e-6


def test_a_model_without_batch_norm_is_not_warned_about(fit):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(RegressionTask(), global_batch_size=16, micro_batch_size=4, max_steps=1)
    assert batch_norm_warnings(caught) == []


class HeavyWithBatchNorm(HeavyFromStep):
    def model(self) -> nn.Module:
        return nn.Sequential(nn.BatchNorm1d(6), super().model()).double()


def test_a_micro_batch_halved_after_out_of_memory_is_told_with_its_new_size(fit):
    # On the CPU, where the budget is counted (tests/memory/conftest.py): a budget of some KiB caps a
    # CUDA allocator below one 2 MiB block (on an H100 the run failed copying a batch to the GPU).
    # The real allocator's out-of-memory retry: tests/test_cuda.py.
    budget = budget_for(HeavyWithBatchNorm(), 4, global_batch_size=16)
    task = HeavyWithBatchNorm(heavy=False, after_step=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            task,
            callbacks=[task],
            global_batch_size=16,
            micro_batch_size=8,
            memory_budget=budget,
            max_steps=4,
            device="cpu",
        )
    told = batch_norm_warnings(caught)
    assert [text.split(":")[0] for text in told] == [
        "1 BatchNorm layer(s) (0) normalise each micro-batch of 8 samples, not the global batch of 16",
        "1 BatchNorm layer(s) (0) normalise each micro-batch of 4 samples, not the global batch of 16",
    ]


def test_several_processes_name_their_share_and_sync_batch_norm_where_it_helps():
    layers = {"features.1": False, "features.4": False, "head.0": False, "head.2": False}
    text = split_statistics_warning(layers, BatchSplit(32, 16, world_size=2))
    assert text is not None
    assert text.startswith(
        "4 BatchNorm layer(s) (features.1, features.4, head.0 and 1 more) normalise each micro-batch "
        "of 16 samples on each of 2 processes, not the global batch of 32"
    )
    assert text.endswith(
        "Remedies: GroupNorm or LayerNorm in place of BatchNorm; --sync-batchnorm true (ddp or fsdp, on CUDA)"
    )  # no accumulation to remove
    # Where --sync-batchnorm cannot apply (CPU, a pipeline), it is not offered.
    unsyncable = split_statistics_warning(layers, BatchSplit(32, 16, world_size=2), can_sync=False)
    assert unsyncable is not None and unsyncable.endswith(
        "Remedies: GroupNorm or LayerNorm in place of BatchNorm"
    )
    # A SyncBatchNorm normalises over every process's micro-batch together: only accumulation splits it.
    assert split_statistics_warning({"bn": True}, BatchSplit(32, 16, world_size=2)) is None
    synced = split_statistics_warning({"bn": True}, BatchSplit(32, 8, world_size=2))
    assert synced is not None
    assert synced.startswith(
        "1 BatchNorm layer(s) (bn) normalise each micro-batch of 16 samples (8 from each of 2 processes, "
        "synchronised), not the global batch of 32"
    )  # not a share of each process: the processes' micro-batches are normalised together
    assert "(micro_batch_size 16)" in synced and "--sync-batchnorm" not in synced  # it is one already


def test_every_kind_of_batch_norm_is_found_by_its_name():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyBatchNorm1d(), nn.LayerNorm(4)
    )
    model[3] = nn.SyncBatchNorm(4)
    assert batch_norm_layers(model) == {"1": False, "3": True}
    assert batch_norm_layers(nn.BatchNorm1d(3)) == {"BatchNorm1d": False}  # the model itself
    assert batch_norm_layers(nn.Linear(2, 2)) == {}
    assert split_statistics_warning({}, BatchSplit(16, 4)) is None


def test_the_warning_is_a_leantrain_warning(fit):
    with pytest.warns(
        lt.LeantrainWarning, match=r"^1 BatchNorm layer\(s\) \(1\) normalise each micro-batch of 8"
    ):
        fit(WithBatchNorm(), global_batch_size=16, micro_batch_size=8, max_steps=1)


def test_plan_leaves_out_the_micro_batch_that_batch_norm_cannot_train_on():
    """BatchNorm needs more than one value per channel in training: no micro-batch of one sample."""
    estimate = estimate_memory(WithBatchNorm(), lt.TrainConfig(global_batch_size=8))
    assert [row.micro_batch_size for row in estimate.rows] == [2, 4, 8]
    assert [
        row.micro_batch_size
        for row in estimate_memory(RegressionTask(), lt.TrainConfig(global_batch_size=8)).rows
    ] == [1, 2, 4, 8]
    with pytest.raises(lt.ConfigError) as caught:
        estimate_memory(WithBatchNorm(), lt.TrainConfig(global_batch_size=8, micro_batch_size=1))
    assert str(caught.value).startswith(
        "invalid micro_batch_size=1: task.loss fails in training on a micro-batch"
    )


def test_a_loss_that_fails_at_every_micro_batch_is_the_tasks_own_error():
    class Broken(RegressionTask):
        def loss(self, model, batch):
            raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        estimate_memory(Broken(), lt.TrainConfig(global_batch_size=8))


# --sync-batchnorm: SyncBatchNorm layers under ddp and fsdp on CUDA, a one-line error elsewhere.

CONVERTED_ONE = "sync_batchnorm: 1 BatchNorm layer(s) converted to SyncBatchNorm"


def test_the_flag_on_cpu_is_one_line_naming_it_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["fit", "--sync-batchnorm", "true", "--device", "cpu", "--out", str(out)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "leantrain: error: invalid sync_batchnorm=True: torch's SyncBatchNorm runs on CUDA only, not on "
        "cpu; run on CUDA devices, or set it false (each process's BatchNorm layers then normalise its "
        "own micro-batch)"
    )
    assert not out.exists()
    with pytest.raises(lt.ConfigError) as caught:  # whatever the strategy: none syncs on the CPU
        check_config(lt.TrainConfig(strategy="fsdp", device="cpu", sync_batchnorm=True), 2)
    assert caught.value.field == "sync_batchnorm"


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_device_auto_is_checked_in_the_process_where_it_becomes_a_device(name):
    cfg = lt.TrainConfig(strategy=name, sync_batchnorm=True)
    cls = check_config(cfg, 2)  # not refused by a launcher, or a SLURM submission host, without GPUs
    with pytest.raises(
        lt.ConfigError,
        match=r"^invalid sync_batchnorm=True: torch's SyncBatchNorm runs on CUDA only, not on cpu "
        r"\(device auto found no CUDA device\); run on CUDA devices, or set it false",
    ):
        cls.input_device(cfg, CPU)  # Trainer.fit, before the process group, with auto resolved here
    assert cls.input_device(cfg, torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert cls.input_device(cfg.replace(sync_batchnorm=False), CPU) == CPU


def test_the_strategy_says_where_the_flag_would_apply_for_the_warnings_remedies():
    cuda = torch.device("cuda", 0)
    assert [name for name in ("ddp", "fsdp") if strategy_class(name).can_sync_batch_norm(cuda)] == [
        "ddp",
        "fsdp",
    ]
    assert not any(strategy_class(name).can_sync_batch_norm(CPU) for name in ("ddp", "fsdp"))
    assert not any(
        strategy_class(name).can_sync_batch_norm(cuda) for name in ("single", "dp", "split", "pipeline")
    )


@pytest.mark.parametrize(
    ("fields", "world_size", "why"),
    [
        ({}, 1, "strategy single runs one process, with no other process's micro-batch to share"),
        ({"strategy": "dp"}, 1, "strategy dp runs one process"),
        ({"strategy": "split", "device_map": "cpu,cpu"}, 1, "strategy split runs one process"),
        (
            {"strategy": "pipeline", "pipeline_stages": 2},
            4,
            "strategy pipeline does not run the whole model in each process, as SyncBatchNorm needs",
        ),
    ],
)
def test_a_strategy_whose_processes_cannot_share_statistics_is_refused(fields, world_size, why):
    with pytest.raises(lt.ConfigError) as caught:
        check_config(lt.TrainConfig(sync_batchnorm=True, **fields), world_size)
    message = str(caught.value)
    assert caught.value.field == "sync_batchnorm" and "\n" not in message
    assert message.startswith(f"invalid sync_batchnorm=True: {why}")
    assert message.endswith(
        "; use ddp or fsdp on several CUDA devices (leantrain launch --nproc-per-node N fit ...), "
        "or set it false"
    )


def test_fit_in_one_process_refuses_the_flag_before_it_builds_anything(tmp_path):
    with pytest.raises(lt.ConfigError, match=r"^invalid sync_batchnorm=True: strategy single runs one"):
        lt.Trainer(lt.TrainConfig(sync_batchnorm=True, out_dir=str(tmp_path / "run"))).fit(WithBatchNorm())
    assert not (tmp_path / "run").exists()


def test_the_conversion_keeps_the_parameters_and_names_the_layers_it_converted():
    """The seam the strategies use; the conversion runs on the CPU (only a synced forward needs CUDA)."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.BatchNorm1d(64))
    model.append(nn.SyncBatchNorm(64))
    params, running_mean = list(model.parameters()), model[1].running_mean
    converted, names = to_sync_batch_norm(model)
    assert converted is model  # in place: the run's reference to the model sees the new layers
    assert names == ["1", "3"]  # "4" was a SyncBatchNorm already
    assert batch_norm_layers(converted) == {"1": True, "3": True, "4": True}
    # The optimizer is built over these parameters after wrapping: they must be the ones trained.
    assert all(a is b for a, b in zip(params, converted.parameters(), strict=True))
    assert converted[1].running_mean is running_mean
    layer, names = to_sync_batch_norm(nn.BatchNorm1d(3))  # the model itself: a new module
    assert isinstance(layer, nn.SyncBatchNorm) and names == ["BatchNorm1d"]
    assert to_sync_batch_norm(nn.Linear(2, 2))[1] == []


def test_ddp_wraps_the_converted_model_and_notes_how_many_layers(monkeypatch):
    given: list[dict[str, bool]] = []

    def distributed_data_parallel(module: nn.Module, **options) -> nn.Module:
        # DDP itself refuses SyncBatchNorm layers on the CPU: see what it is given, when it is given it.
        given.append(batch_norm_layers(module))
        return module

    monkeypatch.setattr(ddp, "DistributedDataParallel", distributed_data_parallel)
    cfg = lt.TrainConfig(strategy="ddp", sync_batchnorm=True)
    strategy = strategy_class("ddp")(cfg, CPU, ParallelDims(dp=2))
    strategy.wrap(WithBatchNorm().model(), None)
    assert given == [{"1": True}] and batch_norm_layers(strategy.model) == {"1": True}
    assert strategy.notes == [CONVERTED_ONE]
    plain = strategy_class("ddp")(cfg.replace(sync_batchnorm=False), CPU, ParallelDims(dp=2))
    plain.wrap(WithBatchNorm().model(), None)
    assert given[-1] == {"1": False} and plain.notes == []
    # Nothing to convert: said once, by rank 0, as the run's own warnings are.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy_class("ddp")(cfg, CPU, ParallelDims(dp=2)).wrap(RegressionTask().model(), None)
    assert caught == []


@contextmanager
def one_process_group(backend: str) -> Iterator[None]:
    """A process group of this process alone: what a strategy's wrap needs, without a launch."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_shards_the_converted_model_and_warns_when_there_is_nothing_to_convert(monkeypatch):
    import torch.distributed.fsdp as fsdp  # as the strategy does: only when used (a slow import)

    sharded: list[dict[str, bool]] = []
    fully_shard = fsdp.fully_shard

    def recording_fully_shard(module: nn.Module, **options):
        sharded.append(batch_norm_layers(module))  # each unit as it is sharded, the root last
        return fully_shard(module, **options)

    monkeypatch.setattr(fsdp, "fully_shard", recording_fully_shard)
    cfg = lt.TrainConfig(strategy="fsdp", sync_batchnorm=True)
    with one_process_group("gloo"):
        strategy = strategy_class("fsdp")(cfg, CPU, ParallelDims(dp=1))
        strategy.wrap(WithBatchNorm().model(), None)
        assert sharded[-1] == {"1": True} and batch_norm_layers(strategy.model) == {"1": True}  # root last
        assert strategy.notes == [CONVERTED_ONE]
        without = strategy_class("fsdp")(cfg, CPU, ParallelDims(dp=1))
        with pytest.warns(
            lt.LeantrainWarning,
            match="^sync_batchnorm is true but the model has no BatchNorm layer to convert",
        ):
            without.wrap(RegressionTask().model(), None)
        assert without.notes == []


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_on_cuda_the_strategy_trains_through_sync_batch_norm(name):
    """The run's own path, in one process: the config's rules, the device check, wrap, a training step."""
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = lt.TrainConfig(strategy=name, sync_batchnorm=True, device="cuda")
    cls = check_config(cfg, 2)
    assert cls.input_device(cfg, device) == device
    with one_process_group("nccl"):
        strategy = cls(cfg, device, ParallelDims(dp=1))
        strategy.wrap(WithBatchNorm().model().to(device), None)
        assert batch_norm_layers(strategy.model) == {"1": True} and strategy.notes == [CONVERTED_ONE]
        strategy.module(torch.randn(8, 6, dtype=torch.float64, device=device)).square().sum().backward()
        assert all(param.grad is not None for param in strategy.model.parameters())
