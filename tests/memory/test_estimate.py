"""leantrain plan: a meta-device estimate that matches what a real CPU step saves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leantrain as lt
from leantrain.cli import main
from leantrain.examples.charlm import CharLMTask
from leantrain.examples.digits import DigitsTask
from leantrain.memory.estimate import candidate_micro_batches, estimate_memory
from leantrain.units import parse_bytes
from tests.conftest import without_validation

LEANTRAIN = str(Path(sys.executable).parent / "leantrain")


def small_charlm() -> CharLMTask:
    return CharLMTask(block=32, layers=2, width=64, heads=4, max_chars=60_000)


TASKS = {"digits": DigitsTask, "charlm": small_charlm}


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("name", list(TASKS))
def test_the_plan_matches_what_a_real_cpu_step_holds(fit, name, precision):
    config = lt.TrainConfig(global_batch_size=16, precision=precision)
    plan = estimate_memory(TASKS[name](), config)
    assert [row.micro_batch_size for row in plan.rows] == [1, 2, 4, 8, 16]
    for row in plan.rows[1::2]:  # micro-batches 2 and 8
        task = without_validation(TASKS[name]())
        real = fit(task, global_batch_size=16, micro_batch_size=row.micro_batch_size, max_steps=1,
                   precision=precision)  # fmt: skip
        # Exact, as docs/memory.md says: the plan runs the same step on fake tensors.
        assert row.memory.activation_bytes == real.activation_bytes
        assert row.memory.params_bytes == real.params_bytes
        assert row.memory.grads_bytes == real.grads_bytes
        assert row.memory.optimizer_bytes == real.optimizer_bytes
    activations = [row.memory.activation_bytes for row in plan.rows]
    assert activations == sorted(activations) and activations[-1] > activations[0]


def test_a_budget_gets_the_largest_micro_batch_that_fits_with_its_margin():
    config = lt.TrainConfig(global_batch_size=16)
    rows = estimate_memory(small_charlm(), config).rows
    total = {row.micro_batch_size: row.memory.total_bytes for row in rows}
    budget = int(total[8] / 0.9) + 1  # micro-batch 8 fits with the 10% margin, 16 does not
    plan = estimate_memory(small_charlm(), config, budget=budget)
    # Recomputation would fit 16, but that is not 4x larger: not worth a third more compute.
    assert plan.recommended.micro_batch_size == 8 and plan.recommended.activation_checkpointing is None
    assert [row.fits for row in plan.rows[:5]] == [True, True, True, True, False]


def plan_lines(plan, width: int = 200) -> list[str]:
    from rich.console import Console

    from leantrain.cli import _plan_table

    console = Console(record=True, width=width)
    console.print(_plan_table(plan))
    return console.export_text().splitlines()


def test_the_plan_table_shows_each_row_by_kind_with_its_verdict_and_marks_the_recommended_one():
    from leantrain.units import format_bytes

    config = lt.TrainConfig(global_batch_size=16)
    total = {
        row.micro_batch_size: row.memory.total_bytes for row in estimate_memory(small_charlm(), config).rows
    }
    budget = int(total[8] / 0.9) + 1
    plan = estimate_memory(small_charlm(), config, budget=budget)
    lines = plan_lines(plan)
    assert lines[0].strip() == f"memory per step, precision 32, budget {format_bytes(budget)} less 10%"
    header = next(line for line in lines if line.startswith("┃"))
    kinds = ["params", "grads", "optimizer", "activation"]
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == [
        "micro",
        "recompute",
        *kinds,
        "total",
        "fits",
    ]
    drawn = [line.split("│")[1:-1] for line in lines if line.startswith("│")]
    assert len(drawn) == len(plan.rows) > 5
    for cells, row in zip(drawn, plan.rows, strict=True):
        parts = row.memory.parts()
        verdict = ("yes" if row.fits else "no") + (" *" if row is plan.recommended else "")
        assert [cell.strip() for cell in cells] == [
            str(row.micro_batch_size), row.activation_checkpointing or "-",
            *[format_bytes(parts[kind]) for kind in kinds], format_bytes(row.memory.total_bytes), verdict,
        ]  # fmt: skip
        # the policy to the left, the numbers to the right (and their names above them)
        assert not cells[1].startswith("  ") and all(not cell.endswith("  ") for cell in cells[2:7])
    named = header.split("┃")[1:-1]
    assert not named[1].startswith("  ") and all(not cell.endswith("  ") for cell in named[2:7])
    assert sum(line.startswith("│") for line in plan_lines(plan, width=60)) == len(
        plan.rows
    )  # cut, not wrapped
    bottom = next(i for i, line in enumerate(lines) if line.startswith("└"))
    caption = " ".join(line.strip() for line in lines[bottom + 1 :])
    assert caption == (
        "* recommended: the largest micro-batch that fits; with recomputation when that fits one 4x larger"
    )
    unbudgeted = plan_lines(estimate_memory(small_charlm(), config))
    assert unbudgeted[0].strip() == "memory per step, precision 32" and unbudgeted[-1].startswith("└")
    assert all(line.split("│")[-2].strip() == "" for line in unbudgeted if line.startswith("│"))  # no verdict
    single = estimate_memory(DigitsTask(), lt.TrainConfig(global_batch_size=1))
    assert len(single.rows) == 1 and sum(line.startswith("│") for line in plan_lines(single)) == 1
    nothing = plan_lines(estimate_memory(small_charlm(), config, budget=1024))
    assert nothing[-1].strip() == "nothing fits: use 16-bit precision, or shard the model"


def test_checkpointing_is_recommended_when_it_fits_a_micro_batch_four_times_larger():
    config = lt.TrainConfig(global_batch_size=16)
    rows = estimate_memory(small_charlm(), config).rows
    budget = int(rows[0].memory.total_bytes / 0.9) + 1  # only micro-batch 1 fits without recomputation
    plan = estimate_memory(small_charlm(), config, budget=budget)
    assert plan.recommended.activation_checkpointing == "Block"
    assert plan.recommended.micro_batch_size >= 4
    nothing = estimate_memory(small_charlm(), config, budget=1024)
    assert nothing.recommended is None and nothing.as_dict()["recommended_micro_batch_size"] is None


def test_the_json_plan_holds_the_precision_the_budget_the_recommendation_and_every_row():
    """`leantrain plan --json`'s object: the chosen row's bytes on top, then what the budget decided."""
    config = lt.TrainConfig(global_batch_size=16, precision="bf16-mixed")
    unbounded = estimate_memory(small_charlm(), config)
    budget = int(unbounded.rows[0].memory.total_bytes / 0.9) + 1  # only micro-batch 1 without recomputation
    plan = json.loads(json.dumps(estimate_memory(small_charlm(), config, budget=budget).as_dict()))
    assert plan["precision"] == "bf16-mixed"
    assert (plan["memory_budget_bytes"], plan["safety_margin"]) == (budget, 0.1)
    assert (plan["recommended_micro_batch_size"], plan["recommended_activation_checkpointing"]) == (
        8,
        "Block",
    )
    assert (plan["micro_batch_size"], plan["activation_checkpointing"], plan["fits"]) == (8, "Block", True)
    kinds = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "ema_bytes")
    assert plan["total_bytes"] == sum(plan[kind] for kind in kinds) <= budget
    rows = [(row["micro_batch_size"], row["activation_checkpointing"], row["fits"]) for row in plan["rows"]]
    assert rows == [
        *[(1, None, True), (2, None, False), (4, None, False), (8, None, False), (16, None, False)],
        *[
            (1, "Block", True),
            (2, "Block", True),
            (4, "Block", True),
            (8, "Block", True),
            (16, "Block", False),
        ],
    ]
    assert plan["rows"][8] == {key: value for key, value in plan.items() if key in plan["rows"][8]}
    alone = unbounded.as_dict()  # no budget: nothing decided
    assert not {"memory_budget_bytes", "safety_margin", "recommended_micro_batch_size"} & set(alone)
    assert [row["fits"] for row in alone["rows"]] == [None] * 5 and alone["fits"] is None


def test_candidates_are_powers_of_two_dividing_the_batch_and_the_batch():
    assert candidate_micro_batches(48) == [1, 2, 4, 8, 16, 48]
    assert candidate_micro_batches(1) == [1]


@pytest.mark.parametrize(
    ("text", "value"), [("24GiB", 24 * 2**30), ("16 GB", 16 * 10**9), ("512MiB", 512 * 2**20), ("100", 100),
                        ("1.5KiB", 1536), ("lots", None), ("-1GB", None), ("3 parsecs", None)]
)  # fmt: skip
def test_sizes_are_read_with_their_units(text, value):
    assert parse_bytes(text) == value


def test_the_cli_prints_one_json_object_with_the_recommendation(tmp_path, capsys):
    done = subprocess.run(
        [LEANTRAIN, "plan", "--example", "digits", "--global-batch-size", "32", "--memory-budget", "8MiB",
         "--json", "true"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "total_bytes"):
        assert isinstance(result[key], int) and result[key] > 0
    assert result["total_bytes"] == sum(
        result[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")
    )
    assert result["recommended_micro_batch_size"] == 32
    # The refusals, in this process (``main``): the installed command's start-up is checked above.
    assert main(["plan", "--memory-budget", "lots"]) == 2
    assert capsys.readouterr().err == (
        "leantrain: error: invalid memory_budget='lots': must be a size such as 24GiB, 16GB or 512MiB\n"
    )
    # A whole model's bytes under --tp would read as each rank's: refused until the plan splits it.
    assert main(["plan", "--tp", "2"]) == 2
    assert capsys.readouterr().err.startswith(
        "leantrain: error: invalid tp=2: leantrain plan measures one process"
    )


def test_saved_activations_count_memory_once_however_the_tensors_alias_it():
    """Bugs (seen under --tp): two saved tensors sharing one storage without a ``_base`` link
    (``detach``, ``DTensor.from_local``) counted twice; a DTensor weight's transposed copy, which
    autograd saves, counted as an activation instead of as the parameter it is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from leantrain.memory.accountant import SavedActivations
    from tests.test_batch_norm import one_process_group

    weight = torch.randn(4, 4, requires_grad=True)
    values = torch.randn(4, 4)
    with SavedActivations([weight]) as saved:
        ((weight * values).sum() + (weight * values.detach()).sum()).backward()
    assert saved.bytes == values.numel() * values.element_size()  # one storage, once

    with one_process_group("gloo"):
        mesh = init_device_mesh("cpu", (1,))
        split = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        inputs = distribute_tensor(torch.randn(2, 4), mesh, [Shard(0)])
        with SavedActivations([split]) as saved:
            torch.nn.functional.linear(inputs, split).sum().backward()
        assert saved.bytes == inputs.to_local().numel() * inputs.to_local().element_size()
