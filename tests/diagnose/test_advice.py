"""Verdict and advice rules, on measurements made up to exercise each rule."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from leantrain.diagnose import HostSync, Measurements, RetainedGraph, RunFacts, advise, loader_facts, verdict
from leantrain.diagnose.advice import CompileTrial
from leantrain.diagnose.timer import PHASES
from leantrain.memory.accountant import MemoryBreakdown
from leantrain.step.compilation import CompilerEvent
from leantrain.strategies.registry import strategy_class


def phases(**ms: float) -> dict[str, float]:
    """Seconds per phase from milliseconds; ``total`` is their sum."""
    seconds = {p: ms.get(p, 0.0) / 1000 for p in PHASES}
    return {**seconds, "total": sum(seconds.values())}


COMPUTE = phases(forward=40, backward=80, optimizer=5, other=1)


def test_a_clean_compute_run_is_compute_bound_with_no_advice() -> None:
    m = Measurements(COMPUTE)
    assert verdict(RunFacts(), m) == "compute-bound"
    assert advise(RunFacts(num_workers=0, auto_workers=2, available_cpus=2), m) == []  # model unknown
    assert advise(RunFacts(compile="blocks", repeated_blocks=True), m) == []


def test_compiling_is_advised_on_a_measured_trial_only() -> None:
    m = Measurements(COMPUTE)  # 126 ms a step
    faster = CompileTrial("blocks", step_seconds=0.063, compile_seconds=12.5)
    (advice,) = advise(RunFacts(repeated_blocks=True), Measurements(COMPUTE, compile_trial=faster))
    assert advice.change.startswith("--compile blocks") and advice.speedup == pytest.approx(2.0)
    assert (
        advice.evidence
        == "measured: 126.0 ms per step eagerly, 63.0 ms with --compile blocks after 12.5 s of compiling"
    )
    assert advice.expected_gain == "2.00x samples/s after the first steps"
    slower = CompileTrial("blocks", step_seconds=0.128, compile_seconds=12.5)  # as on this CPU
    assert advise(RunFacts(repeated_blocks=True), Measurements(COMPUTE, compile_trial=slower)) == []
    assert advise(RunFacts(repeated_blocks=True), m) == []  # no trial, no claim
    assert RunFacts(repeated_blocks=False).compile_to_try == "model"
    assert RunFacts(repeated_blocks=True, compile="blocks").compile_to_try is None
    assert RunFacts().compile_to_try is None  # the model is not known


def test_graph_breaks_and_repeated_recompilations_are_advised_by_place() -> None:
    events = [
        CompilerEvent("graph break", "model.py:12", "Unsupported Tensor.item() call"),
        CompilerEvent("recompilation", "model.py:30", "tensor 'x' size mismatch at index 0", count=4),
        CompilerEvent("recompilation", "model.py:40", "GLOBAL_STATE changed: grad_mode"),  # once: expected
    ]
    found = advise(RunFacts(compile="blocks"), Measurements(COMPUTE, compiler_events=events))
    assert [a.title for a in found] == [
        "torch.compile graph break at model.py:12",
        "torch.compile recompiled 4 times at model.py:30",
    ]
    assert "Tensor.item()" in found[0].evidence


def test_data_wait_is_data_bound_and_workers_come_first() -> None:
    m = Measurements(phases(data=100, forward=3, backward=5, optimizer=2))
    facts = RunFacts(
        num_workers=0, auto_workers=2, available_cpus=2, items_repeat=True, task_flags="--example x"
    )
    assert verdict(facts, m) == "data-bound"
    advice = advise(facts, m)
    assert [a.title for a in advice] == [
        "load data in more worker processes",
        "preprocess the data once into a memory-mapped cache",
    ]
    assert advice[0].change.startswith("--num-workers auto")
    # 2 workers halve the 100 ms of loading; the other 10 ms are hidden behind it
    assert advice[0].expected_gain == f"up to {110 / 50:.2f}x samples/s"
    assert "leantrain cache --example x --out DIR" in advice[1].change
    assert advice[1].expected_gain.startswith(f"up to {110 / 10:.1f}x")


def test_busy_workers_bound_the_gain_by_their_own_throughput() -> None:
    m = Measurements(phases(data=90, forward=10))  # 1 worker loads a step in 100 ms
    [workers] = [
        a for a in advise(RunFacts(num_workers=1, auto_workers=4, available_cpus=4), m) if "worker" in a.title
    ]
    assert workers.expected_gain == f"up to {100 / 25:.2f}x samples/s"


def test_random_items_are_not_cached_as_they_are() -> None:
    m = Measurements(phases(data=100, forward=10))
    facts = RunFacts(num_workers=2, auto_workers=2, available_cpus=2, items_repeat=False)
    [cache] = [a for a in advise(facts, m) if "cache" in a.change]
    assert "Task.augment" in cache.title


def test_threads_competing_with_workers_are_flagged_only_when_data_bound() -> None:
    facts = RunFacts(num_workers=2, auto_workers=2, available_cpus=2, torch_threads=2, cache="c")
    data_bound = Measurements(phases(data=50, forward=10))
    assert [a.change.split()[0] for a in advise(facts, data_bound)] == ["OMP_NUM_THREADS=1"]
    assert advise(facts, Measurements(COMPUTE)) == []


def test_communication_bound_suggests_fewer_bytes_then_more_samples() -> None:
    m = Measurements(phases(forward=20, backward=30, communication=50))
    facts = RunFacts(strategy="ddp", world_size=2, global_batch_size=64)
    assert verdict(facts, m) == "communication-bound"
    advice = advise(facts, m)
    assert [a.change.split()[0] for a in advice] == ["--precision", "--global-batch-size"]
    assert advice[0].expected_gain == f"up to {100 / 75:.2f}x"
    assert "--global-batch-size 128" in advice[1].change


def test_tensor_parallel_communication_advises_fewer_ranks_per_group() -> None:
    """Activations at every block: halving the group halves its collectives' bytes per rank (tp 4 -> 2);
    a group of 2 is undone entirely (FSDP alone), its collectives gone."""
    m = Measurements(phases(forward=20, backward=30, communication=50))  # 100 ms a step
    assert verdict(RunFacts(tensor_parallel=2), m) == "communication-bound"
    [pair] = advise(RunFacts(tensor_parallel=2), m)
    [four] = advise(RunFacts(tensor_parallel=4), m)
    assert (pair.title, pair.tier, four.title) == ("fewer ranks per tensor-parallel group", 2, pair.title)
    assert pair.evidence == (
        "the step waits 50.0 ms of 100.0 ms for tensor parallelism's collectives (activations all-reduced, "
        "gathered or reduce-scattered at every block, over 2 ranks)"
    )
    assert pair.change == (
        "--tp 1 --strategy fsdp  (if the state fits sharded alone); on a cluster, keep each group inside a "
        "node"
    )
    assert four.change == "--tp 2; on a cluster, keep each group inside a node"
    assert advise(RunFacts(tensor_parallel=8), m)[0].change.startswith("--tp 4; ")
    [three] = advise(RunFacts(tensor_parallel=3), m)  # halved, 3 is 1 too
    assert (three.change, three.speedup) == (pair.change, pair.speedup)
    assert (pair.speedup, pair.expected_gain) == (
        2.0,
        "up to 2.00x, less what the data-parallel side then communicates",
    )
    assert (four.speedup, four.expected_gain[:12]) == (100 / 75, "up to 1.33x,")


def test_host_sync_time_on_an_accelerator_decides_the_verdict() -> None:
    sync = HostSync(".item()", "/code/train.py", 12, count=4, seconds=0.12)
    m = Measurements(phases(forward=30, backward=30, other=60), host_syncs=[sync], audited_steps=2)
    assert verdict(RunFacts(device_type="cuda", pin_memory=True), m) == "host-sync-bound"
    [advice] = advise(RunFacts(device_type="cuda", pin_memory=True), m)
    assert advice.evidence == ".item() runs 2 time(s) per step at /code/train.py:12"
    assert advice.expected_gain.startswith(f"up to {120 / 60:.2f}x")
    # On the CPU the same call costs nothing measurable: found, but no verdict and no gain.
    cheap = HostSync(".item()", "/code/train.py", 12, count=4, seconds=1e-6)
    cpu = Measurements(COMPUTE, host_syncs=[cheap], audited_steps=2)
    assert verdict(RunFacts(), cpu) == "compute-bound"
    assert advise(RunFacts(), cpu)[0].expected_gain.startswith("none on this CPU run")


def test_retained_graphs_come_first() -> None:
    m = Measurements(
        COMPUTE,
        host_syncs=[HostSync("bool(tensor)", "/a.py", 3, 2, 0.0)],
        retained_graphs=[RetainedGraph("/a.py", 7, 4, 16)],
    )
    titles = [a.title for a in advise(RunFacts(), m)]
    assert titles == [
        "stop keeping autograd graphs alive (/a.py:7)",
        "remove the host sync bool(tensor) at /a.py:3",
    ]


def test_memory_pressure_and_out_of_memory_are_memory_bound() -> None:
    memory = MemoryBreakdown(400, 400, 800, 2000)
    tight = Measurements(COMPUTE, memory=memory)
    assert verdict(RunFacts(memory_budget=3800), tight) == "memory-bound"
    assert verdict(RunFacts(memory_budget=10_000), tight) == "compute-bound"
    assert verdict(RunFacts(micro_batch_halved=True), Measurements(COMPUTE)) == "memory-bound"
    assert (
        "--activation-checkpointing"
        in advise(RunFacts(micro_batch_halved=True), Measurements(COMPUTE))[0].change
    )


def test_a_micro_batch_far_below_the_budget_is_raised() -> None:
    # micro-batch 2 of 32 per process saves 1 MB; state 1 MB; budget 100 MB: 32 fits (16 MB)
    memory = MemoryBreakdown(250_000, 250_000, 500_000, 1_000_000)
    facts = RunFacts(
        micro_batch_size=2, accumulation_steps=16, global_batch_size=32, memory_budget=100_000_000
    )
    [advice] = advise(facts, Measurements(COMPUTE, memory=memory))
    assert advice.change.startswith("--micro-batch-size 32")
    # budget 4 MB: 3.6 MB less 1 MB of state leaves room for 5 samples; micro-batch 4 is below 4x
    small = RunFacts(micro_batch_size=2, accumulation_steps=16, memory_budget=4_000_000)
    assert advise(small, Measurements(COMPUTE, memory=memory)) == []


def test_all_reduce_on_every_micro_batch_is_flagged() -> None:
    comm = phases(forward=20, backward=20, communication=40)
    m = Measurements(comm, backward_calls=8, backwards_with_all_reduce=8)
    facts = RunFacts(strategy="ddp", world_size=2, accumulation_steps=4, global_batch_size=64)
    titles = [a.title for a in advise(facts, m)]
    assert titles[0] == "all-reduce gradients once per optimizer step, not per micro-batch"
    once = Measurements(m.phases, backward_calls=8, backwards_with_all_reduce=2)
    assert "all-reduce gradients once per optimizer step, not per micro-batch" not in [
        a.title for a in advise(facts, once)
    ]


@pytest.mark.parametrize(("facts", "title"), [
    (RunFacts(strategy="dp", strategy_caveat=strategy_class("dp").caveat),
     "use DistributedDataParallel instead of DataParallel"),
    (RunFacts(num_workers=2, persistent_workers=False), "keep DataLoader workers alive between epochs"),
    (RunFacts(device_type="cuda", pin_memory=False), "pin host batches"),
    (RunFacts(fast_16bit_ratio=8.0), "compute in bf16"),
])  # fmt: skip
def test_configuration_smells(facts: RunFacts, title: str) -> None:
    assert title in [a.title for a in advise(facts, Measurements(COMPUTE))]


def test_fp32_advice_only_where_16_bit_is_much_faster() -> None:
    assert advise(RunFacts(fast_16bit_ratio=1.2), Measurements(COMPUTE)) == []
    assert advise(RunFacts(precision="bf16-mixed", fast_16bit_ratio=8.0), Measurements(COMPUTE)) == []


def test_a_hand_written_loader_is_checked_through_its_facts() -> None:
    loader = DataLoader(TensorDataset(torch.ones(8)), num_workers=2)
    facts = RunFacts(**loader_facts(loader), device_type="cuda")
    titles = [a.title for a in advise(facts, Measurements(COMPUTE))]
    assert titles == ["pin host batches", "keep DataLoader workers alive between epochs"]

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.ones(1)

    assert loader_facts(DataLoader(Stream()))["map_style"] is False
    pinned = DataLoader(TensorDataset(torch.ones(8)), num_workers=2, pin_memory=True, persistent_workers=True)
    assert loader_facts(pinned) == {
        "num_workers": 2,
        "persistent_workers": True,
        "pin_memory": True,
        "map_style": True,
    }

    class OwnLoader:  # a loader of one's own, which tells its worker count only
        num_workers = 0

    assert loader_facts(OwnLoader()) == {
        "num_workers": 0, "persistent_workers": False, "pin_memory": False, "map_style": True
    }  # fmt: skip
