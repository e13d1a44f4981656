"""Hostile input: each bad flag, YAML file or path is one line and exit 2, refused before it takes a machine.

Runs ``leantrain.cli.main`` in this process (no interpreter start per case). A run whose input is
accepted is stopped after its first optimizer step: what matters here is that it got there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leantrain as lt
from leantrain import cli
from leantrain.config import TrainConfig
from leantrain.data.limits import PAGE_BYTES, WORKER_BYTES, check_prefetch, max_workers
from tests.conftest import RegressionTask

BASE = ["fit", "--task", "tests.conftest:TinyClassifier", "--progress", "none", "--logger", "none"]
# Seconds a refused input may take: it must be refused before anything heavy starts.
REFUSED_WITHIN = 5.0


def child_processes() -> list[int]:
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids += [int(pid) for pid in (task / "children").read_text().split()]
    return pids


class ReachedTraining(Exception):
    """The input was accepted: a first optimizer step ran."""


class StopsAfterFirstStep(lt.Trainer):
    """The CLI's Trainer, stopped after one step; notes how many processes the run had then."""

    children_seen = 0

    def __init__(self, config: TrainConfig, callbacks=(), instruments=None) -> None:
        super().__init__(config, [self], instruments)

    def on_step(self, stats: lt.StepStats) -> None:
        StopsAfterFirstStep.children_seen = len(child_processes())
        raise ReachedTraining


class Outcome:
    def __init__(self, code: int | None, stderr: str, seconds: float) -> None:
        self.code, self.stderr, self.seconds = code, stderr, seconds

    def assert_one_line_refusal(self, *parts: str) -> None:
        lines = self.stderr.strip().splitlines()
        assert self.code == 2, (self.code, self.stderr)
        assert len(lines) == 1 and lines[0].startswith("leantrain: error: "), self.stderr
        for part in parts:
            assert part in lines[0]
        assert self.seconds < REFUSED_WITHIN
        assert child_processes() == []


def run_cli(*args: str) -> Outcome:
    """``leantrain ARGS`` with a 60 s alarm (a hang fails the test); code None: training started."""

    def hang(signum, frame):
        raise TimeoutError(f"leantrain {' '.join(args)} did not finish within 60 s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    stderr = io.StringIO()
    started = time.perf_counter()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(list(args))
    except ReachedTraining:
        code = None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(code, stderr.getvalue(), time.perf_counter() - started)


@pytest.fixture
def cli_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("leantrain.trainer.Trainer", StopsAfterFirstStep)  # the class `fit` imports
    return run_cli


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (["--num-workers", "99999999999999999999"], ["num_workers=99999999999999999999: at most"]),
        (["--num-workers", "1000"], ["num_workers=1000: at most", "auto picks a share of the CPUs"]),
        (["--num-workers", "2", "--prefetch-factor", "9" * 20], ["prefetch_factor=", "at most"]),
        (["--cache", "a_file"], ["cache='a_file': is a file; give a folder"]),
        (["--out", "a_file/run"], ["out_dir='a_file/run': is inside a_file, which is a file"]),
        (["--out", "/proc/run"], ["out_dir='/proc/run': cannot be written (No such file or directory)"]),
        (["--resume", "a_folder"], ["checkpoint a_folder does not exist (it is a folder)"]),
        (["--config", "a_folder"], ["config='a_folder': is a folder; give a YAML file"]),
        (["--config", "empty.yaml"], ["config='empty.yaml': must hold a mapping", "found nothing"]),
        (["--config", "list.yaml"], ["must hold a mapping of field: value lines, found a list"]),
        (["--config", "binary.yaml"], ["config='binary.yaml': is not UTF-8 text (byte 0)"]),
        (["--config", "broken.yaml"], ["config='broken.yaml': is not valid YAML at line 2"]),
        (["--max-grad-norm", "1e400"], ["max_grad_norm=inf: must be a positive finite number"]),
        (["--out", "x" * 5000], ["out_dir='xxxxx", "(5,002 characters)"]),
        (["--out", f"a_file/{'deep/' * 30}run"], [f"out_dir='a_file/{'deep/' * 30}run': is inside a_file,"]),
        (["--resume", "a\nb"], ["checkpoint a\\nb does not exist"]),
        (["--cache", "a\x00b"], ["cache='a\\x00b': contains a NUL character"]),
    ],
)  # fmt: skip
def test_each_hostile_input_is_refused_in_one_line_before_anything_starts(cli_run, tmp_path, args, parts):
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xa1\x00\xff" * 20)
    (tmp_path / "broken.yaml").write_text("max_steps: 1\n  bad: indent\n")
    cli_run(*BASE, *args).assert_one_line_refusal(*parts)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--micro-batch-size", "5"], "invalid micro_batch_size=5: must divide the per-process batch 64"),
        (["--precision", "bf17"], "invalid precision='bf17': must be one of 32, bf16-mixed, 16-mixed"),
        (["--max-steps", "ten"], "invalid max_steps='ten': must be an integer or null"),
        (["--example", "nope"], "unknown example 'nope'; available: digits, charlm, slowdata"),
        (["--task", "no_such_pkg.mod:Task"], "cannot import module 'no_such_pkg.mod'"),
        (["--task", "json:JSONDecodeError"], "must be callable with no arguments"),
        (["--task", "x:Y", "--example", "digits"], "give either --task or --example, not both"),
        (["--config", "missing.yaml"], "config='missing.yaml': cannot be read (No such file or directory)"),
        (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1"),
        (["--device", "cuda:7"], "invalid device='cuda:7'"),
        (["--resume", "missing.pt"], "checkpoint missing.pt does not exist"),
    ],
)
def test_bad_flags_and_tasks_are_one_line_and_leave_no_run_folder(cli_run, tmp_path, args, message):
    cli_run("fit", *args, "--out", "out").assert_one_line_refusal(message)
    assert not (tmp_path / "out").exists()


