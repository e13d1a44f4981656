"""The step-time model: ring costs, latency, compute at a share of the peak, overlap, node crossing."""

from __future__ import annotations

import dataclasses
import json

import pytest

from leantrain.simulate import step_time as model
from leantrain.simulate.hardware import KINDS, ClusterSpec
from leantrain.simulate.step_time import Collective, collective_time, group_crosses_nodes, step_time
from leantrain.strategies.dims import ParallelDims

GB = 10**9
# A GPU of round figures, so that every expected time below is a short formula.
ROUND = dataclasses.replace(
    KINDS["h100-sxm"],
    name="round",
    bf16_flops=1000e12,
    tf32_flops=400e12,
    fp32_flops=50e12,
    intra_node_bytes_per_s=100 * GB,
    inter_node_bytes_per_s=10 * GB,
)
CLUSTER = ClusterSpec(2, 8, ROUND, ROUND.memory_bytes)


def latency(steps: int, crosses: bool) -> float:
    """NCCL's ring latency as the module states it: a base and one hop per ring step."""
    return model.BASE_LATENCY_S + steps * model.STEP_LATENCY_S[crosses]


def test_an_all_reduce_sends_twice_the_ring_share_over_the_node_links():
    expected = 2 * 7 / 8 * 1e9 / 100e9 + latency(2 * 7, crosses=False)
    assert collective_time(Collective("all_reduce", GB, 8, False), CLUSTER) == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gathers_scatters_and_all_to_all_send_the_ring_share_once(kind):
    expected = 3 / 4 * 2e9 / 100e9 + latency(3, crosses=False)
    assert collective_time(Collective(kind, 2 * GB, 4, False), CLUSTER) == pytest.approx(expected)


def test_a_send_moves_its_payload_once_whatever_the_group():
    for group in (2, 8):
        expected = 1e9 / 100e9 + latency(1, crosses=False)
        assert collective_time(Collective("send", GB, group, False), CLUSTER) == pytest.approx(expected)


def test_a_broadcast_moves_the_whole_tensor_through_each_rank():
    expected = 1e9 / 100e9 + latency(7, crosses=False)
    assert collective_time(Collective("broadcast", GB, 8, False), CLUSTER) == pytest.approx(expected)


def test_a_group_across_nodes_runs_at_the_network_bandwidth_and_latency():
    expected = 15 / 16 * 1e9 / 10e9 + latency(15, crosses=True)
    assert collective_time(Collective("all_gather", GB, 16, True), CLUSTER) == pytest.approx(expected)
    assert model.STEP_LATENCY_S[True] > model.STEP_LATENCY_S[False] > 0


def test_the_latency_grows_with_the_ring_and_is_all_an_empty_tensor_costs():
    assert collective_time(Collective("all_reduce", 0, 4, False), CLUSTER) == pytest.approx(latency(6, False))
    assert 5e-6 < latency(1, False) < 50e-6  # NCCL's figures: microseconds, not milliseconds


def test_a_group_of_one_communicates_nothing():
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
        assert collective_time(Collective(kind, GB, 1, False), CLUSTER) == 0.0


def test_an_unknown_collective_is_refused():
    with pytest.raises(ValueError, match="gossip"):
        Collective("gossip", GB, 2, False)


@pytest.mark.parametrize(
    ("sixteen_bit", "tf32", "peak"), [(True, False, 1000e12), (False, True, 400e12), (False, False, 50e12)]
)
def test_compute_is_the_flops_at_a_share_of_the_precisions_peak(sixteen_bit, tf32, peak):
    result = step_time(6e15, sixteen_bit, [], CLUSTER, mfu=0.4, tf32=tf32)
    assert result.compute_s == pytest.approx(6e15 / (0.4 * peak))
    assert result.step_s == result.compute_s
    assert (result.communication_s, result.exposed_communication_s) == (0.0, 0.0)


def test_the_default_efficiency_is_the_modules_stated_one():
    result = step_time(1e15, True, [], CLUSTER)
    assert result.compute_s == pytest.approx(1e15 / (model.DEFAULT_MFU * 1000e12))
    assert 0.25 <= model.DEFAULT_MFU <= 0.5  # what torchtitan's published H100 runs reach


