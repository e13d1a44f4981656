"""`leantrain slurm` against a real SLURM (a one-node cluster on this machine: local_cluster.py).

Marked ``slurm``: ``make test`` leaves them out, ``make test-slurm`` installs SLURM and runs them,
and they skip with the reason where SLURM cannot start (not root, not installed).

1. A CPU job of 2 processes (``--gpus-per-node 0 --procs-per-node 2``) trains to the end and its
   weights equal ``leantrain launch --nproc-per-node 2``'s.
2. A job with a 2-minute limit is warned by SLURM (``--signal-seconds 90``), checkpoints,
   requeues itself and resumes until done, bit-identical to an uninterrupted run. A requeued job
   waits for SLURM's BeginTime (about 2 minutes, until the last launch's credential expires); the
   test moves that start to a few seconds after the requeue, so each cycle costs seconds, not
   minutes. Nothing else of the cycle is touched.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.conftest import LEANTRAIN, REPO, launch_here, worker_env
from tests.slurm import local_cluster

pytestmark = pytest.mark.slurm

REQUEUE_SETTLE_SECONDS = 3  # a requeued job is started this long after it was held back, not at once
FIT = ["fit", "--global-batch-size", "16", "--micro-batch-size", "4", "--progress", "plain",
       "--logger", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    reason = local_cluster.missing()
    if reason is not None:
        pytest.skip(reason)
    try:
        local_cluster.start()
    except (OSError, subprocess.CalledProcessError, RuntimeError) as error:
        pytest.skip(f"the one-node SLURM cluster did not start: {error}")
    return {**worker_env(), "SLURM_CONF": str(local_cluster.CONF)}


def submit(env: dict[str, str], *arguments: str) -> str:
    done = subprocess.run([LEANTRAIN, "slurm", *arguments], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    job = re.search(r"submitted SLURM job (\d+)", done.stdout)
    assert job is not None, done.stdout
    return job.group(1)


def job_field(env: dict[str, str], job: str, name: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    found = re.search(rf"\b{name}=(\S+)", shown)
    return found.group(1) if found else ""


def job_story(env: dict[str, str], job: str, run_dir: Path) -> str:
    """What SLURM and the job's output say, for a failure's message."""
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    output = run_dir / f"slurm-{job}.out"
    tail = output.read_text()[-4000:] if output.exists() else f"({output} missing)"
    return f"{shown}\n--- the end of {output.name} ---\n{tail}"


def wait_for(env: dict[str, str], job: str, run_dir: Path, timeout: float) -> int:
    """Until the job ends; the times it was requeued and started again sooner than BeginTime."""
    deadline = time.monotonic() + timeout
    restarts = 0
    held_since = None
    while time.monotonic() < deadline:
        state = job_field(env, job, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            assert state == "COMPLETED", f"job {job} ended {state}\n{job_story(env, job, run_dir)}"
            return restarts
        if state == "PENDING" and job_field(env, job, "Reason") == "BeginTime":
            # Not at once: slurmd refuses a launch whose credential is from the same second as the
            # requeue that revoked the last one ("Job credential revoked", the job then FAILED).
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since >= REQUEUE_SETTLE_SECONDS:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
                restarts += 1
                held_since = None
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} did not end within {timeout:.0f} s\n{job_story(env, job, run_dir)}")


def test_a_cpu_job_of_two_processes_trains_as_leantrain_launch(tmp_path, cluster):
    task = ["--task", "tests.distributed.tasks:sum_task", "--max-steps", "20"]
    job = submit(cluster, "--gpus-per-node", "0", "--procs-per-node", "2", "--time", "10", *FIT, *task,
                 "--out", str(tmp_path / "job"))  # fmt: skip
    wait_for(cluster, job, tmp_path / "job", timeout=300)
    launch_here("--nproc-per-node", "2", *FIT, *task, "--out", str(tmp_path / "launch"))
    expected = load_file(tmp_path / "launch" / "model.safetensors")
    actual = load_file(tmp_path / "job" / "model.safetensors")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
    output = (tmp_path / "job" / f"slurm-{job}.out").read_text()  # the job's output, in the run folder
    assert "x 2 process(es), strategy ddp" in output
    print(f"SLURM job {job}: 2 processes on CPUs, weights equal to leantrain launch's (difference 0)")


@pytest.mark.timeout(1200)  # the job (up to 900 s, see wait_for) and an uninterrupted run
def test_a_job_near_its_time_limit_checkpoints_requeues_and_resumes_bit_identical(tmp_path, cluster):
    # slower_sum_task loads each item in 5 ms: 1,600 steps take at least 64 s on any machine, more
    # than an allocation of 2 minutes trains before SLURM's warning 90 s ahead of its end (sent
    # 30 to 60 s in: slurmctld looks every 30 s). A warning before the workers are up (a slow
    # start) ends that launch without a checkpoint; the next one starts from the last checkpoint.
    task = ["--task", "tests.distributed.tasks:slower_sum_task", "--max-steps", "1600",
            "--log-every-n-steps", "20"]  # fmt: skip
    started = time.monotonic()
    job = submit(cluster, "--gpus-per-node", "0", "--procs-per-node", "2", "--time", "2", "--signal-seconds",
                 "90", *FIT, *task, "--out", str(tmp_path / "job"))  # fmt: skip
    restarts = wait_for(cluster, job, tmp_path / "job", timeout=900)
    took = time.monotonic() - started
    output = (tmp_path / "job" / f"slurm-{job}.out").read_text()
    requeues = output.count("time limit near: checkpointing and requeueing")
    assert requeues >= 1 and restarts >= 1, output[-3000:]
    # Every checkpoint a warning made is where a later launch resumed, in order. A warning that came
    # before a launch saved anything (its workers not up yet, or still set up) makes no checkpoint:
    # the next launch starts where the one before it did. One that came after the last step (the
    # run's final checkpoint written) makes a launch that resumes after step 1600 and trains nothing.
    saved = {int(step) for step in re.findall(r"stopped by SIGUSR1 after step (\d+); checkpoint", output)}
    resumed = [int(step) for step in re.findall(r"resumed after step (\d+)", output)]
    assert saved and saved <= set(resumed) and resumed == sorted(resumed), output[-3000:]
    launch_here("--nproc-per-node", "2", *FIT, *task, "--out", str(tmp_path / "uninterrupted"))
    expected = load_file(tmp_path / "uninterrupted" / "model.safetensors")
    actual = load_file(tmp_path / "job" / "model.safetensors")
    difference = max(float((actual[name] - expected[name]).abs().max()) for name in expected)
    assert difference == 0
    steps = ", ".join(map(str, resumed))
    print(f"SLURM job {job}: requeued {requeues} time(s), resumed after steps {steps}; "
          f"final weight difference {difference}; the job took {took:.0f} s")  # fmt: skip
