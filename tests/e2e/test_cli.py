"""Drive the installed ``leantrain`` command as a user would; where only what a command prints and
returns is checked, it runs in the test process (``main``), without an interpreter's start-up."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from leantrain.cli import build_parser, main
from tests.conftest import python_path

LEANTRAIN = str(Path(sys.executable).parent / "leantrain")


def run(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([LEANTRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """``leantrain ARGS`` in this process: its exit code (argparse's --help exits) and what it printed."""
    try:
        code = main(list(args))
    except SystemExit as exit:
        code = exit.code
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(["leantrain", *args], code, printed.out, printed.err)


def test_fit_without_arguments_trains_digits_to_95_percent(tmp_path):
    done = run("fit", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("digits-")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_accuracy"] >= 0.95
    # How long it takes is benchmarks/startup.py's to measure: on a busy machine it took 85 s, not 20.
    assert {"metrics.csv", "model.safetensors", "summary.json"} <= {p.name for p in run_dir.iterdir()}
    assert list(run_dir.glob("events.out.tfevents.*"))
    # not a terminal: plain progress lines, and the summary table
    assert "step 220/220" in done.stdout and "val_accuracy" in done.stdout


def test_flags_and_yaml_config_set_the_same_fields(tmp_path, monkeypatch, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        "example: digits\nglobal_batch_size: 32\nmicro-batch-size: 8\nprecision: 32\nmax_steps: 6\n"
    )
    monkeypatch.chdir(tmp_path)
    flags = ["--config", str(config), "--log-every-n-steps", "3", "--out", "out", "--logger", "none"]
    done = run_here(capsys, "fit", *flags)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    split = (summary["global_batch_size"], summary["micro_batch_size"], summary["accumulation_steps"])
    assert split == (32, 8, 4)
    assert summary["steps"] == 6
    rows = list(csv.DictReader((tmp_path / "out" / "metrics.csv").open()))
    assert [r["step"] for r in rows if r["train_loss"]] == ["3", "6"]
    assert not list((tmp_path / "out").glob("events.out.tfevents.*"))


def test_bad_input_prints_one_line_and_exits_2(tmp_path):
    """The installed command end to end; every other bad input is checked in-process, by
    tests/test_hostile_input.py, through the same ``cli.main``."""
    done = run("fit", "--global-batch-size", "-3", "--out", "out", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "invalid global_batch_size=-3: must be a positive integer" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_failing_dataset_item_is_named(tmp_path):
    (tmp_path / "broken_task.py").write_text(
        "from tests.conftest import TinyClassifier\n"
        "class Broken(TinyClassifier):\n"
        "    def train_data(self):\n"
        "        data = super().train_data()\n"
        "        class Bad(type(data)):\n"
        "            def __getitem__(self, i):\n"
        "                if i == 7: raise KeyError('label')\n"
        "                return super().__getitem__(i)\n"
        "        return Bad(*data.tensors)\n"
    )
    env_path = f"{tmp_path}:{Path(__file__).parents[2]}"
    done = subprocess.run(
        [
            LEANTRAIN,
            "fit",
            "--task",
            "broken_task:Broken",
            "--global-batch-size",
            "256",
            "--num-workers",
            "1",
            "--out",
            "out",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": env_path, "PATH": ""},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "leantrain: error: train_data item 7 failed: KeyError: 'label'"


def test_examples_lists_the_builtin_tasks(capsys):
    done = run_here(capsys, "examples")
    assert done.returncode == 0
    for name in ("digits", "charlm", "slowdata", "hf-gpt2"):
        assert name in done.stdout
    assert "leantrain[hf]" in done.stdout  # printed as text, not taken for rich markup


def test_help_is_grouped_by_concern(capsys):
    done = run_here(capsys, "fit", "--help")
    assert done.returncode == 0
    headings = [
        "Task:",
        "Batch and schedule",
        "Optimization:",
        "Precision:",
        "Data loading:",
        "Devices and parallelism:",
        "Reproducibility:",
        "Logging and outputs:",
    ]
    positions = [done.stdout.index(h) for h in headings]
    assert positions == sorted(positions)


# Adding or renaming a flag is a user-facing change: update this list on purpose.
FROZEN_FIT_FLAGS = {
    "--compile",
    "--compile-mode",
    "--config",
    "--print_config",
    "--task",
    "--example",
    "--global-batch-size",
    "--micro-batch-size",
    "--max-steps",
    "--max-epochs",
    "--shuffle",
    "--pack-length",
    "--max-grad-norm",
    "--lr-scaling",
    "--reference-batch-size",
    "--lr-schedule",
    "--lr-warmup-steps",
    "--lr-min-ratio",
    "--precision",
    "--on-nan",
    "--on-spike",
    "--spike-threshold",
    "--spike-window",
    "--snapshot-every",
    "--max-rollbacks",
    "--reduced-precision-reduction",
    "--activation-checkpointing",
    "--memory-budget",
    "--num-workers",
    "--pin-memory",
    "--prefetch-factor",
    "--cache",
    "--device",
    "--strategy",
    "--shard-blocks",
    "--sync-batchnorm",
    "--device-map",
    "--pipeline-stages",
    "--pipeline-schedule",
    "--tp",
    "--sequence-parallel",
    "--loss-parallel",
    "--seed",
    "--deterministic",
    "--out-dir",
    "--out",
    "--staging-dir",
    "--log-every-n-steps",
    "--val-every-n-steps",
    "--progress",
    "--logger",
    "--mlflow-uri",
    "--wandb-project",
    "--tracker-timeout",
    "--tracker-required",
    "--checkpoint-every",
    "--keep-checkpoints",
    "--resume",
    "--keep-best",
    "--best-metric",
    "--best-mode",
    "--early-stop-metric",
    "--early-stop-mode",
    "--early-stop-patience",
    "--early-stop-min-delta",
    "--ema-decay",
    "--ema-validate",
    "--lora-rank",
    "--lora-targets",
    "--lora-alpha",
    "--lora-dropout",
    "--hang-timeout",
    "--async-checkpoint",
}


def _flags(command: str) -> set[str]:
    parser = build_parser()._subcommands_action._name_parser_map[command]
    return {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}


def test_the_set_of_fit_flags_is_frozen():
    assert _flags("fit") == FROZEN_FIT_FLAGS


def test_doctor_takes_the_fit_flags_and_its_own():
    own = {"--steps", "--warmup-steps", "--report", "--json", "--trace", "--try-compile"}
    assert _flags("doctor") == FROZEN_FIT_FLAGS | own


def test_launch_checks_that_the_batch_splits_over_the_processes_before_starting_them(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    flags = ["--global-batch-size", "64", "--out", "out"]
    done = run_here(capsys, "launch", "--nproc-per-node", "3", "fit", *flags)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "leantrain: error: invalid global_batch_size=64: must be a multiple of the world size 3"
    )
    assert not (tmp_path / "out").exists()


def test_launch_and_slurm_need_the_fit_command(capsys):
    for command in ("launch", "slurm"):
        done = run_here(capsys, command, "--global-batch-size", "64")
        assert done.returncode == 2 and "leantrain: error:" in done.stderr


def test_a_nan_loss_prints_one_line_naming_the_step_and_the_saved_state(tmp_path):
    repo = Path(__file__).parents[2]
    done = subprocess.run(
        [LEANTRAIN, "fit", "--task", "tests.distributed.tasks:nan_in_second_half_of_step3",
         "--global-batch-size", "16", "--micro-batch-size", "8", "--max-steps", "6", "--progress", "none",
         "--out", str(tmp_path / "x")],
        cwd=repo, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": python_path(repo)},
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "not finite at step 3" in line and "step-00000002.pt" in line
    assert (tmp_path / "x" / "checkpoints" / "step-00000002.pt").is_file()


def test_cache_builds_once_then_fit_reads_it(tmp_path, monkeypatch, capsys):
    """The installed command builds the cache; the later commands run in this process (``main``)."""
    from leantrain.examples.digits import DigitsTask

    items = f"{len(DigitsTask().train_data()):,}"
    built = run("cache", "--example", "digits", "--out", "c", "--num-workers", "0", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert f"c/train: {items} items" in built.stdout and "built in" in built.stdout
    monkeypatch.chdir(tmp_path)
    assert main(["cache", "--example", "digits", "--out", "c"]) == 0
    assert "already complete" in capsys.readouterr().out
    assert main(["fit", "--cache", "c", "--max-steps", "5", "--progress", "plain", "--out", "r"]) == 0
    fit = capsys.readouterr().out
    assert f"cache c/train: {items} train items" in fit and ", read" in fit
    assert main(["cache", "--example", "charlm", "--out", "c"]) == 2
    assert capsys.readouterr().err.startswith("leantrain: error: cache c/train holds other data")


def test_the_summary_table_shows_values_as_summary_json_holds_them():
    from leantrain.cli import _summary_text

    # A bool is an int: it printed as 0 and 1 where summary.json says false and true.
    assert [_summary_text(v) for v in (True, False, 1234567, 0.000123456, "single")] == [
        "true", "false", "1,234,567", "0.0001235", "single"
    ]  # fmt: skip


def test_the_summary_table_shows_a_run_folders_and_a_nan_origins_brackets():
    """rich reads ``[...]`` as markup: ``runs/[exp1]`` showed as ``runs/``."""
    from pathlib import Path

    from rich.console import Console

    from leantrain.cli import _summary_table
    from leantrain.run.results import FitResult

    result = FitResult(
        steps=3, samples=48, final_train_loss=0.5, samples_per_second=10.0, wall_seconds=4.8,
        micro_batch_size=16, accumulation_steps=1, world_size=1, precision="32", strategy="single",
        peak_memory_bytes=0, global_batch_size=16, device="cpu", nan_origin="non-finite output of [layers].0",
        out_dir=Path("runs/[exp1]"),
    )  # fmt: skip
    console = Console(record=True, width=200)
    console.print(_summary_table(result))
    text = console.export_text()
    assert "summary (runs/[exp1]/summary.json)" in text
    assert "│ out_dir " in text and "runs/[exp1] " in text and "non-finite output of [layers].0 " in text


TASK_FILE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Tiny:
    def model(self):
        return nn.Linear(4, 1)

    def train_data(self):
        generator = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator))

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)
"""


def test_a_task_file_in_the_current_folder_is_found_as_python_m_finds_it(tmp_path):
    """README's `--task mod:Class` with a file of one's own, where one stands (no PYTHONPATH)."""
    (tmp_path / "mytask.py").write_text(TASK_FILE)
    flags = ["--max-steps", "2", "--global-batch-size", "8", "--logger", "none", "--progress", "none"]
    done = run("fit", "--task", "mytask:Tiny", *flags, "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 2


def test_leantrain_warnings_are_one_line_as_its_errors_are(tmp_path, capfd):
    """Python shows a warning as two lines: the file and line that raised it, then that source line.
    The command shows leantrain's own as one line (an out-of-memory halving said the new split in
    a form users overlooked); Python's own display is back once the command returns."""
    task = "tests.distributed.tasks:nan_in_second_half_of_step3"  # step 3's loss is NaN
    flags = ["--global-batch-size", "16", "--micro-batch-size", "8", "--max-steps", "4", "--on-nan", "skip"]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        python_display = warnings.showwarning
        assert main(["fit", "--task", task, *flags, "--out", str(tmp_path / "run"), "--logger", "none"]) == 0
        assert warnings.showwarning is python_display
    err = capfd.readouterr().err
    assert "leantrain: warning: step 3 skipped: the training loss is not finite; replaying step 3" in err
    assert "LeantrainWarning" not in err


def test_a_closed_standard_output_stops_the_run_with_one_line(tmp_path):
    """`leantrain fit | head -2` ended in a BrokenPipeError traceback (exit 1)."""
    flags = ["--max-steps", "400", "--log-every-n-steps", "1", "--progress", "plain", "--logger", "none"]
    process = subprocess.Popen([LEANTRAIN, "fit", *flags, "--out", "out"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    for line in process.stdout:
        if line.startswith("step 2/"):
            break
    process.stdout.close()  # as head does after its lines
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 141, stderr
    assert (
        stderr.strip().splitlines()[-1]
        == "leantrain: stopped: its standard output was closed (the reader ended)"
    )
    assert "Traceback" not in stderr


def test_the_examples_list_names_each_example_its_task_and_what_it_is_and_marks_the_default():
    from rich.console import Console

    from leantrain.cli import list_examples
    from leantrain.examples import DEFAULT_EXAMPLE, EXAMPLES

    console = Console(record=True, width=300)
    list_examples(console)
    lines = console.export_text().splitlines()
    assert lines[0].strip() == "built-in examples (leantrain fit --example NAME)"
    header = next(line for line in lines if line.startswith("┃"))
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == ["name", "task", "what it is"]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert rows == [
        [name + (" (default)" if name == DEFAULT_EXAMPLE else ""), spec, description]
        for name, (spec, description) in EXAMPLES.items()
    ]
    assert sum(row[0].endswith(" (default)") for row in rows) == 1