def test_overlapping_communication_hides_behind_a_share_of_compute():
    gather = Collective("all_gather", 100 * GB, 8, False)  # 0.875 s of ring traffic
    comm = collective_time(gather, CLUSTER)
    compute = 1e15 / (0.5 * 1000e12)  # 2 s
    result = step_time(1e15, True, [gather], CLUSTER, mfu=0.5, overlap=0.25)
    assert result.communication_s == pytest.approx(comm)
    assert result.exposed_communication_s == pytest.approx(comm - 0.25 * compute)
    assert result.step_s == pytest.approx(compute + comm - 0.25 * compute)
    hidden = step_time(1e15, True, [gather], CLUSTER, mfu=0.5, overlap=0.5)
    assert hidden.exposed_communication_s == 0.0
    assert hidden.step_s == pytest.approx(compute)


def test_communication_that_compute_waits_for_is_all_exposed():
    tp = Collective("all_reduce", GB, 8, False, overlaps_compute=False)
    fsdp = Collective("reduce_scatter", GB, 8, False)
    compute = 1e15 / (0.5 * 1000e12)
    result = step_time(1e15, True, [tp, fsdp], CLUSTER, mfu=0.5, overlap=1.0)
    waited = collective_time(tp, CLUSTER)
    assert result.communication_s == pytest.approx(waited + collective_time(fsdp, CLUSTER))
    assert result.exposed_communication_s == pytest.approx(waited)
    assert result.step_s == pytest.approx(compute + waited)


def test_tokens_per_second_per_gpu_and_none_without_tokens():
    gather = Collective("all_gather", 100 * GB, 8, False, overlaps_compute=False)
    result = step_time(1e15, True, [gather], CLUSTER, mfu=0.5, tokens_per_rank=16384)
    assert result.tokens_per_s_per_gpu == pytest.approx(16384 / result.step_s)
    assert step_time(1e15, True, [gather], CLUSTER).tokens_per_s_per_gpu is None


def test_the_result_says_it_is_a_model_and_serialises():
    result = step_time(1e15, True, [Collective("all_gather", GB, 16, True)], CLUSTER, tokens_per_rank=8192)
    row = json.loads(json.dumps(result.as_dict()))
    assert set(row) == {
        "compute_s",
        "communication_s",
        "exposed_communication_s",
        "step_s",
        "tokens_per_s_per_gpu",
        "assumptions",
    }
    text = " ".join(result.assumptions)
    assert "a model" in text
    assert "35%" in text and "bf16" in text and ROUND.source in text


@pytest.mark.parametrize(("mfu", "overlap"), [(0.0, 0.5), (1.5, 0.5), (0.4, -0.1), (0.4, 1.1)])
def test_efficiencies_outside_zero_to_one_are_refused(mfu, overlap):
    with pytest.raises(ValueError, match="mfu"):
        step_time(1e15, True, [], CLUSTER, mfu=mfu, overlap=overlap)


def _crosses(groups: list[list[int]], gpus_per_node: int) -> bool:
    return any(len({rank // gpus_per_node for rank in group}) > 1 for group in groups)


@pytest.mark.parametrize(
    ("world", "gpus_per_node"), [(8, 2), (8, 4), (16, 8), (24, 6), (24, 8), (32, 4), (48, 6), (64, 8)]
)
def test_group_crossing_agrees_with_the_ranks_that_leantrains_dims_group_together(world, gpus_per_node):
    cluster = ClusterSpec(world // gpus_per_node, gpus_per_node, ROUND, ROUND.memory_bytes)
    for inner in (size for size in range(1, world + 1) if world % size == 0):
        dims = ParallelDims.of(world, tp=inner)
        ranks = range(world)
        # The ranks of one tensor-parallel group share their data rank; a data-parallel group, the
        # position in it (leantrain's own grouping, not the formula under test).
        model_groups = [[r for r in ranks if dims.data_rank(r) == d] for d in range(dims.dp)]
        data_groups = [[r for r in ranks if r % dims.group_size == i] for i in range(dims.group_size)]
        assert group_crosses_nodes(dims.tp, 1, cluster) == _crosses(model_groups, gpus_per_node)
        assert group_crosses_nodes(dims.dp, dims.tp, cluster) == _crosses(data_groups, gpus_per_node)


def test_one_node_holds_every_group():
    one = ClusterSpec(1, 8, ROUND, ROUND.memory_bytes)
    assert not group_crosses_nodes(8, 1, one)
    assert not group_crosses_nodes(4, 2, one)
    assert not group_crosses_nodes(3, 1, one)  # even a group that does not tile the node stays in it
    assert group_crosses_nodes(16, 1, ClusterSpec(2, 8, ROUND, ROUND.memory_bytes))
