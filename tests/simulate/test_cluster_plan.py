"""leantrain plan --cluster: one rank simulated on fake tensors over a fake process group.

The memory a simulated rank holds is checked against real gloo runs in tests/distributed (test_fsdp.py,
test_tensor_parallel.py: the accountant's figures to the byte). Here: what its collectives move, the
table and its launch line, the search, and the bad paths."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from rich.console import Console

from leantrain.cli import main
from leantrain.config import TrainConfig
from leantrain.errors import LeantrainError
from leantrain.simulate.cluster_plan import plan_cluster
from leantrain.simulate.fake_world import fake_world
from leantrain.simulate.hardware import parse_cluster
from leantrain.simulate.report import search_table
from leantrain.simulate.search import Tried, _try, layouts, search
from leantrain.strategies.fsdp import shard_units
from leantrain.units import format_bytes
from tests.distributed.tasks import tiny_charlm

TASK = "tests.distributed.tasks:tiny_charlm"  # float64, 4 blocks, tied embedding and head


def padded_bytes(params: list[torch.nn.Parameter], world: int) -> int:
    """What FSDP gathers of ``params``: each padded to a multiple of the world along its first dim."""
    return sum(math.ceil(p.shape[0] / world) * world * p[0].numel() * p.element_size() for p in params)


@pytest.mark.parametrize(("world", "accumulation"), [(4, 1), (2, 2)])
def test_fsdp_gathers_each_block_twice_the_root_once_per_micro_batch_and_reduces_once(world, accumulation):
    """Bugs: a collective not seen (FSDP issues c10d ops, not functional ones), its bytes read from the
    shard instead of the whole tensor, the no-sync micro-batch's reduce-scatter counted."""
    cfg = TrainConfig(strategy="fsdp", global_batch_size=8, micro_batch_size=2)
    plan = plan_cluster(tiny_charlm(), cfg, parse_cluster(f"{world}xH100"))
    assert plan.accumulation == accumulation
    model = tiny_charlm().model()
    blocks = [p for _, unit in shard_units(model, None) for p in unit.parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in blocks)]
    # Forward gathers every unit; backward gathers the blocks again (the root stays gathered).
    gathered = 2 * padded_bytes(blocks, world) + padded_bytes(rest, world)
    assert plan.traffic == {
        "all_gather": accumulation * gathered,
        "reduce_scatter": padded_bytes(blocks + rest, world),
    }


def test_ddp_all_reduces_the_gradients_once_a_step_and_holds_its_buckets():
    """Bugs: the no-sync micro-batch's all-reduce counted; DDP's buckets (a gradient-sized buffer, held
    through the step: measured on real processes by benchmarks/cluster_plan_real.py) left out."""
    cfg = TrainConfig(strategy="ddp", global_batch_size=8, micro_batch_size=2)  # 2 micro-batches a rank
    plan = plan_cluster(tiny_charlm(), cfg, parse_cluster("2xH100"))
    assert plan.accumulation == 2
    gradients = sum(p.numel() * 8 for p in tiny_charlm().model().parameters())  # float64
    assert plan.traffic == {"all_reduce": gradients}
    assert plan.peak["Other"] == gradients