def test_the_worker_bound_is_the_cpus_or_the_memory_whichever_is_tighter():
    assert max_workers(1, cpus=2, memory=2**40)[0] == 8
    assert max_workers(4, cpus=16, memory=2**40)[0] == 16  # each of 4 processes: 4 CPUs' worth
    bound, why = max_workers(1, cpus=64, memory=40 * WORKER_BYTES)
    assert bound == 20 and "of memory available" in why  # half the memory, a worker's least each


def test_the_prefetch_bound_counts_the_batches_held_ahead():
    memory = 2**30
    check_prefetch(100, workers=2, batch_bytes=2**20, memory=memory)  # 200 MiB ahead: fits half of 1 GiB
    with pytest.raises(lt.ConfigError, match="at most"):
        check_prefetch(1000, workers=2, batch_bytes=2**20, memory=memory)  # 2 GiB ahead
    check_prefetch(None, workers=2, memory=memory)
    with pytest.raises(lt.ConfigError, match="at most"):
        check_prefetch(10**20, workers=1, batch_bytes=PAGE_BYTES)


def test_an_items_size_counts_its_tensors_and_arrays_and_the_loader_reads_item_0():
    import numpy as np
    import torch

    from leantrain.data.build import _first_item_bytes
    from leantrain.data.limits import item_bytes

    class Sized:  # an object whose nbytes is not a byte count (a method, as some array types have)
        def nbytes(self) -> int:
            return 10**9

    item = {"x": torch.zeros(4, dtype=torch.float64), "y": [np.zeros(3, np.int16), np.zeros(5, np.uint8)]}
    assert item_bytes({**item, "label": 7, "name": "a", "other": Sized()}) == 32 + 6 + 5
    assert item_bytes(("text", 3)) == 0
    assert _first_item_bytes([item]) == 43  # item 0, in a dataset of one

    class Broken:
        def __getitem__(self, index):
            raise ValueError("unreadable")

    assert _first_item_bytes(Broken()) == 0  # the loader names the failing item


def test_a_prefetch_that_the_data_cannot_hold_is_refused_with_its_item_size(tmp_path, monkeypatch):
    # 64 MiB available: half of it, less a worker's 16 MiB, holds 4096 pages, but only 2340 micro-batches
    # of RegressionTask's 64 items of 14 float64s (7 KiB): the loader's check knows the items' size.
    monkeypatch.setattr("leantrain.data.limits.available_memory", lambda: 64 * 2**20)
    config = lt.TrainConfig(
        out_dir=str(tmp_path / "run"), progress="none", num_workers=1, prefetch_factor=3000
    )
    with pytest.raises(
        lt.ConfigError, match=r"at most 2340 here: 1 worker\(s\) x 2340 micro-batches of 7\.0 KiB"
    ):
        lt.Trainer(config).fit(RegressionTask())
    assert child_processes() == []


# The fuzz: every TrainConfig field (read from the dataclass, so a new field is covered without editing
# this test), with wrong types, out-of-range and huge values, through a flag and through YAML.
FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]
HOSTILE = ["", " ", "-1", "0", "1", "3", "9" * 20, "-" + "9" * 20, str(2**63), "1.5", "1e400", "nan",
           "-inf", "true", "null", "abc", "a\nb", "a\x00b", "cuda:99", "[1, 2]", "{a: 1}", "/proc/x", "auto",
           "tune", "never", "bf16-true", "16-true", "fsdp", "pipeline", "Linear"]  # fmt: skip
VALUES = st.one_of(st.sampled_from(HOSTILE), st.integers(-(2**70), 2**70).map(str), st.text(max_size=10))
EXAMPLES = int(os.environ.get("LEANTRAIN_FUZZ_EXAMPLES", "200"))


def test_fuzz_every_field_ends_in_a_first_step_or_one_line(cli_run, tmp_path):
    runs = iter(range(10**6))
    cpu_bound = max_workers(1)[0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(field=st.sampled_from(FIELDS), raw=VALUES, through_yaml=st.booleans())
    def case(field: str, raw: str, through_yaml: bool) -> None:
        run = f"run{next(runs)}"
        if through_yaml:
            (tmp_path / f"{run}.yaml").write_text(f"{field}: {raw}\n")
            args = [*BASE, "--out", run, "--config", f"{run}.yaml"]
        else:
            args = [*BASE, "--out", run, f"--{field.replace('_', '-')}={raw}"]
        outcome = cli_run(*args)
        if outcome.code is None:  # accepted: it trained a step with a bounded number of processes
            assert StopsAfterFirstStep.children_seen <= cpu_bound
        else:
            outcome.assert_one_line_refusal()

    case()


def test_launch_refuses_what_its_processes_could_not_hold_before_starting_them(cli_run, tmp_path):
    (tmp_path / "a_file").write_text("")
    outcome = cli_run("launch", "--nproc-per-node", "2", *BASE, "--global-batch-size", "8", "--num-workers",
                      "1000000")  # fmt: skip
    bound = max_workers(2)[0]
    outcome.assert_one_line_refusal(f"num_workers=1000000: at most {bound} on this machine")
    cli_run("launch", "--nproc-per-node", "2", *BASE, "--out", "a_file").assert_one_line_refusal("is a file")
