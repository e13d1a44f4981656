"""The GPU table and the cluster text of ``leantrain plan --cluster``."""

from __future__ import annotations

import pytest

from leantrain.errors import ConfigError
from leantrain.simulate.hardware import KINDS, ClusterSpec, gpu_kind, parse_cluster

GiB = 2**30
H100 = KINDS["h100-sxm"]


@pytest.mark.parametrize(
    ("text", "nodes", "per_node", "kind"),
    [
        ("8xH100", 1, 8, "h100-sxm"),
        ("4xh100", 1, 4, "h100-sxm"),
        ("1xH200", 1, 1, "h200"),
        ("16xH100", 2, 8, "h100-sxm"),
        ("256xH100", 32, 8, "h100-sxm"),
        ("2x8xH100", 2, 8, "h100-sxm"),
        ("3X4XA100-40GB", 3, 4, "a100-40gb"),
        (" 8 x b200 ", 1, 8, "b200"),
        ("8xMI300X", 1, 8, "mi300x"),  # the kind's own "x" is no separator
        ("2x8xmi300x", 2, 8, "mi300x"),
        ("8xL40S", 1, 8, "l40s"),
        ("8xh100-pcie", 1, 8, "h100-pcie"),
    ],
)
def test_the_accepted_forms_give_nodes_gpus_and_the_kind(text, nodes, per_node, kind):
    cluster = parse_cluster(text)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu) == (nodes, per_node, KINDS[kind])
    assert cluster.memory_bytes == KINDS[kind].memory_bytes
    assert cluster.world_size == nodes * per_node


@pytest.mark.parametrize("name", ["h100", "H100", "h100-sxm", "H100-SXM5", "h100sxm"])
def test_kind_names_ignore_case_and_h100_means_the_sxm_card(name):
    assert gpu_kind(name) is H100
    assert parse_cluster(f"8x{name}").gpu is H100


def test_a_memory_size_names_an_unnamed_gpu_that_computes_as_an_h100_sxm():
    cluster = parse_cluster("2x8x80GiB")
    assert (cluster.nodes, cluster.gpus_per_node, cluster.memory_bytes) == (2, 8, 80 * GiB)
    assert cluster.gpu.memory_bytes == 80 * GiB
    assert cluster.gpu.bf16_flops == H100.bf16_flops
    assert cluster.gpu.inter_node_bytes_per_s == H100.inter_node_bytes_per_s
    assert "H100" in cluster.gpu.note  # the assumption is said, not hidden
    assert parse_cluster("1x4x24GB").memory_bytes == 24 * 10**9


def test_kind_dash_memory_keeps_the_kinds_speeds_with_another_memory():
    cluster = parse_cluster("8xH100-95GiB")
    assert (cluster.nodes, cluster.gpus_per_node, cluster.memory_bytes) == (1, 8, 95 * GiB)
    assert cluster.gpu.memory_bytes == 95 * GiB
    assert (cluster.gpu.name, cluster.gpu.bf16_flops) == (H100.name, H100.bf16_flops)
    assert parse_cluster("8xh100-sxm-96GB").memory_bytes == 96 * 10**9


@pytest.mark.parametrize(
    "text",
    [
        "",
        "H100",  # no count
        "8x",
        "8xfoo",  # unknown kind
        "0xH100",
        "2x0xH100",
        "-8xH100",
        "8.5xH100",
        "12xH100",  # over one node but not whole nodes of 8
        "2x8x8xH100",
        "2x8x80",  # a memory size needs its unit
        "2x8x85899345920",  # even when it is large enough
        "8xH100-10MB",  # less than a GPU's memory: a typo
        "8xfoo-80GiB",
        None,
    ],
)
def test_bad_text_is_a_one_line_error_naming_cluster_the_forms_and_the_kinds(text):
    with pytest.raises(ConfigError) as error:
        parse_cluster(text)
    message = str(error.value)
    assert error.value.field == "cluster"
    assert message.startswith("invalid cluster=")
    assert "\n" not in message
    assert "NODESxGPUSxGPU" in message
    assert all(name in message for name in KINDS)


def test_the_table_has_the_kinds_a_plan_needs_each_with_its_source_and_peaks_in_flop_per_second():
    assert {"h100-sxm", "h100-pcie", "h200", "a100-80gb", "a100-40gb", "l40s", "b200", "mi300x"} <= set(KINDS)
    for kind in KINDS.values():
        assert kind.source
        # Tensor cores are faster than the fp32 units, bf16 than tf32; a node's links than the network.
        assert kind.bf16_flops > kind.tf32_flops > kind.fp32_flops > 10e12  # the slowest here: 19.5 TFLOP/s
        # Dense tf32 runs at half the dense 16-bit rate on every card listed (datasheets round a little).
        assert kind.tf32_flops == pytest.approx(kind.bf16_flops / 2, rel=0.02)
        assert kind.intra_node_bytes_per_s > kind.inter_node_bytes_per_s > 0
        assert kind.memory_bytes >= 40 * GiB


def test_the_h200_is_an_h100_with_more_and_faster_memory():
    h200 = KINDS["h200"]
    assert h200.bf16_flops == H100.bf16_flops
    assert h200.memory_bytes > H100.memory_bytes
    assert h200.hbm_bytes_per_s > H100.hbm_bytes_per_s


def test_a_cluster_spec_reads_as_its_layout():
    cluster = ClusterSpec(4, 8, H100, H100.memory_bytes)
    assert cluster.world_size == 32
    assert str(cluster).startswith("4x8xh100-sxm")
