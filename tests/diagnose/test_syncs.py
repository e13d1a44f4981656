"""The host-sync and retained-graph detectors, on hand-written code with known lines."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain.diagnose import HostSyncs, RetainedGraphs
from leantrain.step.accumulator import Accumulator
from leantrain.step.batching import BatchSplit
from leantrain.step.losses import LossTracker
from leantrain.step.precision import Fp32
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.single import Single
from tests.diagnose import lines


def line_of(marker: str) -> int:
    return lines.line_of(__file__, marker)


def every_kind_of_sync(value: torch.Tensor) -> None:
    value.item()  # sync:item
    value.tolist()  # sync:tolist
    bool(value > 0)  # sync:bool
    if value > 0:  # sync:if
        pass
    float(value)  # sync:float
    repr(value)  # sync:repr
    f"{value:.3f}"  # sync:format
    value.cpu()  # sync:cpu
    value.to("cpu")  # already there: no copy, no sync
    value.detach().numpy()  # sync:numpy
    torch.cuda.empty_cache()  # sync:empty_cache


def test_every_sync_call_is_found_with_its_line() -> None:
    value = torch.tensor(1.5)
    with HostSyncs() as syncs:
        for _ in range(3):
            every_kind_of_sync(value)
    found = {(s.call, s.line): s.count for s in syncs.sites()}
    expected = {
        (".item()", "item"), (".tolist()", "tolist"), ("bool(tensor)", "bool"), ("bool(tensor)", "if"),
        ("float(tensor)", "float"), ("print(tensor)", "repr"), ("format(tensor)", "format"),
        (".cpu()", "cpu"), (".numpy()", "numpy"),
        ("torch.cuda.empty_cache()", "empty_cache"),
    }  # fmt: skip
    assert found == {(call, line_of(f"sync:{marker}")): 3 for call, marker in expected}
    assert all(s.file == __file__ for s in syncs.sites())


def test_a_copy_from_a_device_to_the_cpu_is_a_sync() -> None:
    on_device = torch.empty(2, device="meta")  # any device but the CPU
    with HostSyncs() as syncs, pytest.raises(NotImplementedError):
        on_device.to("cpu")  # sync:to
    assert [(s.call, s.line) for s in syncs.sites()] == [('.to("cpu")', line_of("sync:to"))]


def test_an_optimizers_step_counters_are_not_syncs() -> None:
    """Adam reads its step counters, host scalars, with .item(): no device is waited for."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    with HostSyncs() as syncs:
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
    assert syncs.sites() == []


def test_device_arithmetic_and_moves_to_other_devices_are_not_syncs() -> None:
    value = torch.ones(4, requires_grad=True)
    with HostSyncs() as syncs:
        loss = (value * 2).sum()
        loss.backward()
        value.detach().to(torch.float64)  # a cast on the same device: no host read
        torch.where(loss > 0, loss, -loss)  # a decision on the device
    assert syncs.sites() == []


def test_only_watched_device_counts_and_paused_counts_nothing() -> None:
    value = torch.tensor(2.0)
    with HostSyncs(device="cuda") as syncs:
        value.item()  # a CPU tensor: no sync on a CUDA run
    assert syncs.sites() == []
    with HostSyncs(device="cpu") as syncs:
        syncs.paused = True
        value.item()
        syncs.paused = False
        value.item()  # sync:unpaused
    assert [(s.line, s.count) for s in syncs.sites()] == [(line_of("sync:unpaused"), 1)]


def test_torch_cuda_functions_are_restored_after() -> None:
    original = torch.cuda.synchronize
    with HostSyncs():
        assert torch.cuda.synchronize is not original
    assert torch.cuda.synchronize is original


def test_the_engines_planned_read_is_counted_apart_from_user_code() -> None:
    """Accumulator._check_finite reads the loss once per step: leantrain's, not the user's."""
    model = torch.nn.Linear(3, 1)
    plan = BatchSplit(global_batch_size=4, micro_batch_size=4, world_size=1)
    strategy = Single(lt.TrainConfig(), torch.device("cpu"), ParallelDims())
    strategy.wrap(model, None)
    accumulator = Accumulator(plan, Fp32(), strategy, list(model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter([torch.randn(4, 3) for _ in range(2)])
    with HostSyncs() as syncs:
        for step in range(2):
            accumulator.step(optimizer, lambda m, b: m(b).pow(2).mean(), batches, step, LossTracker())
    assert syncs.sites() == []
    engine = syncs.sites(engine=True)
    assert [s.call for s in engine] == [".item()"] and engine[0].count == 2
    assert engine[0].file.endswith("accumulator.py")


def test_a_kept_loss_is_found_where_it_was_created() -> None:
    model = torch.nn.Linear(3, 1)
    kept = []
    graphs = RetainedGraphs()
    with graphs:
        for _ in range(3):
            loss = model(torch.randn(2, 3)).pow(2).mean()  # graph:created
            loss.backward()
            kept.append(loss)
    del loss
    retained = graphs.alive()
    assert [(g.file, g.line, g.tensors) for g in retained] == [(__file__, line_of("graph:created"), 3)]
    assert retained[0].bytes == 3 * 4  # three float32 scalars
    kept.clear()
    assert graphs.alive() == []


def test_a_clean_loop_retains_nothing() -> None:
    model = torch.nn.Linear(3, 1)
    total = torch.zeros(())
    graphs = RetainedGraphs()
    with graphs:
        for _ in range(3):
            loss = model(torch.randn(2, 3)).pow(2).mean()
            loss.backward()
            total += loss.detach()
    del loss
    assert graphs.alive() == []