def test_the_table_gives_memory_by_kind_the_modelled_time_and_the_launch_line(capsys):
    flags = ["--cluster", "2x2xH100", "--strategy", "fsdp", "--tp", "2", "--global-batch-size", "8"]
    assert main(["plan", "--task", TASK, *flags, "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    for line in ("parameters", "optimizer state", "activations", "live tensors", "reserved (allocator +10%",
                 "fits: GPU 80.0 GiB", "step (modelled)", "tokens/s per GPU (modelled)"):  # fmt: skip
        assert line in out, line
    assert (
        "launch: leantrain launch --nnodes 2 --nproc-per-node 2 fit --task "
        "tests.distributed.tasks:tiny_charlm --global-batch-size 8 --strategy fsdp --micro-batch-size 2 "
        "--precision 32 --tp 2"
    ) in out
    assert (
        "or:     leantrain slurm --nodes 2 --gpus-per-node 2 fit --task tests.distributed.tasks:tiny_charlm "
        "--global-batch-size 8 --strategy fsdp"
    ) in out
    assert "- a model, not a measurement: compute at 35% of h100-sxm's dense fp32" in out


def test_the_plan_table_holds_each_figure_of_the_plan():
    from leantrain.simulate.cluster_plan import CUDA_CONTEXT_BYTES
    from leantrain.simulate.report import KINDS, _seconds, plan_notes, plan_table

    cfg = TrainConfig(global_batch_size=8, micro_batch_size=2, compile="blocks")
    plan = plan_cluster(tiny_charlm(), cfg, parse_cluster("1x2x1GiB"))
    console = Console(record=True, width=200, force_terminal=True, color_system="standard")
    console.print(plan_table(plan))
    lines = console.export_text(clear=False).splitlines()
    styled = console.export_text(styles=True)
    top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    assert " ".join(line.strip() for line in lines[:top]) == (
        f"per GPU on {plan.cluster}: ddp, dp {plan.dp} x tp 1, micro-batch 2 x {plan.accumulation}, 32, "
        "recompute -"
    )
    header = next(line for line in lines if line.startswith("┃")).split("┃")[1:-1]
    assert [cell.strip() for cell in header] == ["at the peak", "bytes"] and not header[1].endswith("  ")
    cells = [line.split("│")[1:-1] for line in lines if line.startswith("│")]
    rows = {name.strip(): value.strip() for name, value in cells}
    assert all(not value.endswith("  ") for _, value in cells)  # the figures to the right
    shown = {KINDS[kind]: format_bytes(size) for kind, size in plan.peak.items() if kind in KINDS and size}
    assert shown and {name: rows[name] for name in shown} == shown
    assert rows["live tensors"] == format_bytes(plan.peak["Total"])
    assert rows["reserved (allocator +10%, modelled)"] == format_bytes(plan.reserved_bytes)
    assert rows["CUDA context (assumed)"] == format_bytes(CUDA_CONTEXT_BYTES)
    time = plan.time
    assert (rows["step (modelled)"], rows["compute"]) == (_seconds(time.step_s), _seconds(time.compute_s))
    exposed = f"{_seconds(time.exposed_communication_s)} of {_seconds(time.communication_s)}"
    assert rows["communication, exposed of all"] == exposed
    assert rows["tokens/s per GPU (modelled)"] == f"{time.tokens_per_s_per_gpu:,.0f}"
    free = plan.cluster.memory_bytes - plan.reserved_bytes - CUDA_CONTEXT_BYTES
    verdict = "fits" if plan.fits else "does NOT fit"
    assert rows[f"{verdict}: GPU 1.0 GiB"] == f"{format_bytes(free)} free"
    assert "\x1b[1mlive tensors" in styled and "\x1b[1mstep (modelled)" in styled  # the totals in bold
    narrow = Console(record=True, width=30)
    narrow.print(plan_table(plan))
    assert sum(line.startswith("│") for line in narrow.export_text().splitlines()) == len(
        cells
    )  # cut, not wrapped
    notes = plan_notes(plan)
    assert notes[2] == (
        "- --compile blocks is planned eagerly: a compiled step may hold less (its partitioner recomputes "
        "cheap values) and run faster than planned"
    )
    eager = plan_cluster(tiny_charlm(), cfg.replace(compile="none"), parse_cluster("1x2x1GiB"))
    assert not any("--compile" in line for line in plan_notes(eager))
    too_big = dataclasses.replace(plan, peak={**plan.peak, "Total": 2**30})
    assert not too_big.fits
    console.print(plan_table(too_big))
    free = format_bytes(2**30 - too_big.reserved_bytes - CUDA_CONTEXT_BYTES)
    drawn = console.export_text()
    assert "│ does NOT fit: GPU 1.0 GiB" in drawn and f"{free} free" in drawn


def test_json_holds_the_plan_and_a_cluster_too_small_does_not_fit(capsys):
    flags = ["--cluster", "1x2x1GiB", "--global-batch-size", "4", "--json"]
    assert main(["plan", "--task", TASK, *flags]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 2 and plan["strategy"] == "ddp" and plan["micro_batch_size"] == 2
    # The CUDA context alone takes 600 MiB of the GiB; the rest holds the tiny model easily.
    assert plan["fits"] is True and plan["reserved_bytes"] == int(plan["peak_bytes"] * 1.1)
    assert plan["peak_bytes_by_kind"]["Total"] == plan["peak_bytes"]


def test_layouts_cover_the_strategies_tp_degrees_policies_and_micro_batches():
    cfg = TrainConfig(global_batch_size=8, precision="32")
    groups = list(layouts(cfg, parse_cluster("1x4xH100"), [None, "Block"]))
    found = {
        (c.strategy, c.tp, c.activation_checkpointing, c.precision, c.micro_batch_size)
        for group in groups
        for c in group
    }
    # tp 1: dp 4, 2 samples each (micro 1, 2); tp 2: dp 2 (1, 2, 4); tp 4: dp 1 (1, 2, 4, 8); no tp 3.
    micros = {1: [1, 2], 2: [1, 2, 4], 4: [1, 2, 4, 8]}
    expected = {
        (strategy, tp, policy, precision, micro)
        for strategy in ("ddp", "fsdp") for tp, sizes in micros.items() for micro in sizes
        for policy in (None, "Block") for precision in ("32", "bf16-mixed")
    }  # fmt: skip
    assert found == expected
    assert all([c.micro_batch_size for c in g] == sorted(c.micro_batch_size for c in g) for g in groups)
    # tensor parallelism stays within a node (3 nodes of 2: never tp 3 or 6); a dp the batch cannot be
    # cut into is skipped, not the end (a batch of 3: tp 1's dp 6 does not divide it, tp 2's dp 3 does)
    across = {
        c.tp for g in layouts(cfg.replace(global_batch_size=6), parse_cluster("3x2xH100"), [None]) for c in g
    }
    assert across == {1, 2}
    assert {
        c.tp for g in layouts(cfg.replace(global_batch_size=3), parse_cluster("3x2xH100"), [None]) for c in g
    } == {2}


class Searched(NamedTuple):
    tried: list[Tried]
    simulated: list[TrainConfig]  # the layouts simulated, in order
    inputs: list[tuple[float | None, Any]]  # the mfu and the first item each simulation was given
    progressed: list[tuple[int, Tried]]  # the search's progress calls
    first_items: list[Any]  # the task's first item, as often as it was read


MFU = 0.375


@pytest.fixture(scope="module")
def searched() -> Searched:
    """The search over ddp layouts on 2 GPUs of 1 GiB, as though micro-batches from 2 did not fit (once
    for the tests that read it: it takes seconds)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _searched(monkeypatch)


def _searched(monkeypatch: pytest.MonkeyPatch) -> Searched:
    from leantrain.simulate import search as search_module

    cluster = parse_cluster("1x2x1GiB")
    real_plan, real_first_item = plan_cluster, search_module.first_item
    simulated, inputs, progressed, first_items = [], [], [], []

    def plan_cluster_with_a_limit(task, cfg, cluster, mfu=None, item=None):
        simulated.append(cfg)
        inputs.append((mfu, item))
        plan = real_plan(task, cfg, cluster, mfu, item)
        if cfg.micro_batch_size >= 2:
            object.__setattr__(plan, "peak", {"Total": 2**40})
        return plan

    def counted_first_item(task):
        first_items.append(real_first_item(task))
        return first_items[-1]

    monkeypatch.setattr("leantrain.simulate.search.plan_cluster", plan_cluster_with_a_limit)
    monkeypatch.setattr("leantrain.simulate.search.first_item", counted_first_item)
    monkeypatch.setattr("leantrain.simulate.search.STRATEGIES", ("ddp",))
    cfg = TrainConfig(global_batch_size=8, precision="bf16-mixed")
    progress = lambda index, one: progressed.append((index, one))  # noqa: E731
    tried = search(tiny_charlm(), cfg, cluster, MFU, progress)
    return Searched(tried, simulated, inputs, progressed, first_items)


def test_the_search_skips_larger_micro_batches_once_one_does_not_fit_and_lists_the_fastest_first(searched):
    tried, simulated = searched.tried, searched.simulated
    # tp 1 (micro 1, 2, 4) and tp 2 (micro 1, 2, 4, 8), x 3 policies: 21 layouts. Simulated: each tp's
    # micro 1 without recomputation (it fits: the recomputed ones are not tried) and micro 2 with each.
    assert len(tried) == 21
    assert sorted((c.tp, c.micro_batch_size, c.activation_checkpointing or "-") for c in simulated) == sorted(
        (tp, micro, policy) for tp in (1, 2) for micro, policy in
        [(1, "-"), (2, "-"), (2, "selective"), (2, "Block")]
    )  # fmt: skip
    fitting = [one for one in tried if one.fits]
    assert len(fitting) == 2 and tried[:2] == fitting
    assert [one.plan.time.step_s for one in fitting] == sorted(one.plan.time.step_s for one in fitting)
    reasons = [one.reason for one in tried if one.plan is None]
    assert reasons.count("fits with less recomputation, which is faster") == 4  # micro 1, both tps
    assert reasons.count("a smaller micro-batch of this layout does not fit") == 21 - 8 - 4
    assert isinstance(tried[0], Tried) and tried[0].as_dict()["fits"] is True
    assert tried[-1].as_dict()["reason"] in reasons
    # each layout in turn, reported as it is tried; the task's data read once (it can take seconds), and
    # every simulation given it and the search's mfu
    assert [index for index, _ in searched.progressed] == list(range(1, 22))
    assert {id(one) for _, one in searched.progressed} == {id(one) for one in tried}
    assert len(searched.first_items) == 1 and len(searched.inputs) == len(simulated)
    first = searched.first_items[0]
    assert first is not None and all(mfu == MFU and item is first for mfu, item in searched.inputs)
    layout = ("strategy", "tp", "micro_batch_size", "activation_checkpointing", "precision")
    for one in tried:  # a layout that was not simulated has the layout columns of one that was
        row = one.as_dict()
        assert {key: row[key] for key in layout} == {key: getattr(one.cfg, key) for key in layout}
        assert row["fits"] is one.fits


def test_the_search_tries_recomputation_only_of_a_model_with_repeated_blocks():
    from leantrain.simulate.search import checkpointing_policies
    from tests.conftest import RegressionTask

    assert checkpointing_policies(tiny_charlm()) == [None, "selective", "Block"]  # least recomputed first

    class OneLayer(RegressionTask):
        def model(self) -> torch.nn.Module:
            return torch.nn.Linear(6, 1)

    assert checkpointing_policies(OneLayer()) == [None]


def test_a_layout_the_simulation_refuses_is_listed_with_the_first_line_of_why():
    cluster, cfg = parse_cluster("1x2x1GiB"), TrainConfig(global_batch_size=8, tp=3)
    with pytest.raises(LeantrainError) as refused:
        plan_cluster(tiny_charlm(), cfg, cluster)
    tried = _try(tiny_charlm(), cfg, cluster, None, None)
    assert (tried.cfg, tried.plan, tried.reason) == (cfg, None, str(refused.value).splitlines()[0])
    assert tried.reason
    # the table shows a reason as it is: rich would read "[/x]" as markup and fail, "[tp]" would vanish
    odd = Tried(cfg, None, "needs [tp] to divide [/x]")
    console = Console(record=True, width=250)
    console.print(search_table([odd]))
    assert "needs [tp] to divide [/x]" in console.export_text()


def test_the_search_table_shows_each_layout_tried_fitting_fastest_first_and_the_line_to_launch_the_best(
    searched,
):
    tried = searched.tried
    flags = ["--task", TASK, "--global-batch-size", "8", "--out", "runs/[b8]"]  # brackets: shown, not markup
    console = Console(record=True, width=250)
    console.print(search_table(tried, flags, shown=5))
    lines = console.export_text().splitlines()
    assert lines[0].strip() == "21 layouts tried, 2 fit (fastest first)"
    header = next(line for line in lines if line.startswith("┃"))
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == [
        "strategy", "dp x tp", "micro x acc", "recompute", "precision", "peak", "reserved", "fits", "step",
        "tokens/s/GPU",
    ]  # fmt: skip
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert len(rows) == 5  # the first five only
    table = search_table(tried, flags, shown=5)
    # words to the left, numbers to the right; a row is one line however narrow the terminal (cut short)
    assert [column.justify for column in table.columns] == ["left", *["right"] * 2, "left", *["right"] * 6]
    narrow = Console(record=True, width=90)
    narrow.print(table)
    assert sum(line.startswith("│") for line in narrow.export_text().splitlines()) == 5
    for row, one in zip(rows, tried, strict=False):
        strategy, dp_tp, micro_acc, recompute, precision, peak, reserved, fits, step, tokens = row
        cfg = one.cfg
        assert (strategy, precision) == (cfg.strategy, cfg.precision)
        assert recompute == (cfg.activation_checkpointing or "-")
        assert fits == ("yes" if one.fits else "no")
        if one.plan is None:
            assert (dp_tp, micro_acc) == (f"? x {cfg.tp}", str(cfg.micro_batch_size))
            assert (peak, reserved, step, tokens) == ("", "", one.reason, "")
            continue
        plan = one.plan
        assert dp_tp == f"{plan.dp} x {plan.layout.tp}"
        assert micro_acc == f"{plan.layout.micro_batch_size} x {plan.accumulation}"
        assert (peak, reserved) == (format_bytes(plan.peak["Total"]), format_bytes(plan.reserved_bytes))
        assert step.endswith(" ms") and tokens == f"{plan.time.tokens_per_s_per_gpu:,.0f}"
    assert [row[7] for row in rows] == ["yes", "yes", "no", "no", "no"]  # fitting first
    below = lines[next(i for i, line in enumerate(lines) if line.startswith("└")) + 1 :]
    assert " ".join(" ".join(below).split()) == "fastest that fits: " + tried[0].plan.command(flags)
    console.print(search_table([one for one in tried if not one.fits], flags))
    assert console.export_text().rstrip().endswith("no layout fits")
    console.print(search_table(tried))  # the first 20 of the 21 by default
    assert sum(line.startswith("│") for line in console.export_text().splitlines()) == 20
    plan = tried[0].plan  # data that are not tokens: no tokens/s
    untimed = dataclasses.replace(plan, time=dataclasses.replace(plan.time, tokens_per_s_per_gpu=None))
    console.print(search_table([dataclasses.replace(tried[0], plan=untimed)]))
    rows = [line.split("│") for line in console.export_text().splitlines() if line.startswith("│")]
    assert [row[-2].strip() for row in rows] == [""]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cluster", "8xT4"], "invalid cluster='8xT4'"),
        (["--search"], "invalid search=True: plans a cluster: give --cluster too"),
        (["--cluster", "2xH100", "--mfu", "0"], "invalid mfu=0.0: must be above 0 and at most 1"),
        (["--tp", "2"], "plan each rank of a tensor-parallel layout with --cluster"),
        (
            ["--cluster", "2xH100", "--strategy", "pipeline", "--pipeline-stages", "2"],
            "invalid strategy='pipeline': plan --cluster does not simulate its ranks yet",
        ),
        (
            ["--cluster", "2xH100", "--activation-checkpointing", "auto", "--memory-budget", "1GiB"],
            "invalid activation_checkpointing='auto': plan --cluster takes a policy; --search tries them",
        ),
    ],
)
def test_bad_plans_are_one_line_naming_the_field(capsys, flags, message):
    assert main(["plan", "--task", TASK, "--global-batch-size", "4", *flags]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_process_that_already_has_a_process_group_is_refused_before_it_breaks_it():
    with fake_world(2, 0):
        assert dist.get_world_size() == 2
        with pytest.raises(LeantrainError, match="simulates the ranks in one process"), fake_world(4, 0):
            pass
        assert dist.get_world_size() == 2  # the outer world untouched
    assert not dist.is_initialized()


def test_a_compiled_job_is_planned_eagerly_says_so_and_keeps_its_flag(capsys):
    flags = ["--cluster", "2xH100", "--global-batch-size", "4", "--compile", "blocks"]
    assert main(["plan", "--task", TASK, *flags]) == 0
    out = capsys.readouterr().out
    assert "--precision 32 --compile blocks\n" in out  # the launch line keeps it
    assert "- --compile blocks is planned eagerly" in out


def test_a_group_across_nodes_is_priced_at_the_network_not_nvlink():
    """Bug: every group priced as inside a node (the nodes read from the group's ranks)."""
    cfg = TrainConfig(strategy="fsdp", global_batch_size=8, micro_batch_size=2)
    one_node, two_nodes = (
        plan_cluster(tiny_charlm(), cfg, parse_cluster(text)) for text in ("1x2xH100", "2x1xH100")
    )
    assert one_node.traffic == two_nodes.traffic
    gpu = one_node.cluster.gpu
    sent = sum(one_node.traffic.values()) / 2  # each rank of a ring of 2 sends half of every whole tensor
    extra = sent / gpu.inter_node_bytes_per_s - sent / gpu.intra_node_bytes_per_s
    difference = two_nodes.time.communication_s - one_node.time.communication_s
    assert difference > extra  # the network's bandwidth, and its larger latency per ring step


def test_tensor_parallel_collectives_are_exposed_and_data_parallel_ones_hide_behind_compute():
    """Bug: a tensor-parallel collective (the next operation waits for it) priced as overlapping compute."""
    tp_only = plan_cluster(tiny_charlm(), TrainConfig(tp=2, global_batch_size=8), parse_cluster("2xH100"))
    assert tp_only.dp == 1 and tp_only.time.communication_s > 0
    assert tp_only.time.exposed_communication_s == tp_only.time.communication_s
    fsdp = plan_cluster(
        tiny_charlm(), TrainConfig(strategy="fsdp", global_batch_size=8), parse_cluster("2xH100")
    )
    hidden = min(fsdp.time.communication_s, 0.8 * fsdp.time.compute_s)  # step_time's default overlap
    assert fsdp.time.exposed_communication_s == pytest.approx(fsdp.time.communication_s - hidden)


def test_modelled_times_read_in_milliseconds_below_a_second():
    from leantrain.simulate.report import _seconds

    assert [_seconds(t) for t in (0.0123, 0.9996, 1.0, 1.5, 2500.0)] == [
        "12.3 ms", "999.6 ms", "1.00 s", "1.50 s", "2,500.00 s"
    ]  # fmt: skip
