"""`leantrain launch` for real: two "nodes" on one machine, and an elastic restart after a kill."""

from __future__ import annotations

import inspect
import socket
import subprocess
import time

import torch
from safetensors.torch import load_file

from tests.distributed import tasks
from tests.distributed.conftest import (
    LEANTRAIN,
    REPO,
    SLOW_SUM_ON_TWO_RANKS,
    fit_here,
    launch_here,
    run_with_one_kill,
    worker_env,
)

FIT = "fit --task tests.distributed.tasks:sum_task --global-batch-size 16 --micro-batch-size 4 --max-steps 20"
FIT = [*FIT.split(), "--progress", "plain", "--logger", "none"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in b)


def test_two_nodes_on_one_machine_match_one_process(tmp_path):
    fit_here(*FIT, "--micro-batch-size", "16", "--out", str(tmp_path / "single"))
    node = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    node += [*FIT, "--out", str(tmp_path / "two-nodes")]
    # Node 1's launcher is a process of its own; node 0's runs in this one (launch_here).
    with (tmp_path / "node1.err").open("w+") as errors:
        other = subprocess.Popen([LEANTRAIN, "launch", "--node-rank", "1", *node], cwd=REPO, env=worker_env(),
                                 stdout=subprocess.DEVNULL, stderr=errors)  # fmt: skip
        try:
            launch_here("--node-rank", "0", *node)
            other.wait(timeout=240)
        finally:
            other.kill()  # nothing is left running when the test fails
        errors.seek(0)
        assert other.returncode == 0, errors.read()[-3000:]
    summary = (tmp_path / "two-nodes" / "summary.json").read_text()
    assert '"world_size": 2' in summary and '"strategy": "ddp"' in summary
    single = load_file(tmp_path / "single" / "model.safetensors")
    assert max_difference(load_file(tmp_path / "two-nodes" / "model.safetensors"), single) <= 1e-10


def test_a_killed_rank_is_restarted_and_the_run_resumes_exactly(tmp_path, uninterrupted_slow_sum):
    flags = ["fit", *SLOW_SUM_ON_TWO_RANKS, "--checkpoint-every", "4", "--ema-decay", "0.8"]
    flags += ["--resume", "auto"]
    stdout = run_with_one_kill([*flags, "--out", str(tmp_path / "restarted")], kill_after="step 10/")
    assert "resumed after step" in stdout  # the restarted group continued from a checkpoint
    for weights in ("model.safetensors", "ema.safetensors"):  # the average too, from rank 0's file
        expected = load_file(uninterrupted_slow_sum / weights)
        actual = load_file(tmp_path / "restarted" / weights)
        assert all(torch.equal(actual[name], expected[name]) for name in expected), weights


def test_each_rank_draws_its_own_random_numbers(tmp_path, monkeypatch):
    """Dropout masks must differ across ranks, while the initial weights agree."""
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probe))
    task = ["--task", "tests.distributed.tasks:RecordsRandomNumbers"]
    launch_here("--nproc-per-node", "2", *FIT, "--max-steps", "3", "--out", str(tmp_path / "run"), *task)
    draws = [(probe / f"rank{rank}.txt").read_text().split() for rank in (0, 1)]
    assert len(draws[0]) == len(draws[1]) == 3 * 2  # 3 steps of 2 micro-batches
    assert not set(draws[0]) & set(draws[1])


def test_a_rank_stuck_in_its_loss_ends_the_run_naming_the_rank_and_the_line(tmp_path):
    """Rank 1 sleeps forever in the task's loss at step 3; rank 0 waits for it in the all-reduce."""
    out = tmp_path / "run"
    started = time.monotonic()
    done = subprocess.run(
        [LEANTRAIN, "launch", "--nproc-per-node", "2", *FIT, "--max-steps", "20", "--hang-timeout", "5",
         "--task", "tests.distributed.tasks:SleepsOnRank1", "--out", str(out)],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert time.monotonic() - started < 5 + 60
    source, first = inspect.getsourcelines(tasks.SleepsOnRank1.loss)
    line = first + next(i for i, text in enumerate(source) if "time.sleep(3600)" in text)
    said = [text for text in done.stderr.splitlines() if "leantrain: error: no progress" in text]
    assert len(said) == 1, done.stderr[-3000:]
    assert " s at step 3: rank 1 did not arrive; rank 1 at " in said[0]
    assert f"tasks.py:{line} in loss; rank 0 waits at " in said[0]
    assert sorted(p.name for p in (out / "hang").iterdir()) == ["rank0.txt", "rank1.txt"]
    assert f"line {line} in loss" in (out / "hang" / "rank1.txt").read_text()
