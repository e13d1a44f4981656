"""The lists the docs give of what a run writes are the lists a run writes (they drifted before:
`out_dir` and `skipped_steps` were missing, the columns in another order)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import leantrain as lt
from leantrain.cli import main
from tests.conftest import TinyClassifier, quiet_config

README = Path(__file__).parents[1] / "README.md"


def documented(file: str) -> list[str]:
    """The names README's table of run outputs gives for ``file``, in order (``val_*`` left out)."""
    [row] = [line for line in README.read_text().splitlines() if line.startswith(f"| `{file}` |")]
    cell = row.split("|")[2]
    return list(dict.fromkeys(re.findall(r"`([a-z_]+)`", cell)))


def test_readme_lists_the_summary_and_the_metrics_columns_a_run_writes(tmp_path):
    """With every optional column: clipping (grad_norm), fp16 (its loss scale), validation."""
    config = quiet_config(tmp_path / "run", global_batch_size=16, max_steps=2, log_every_n_steps=1,
                          max_grad_norm=1.0, precision="16-mixed")  # fmt: skip
    lt.Trainer(config).fit(TinyClassifier(samples=64))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sorted(documented("summary.json")) == sorted(k for k in summary if not k.startswith("val_"))
    with (tmp_path / "run" / "metrics.csv").open() as handle:
        header = next(csv.reader(handle))
    written = [column for column in header if not column.startswith("val_")]
    assert documented("metrics.csv") == written


def test_the_plan_table_in_memory_md_has_the_columns_plan_prints(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per row, whatever the terminal
    assert main(["plan", "--example", "digits", "--global-batch-size", "32", "--memory-budget", "17MiB"]) == 0
    printed = capsys.readouterr().out
    docs = (README.parent / "docs" / "memory.md").read_text()
    [shown] = [line for line in docs.splitlines() if line.startswith("┃ micro ┃")]
    [real] = [line for line in printed.splitlines() if line.startswith("┃ micro ┃")]
    assert shown.split() == real.split()
