"""The sbatch script of `leantrain slurm`: its text, and its pre-emption logic run for real.

SLURM is not installed here, so the last test runs the generated script with bash and
stand-ins for ``srun`` (runs the command), ``scontrol`` (names the node, records the
requeue) and ``scancel`` (absent, as when the step cannot be signalled by id): the
script's own fallback then signals the job step directly.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leantrain.cli import main
from leantrain.errors import LeantrainError
from leantrain.launch import slurm
from leantrain.launch.slurm import SlurmOptions, sbatch_script, submit
from tests.conftest import python_path
from tests.distributed.conftest import SLOW_SUM_ON_TWO_RANKS

LEANTRAIN = str(Path(sys.executable).parent / "leantrain")
REPO = Path(__file__).parents[2]


def test_dry_run_script_has_the_job_shape_and_the_requeue_logic():
    options = SlurmOptions(nodes=2, gpus_per_node=4, partition="gpu", time="4:00:00", signal_seconds=300)
    script = sbatch_script(options, ["--example", "charlm", "--out", "runs/lm"])
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=4:00:00",
        "trap on_time_limit USR1",
        'scontrol requeue "$SLURM_JOB_ID"',
    ]:
        assert line in script
    assert f"{sys.executable} -m leantrain launch" in script
    assert '--nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node 4' in script
    assert "fit --example charlm --out runs/lm --resume auto &" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid bash


def test_a_cpu_cluster_job_asks_for_no_gpus_and_passes_what_clusters_require(tmp_path):
    options = SlurmOptions(
        gpus_per_node=0, procs_per_node=2, account="proj", qos="high", constraint="skylake", exclusive=True,
        sbatch_arg=("--mem=8G", "--mail-type=END"),
    )  # fmt: skip
    script = sbatch_script(options, ["--out", str(tmp_path / "run")])
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert not any("gpus" in line or "cpus-per-task" in line for line in directives)  # SLURM's defaults
    for line in ["--account=proj", "--qos=high", "--constraint=skylake", "--exclusive", "--mem=8G",
                 "--mail-type=END", f"--output={tmp_path / 'run' / 'slurm-%j.out'}"]:  # fmt: skip
        assert f"#SBATCH {line}" in directives
    assert '--nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node 2' in script
    explicit = sbatch_script(SlurmOptions(gpus_per_node=0, cpus_per_task=6), ["--out", "r"])
    assert "#SBATCH --cpus-per-task=6" in explicit and "--nproc-per-node 1" in explicit


def test_relative_run_folders_become_absolute_in_the_output_directive(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = sbatch_script(SlurmOptions(), ["--out=runs/a"])
    assert f"#SBATCH --output={tmp_path / 'runs' / 'a' / 'slurm-%j.out'}" in script


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(gpus_per_node=-1), "invalid gpus_per_node=-1: must be 0 (CPUs) or more"),
        (dict(gpus_per_node=4, procs_per_node=2), "invalid procs_per_node=2: with GPUs there is one process"),
        (dict(procs_per_node=0, gpus_per_node=0), "invalid procs_per_node=0: must be 1 or more"),
        (dict(sbatch_arg=("mem=8G",)), "invalid sbatch_arg='mem=8G': must be one sbatch option"),
        (dict(sbatch_arg=("--mem=8G\n#SBATCH --x",)), "must be one sbatch option"),
    ],
)
def test_bad_job_shapes_are_one_line_errors(options, message):
    with pytest.raises(LeantrainError, match=re.escape(message)):
        sbatch_script(SlurmOptions(**options), ["--out", "r"])


def test_an_explicit_resume_is_kept():
    script = sbatch_script(SlurmOptions(), ["--out", "x", "--resume", "x/checkpoints/step-00000010.pt"])
    assert "--resume auto" not in script and "--resume x/checkpoints/step-00000010.pt" in script


def test_the_run_folder_is_required():
    with pytest.raises(LeantrainError, match="needs fit --out DIR"):
        sbatch_script(SlurmOptions(), ["--example", "digits"])


def test_cli_dry_run_prints_the_script_and_validates_fit_flags(capsys):
    assert main(["slurm", "--nodes", "2", "--dry-run", "true", "fit", "--out", "r"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash")
    assert main(["slurm", "--dry-run", "true", "fit", "--out", "r", "--precision", "8"]) == 2
    allowed = "32, bf16-mixed, 16-mixed, bf16-true, 16-true"
    assert capsys.readouterr().err == f"leantrain: error: invalid precision='8': must be one of {allowed}\n"


def fake_slurm_commands(folder: Path) -> None:
    scripts = {
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n',
        "scontrol": 'if [ "$1" = show ]; then echo localhost; else echo "$@" >> "$REQUEUE_LOG"; fi\n',
    }
    for name, body in scripts.items():
        path = folder / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


def fake_sbatch(folder: Path, body: str) -> None:
    path = folder / "sbatch"
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_submit_hands_sbatch_the_script_and_returns_the_job_id(tmp_path, monkeypatch):
    """The run folder is made first (SLURM writes the job's output there and makes no folder), the
    script goes to sbatch --parsable as a file, removed after, and the id is read from its answer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "seen"
    fake_sbatch(bin_dir, f'echo "$1 $2" > {seen}; cat "$2" >> {seen}; echo "4242;cluster-a"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    run_dir = tmp_path / "runs" / "a"
    assert submit("#!/bin/bash\necho job\n", run_dir) == "4242"
    assert run_dir.is_dir()
    flag, script = seen.read_text().splitlines()[0].split()
    assert flag == "--parsable" and script.endswith(".sbatch") and not Path(script).exists()
    assert seen.read_text().splitlines()[1:] == ["#!/bin/bash", "echo job"]


def test_a_refused_or_missing_sbatch_is_one_line(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_sbatch(bin_dir, 'echo "sbatch: error: invalid partition" >&2; echo "  specified" >&2; exit 1\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    with pytest.raises(LeantrainError, match=r"^sbatch failed: sbatch: error: invalid partition specified$"):
        submit("#!/bin/bash\n", tmp_path / "run")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(
        LeantrainError, match=r"^sbatch is not installed here; use --dry-run to print the script$"
    ):
        submit("#!/bin/bash\n", tmp_path / "run")


def test_an_sbatch_that_does_not_answer_is_one_line_within_the_bound(tmp_path, monkeypatch):
    """slurmctld down: sbatch waits on it. The command ends at the bound, saying the job's state is
    unknown."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_sbatch(bin_dir, "exec sleep 60\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(slurm, "SBATCH_SECONDS", 1)
    started = time.monotonic()
    with pytest.raises(
        LeantrainError,
        match=r"^sbatch did not answer within 1 s: the job may or may not be queued; look with squeue before "
        r"submitting again$",
    ):
        submit("#!/bin/bash\n", tmp_path / "run")
    assert time.monotonic() - started < 30


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_time_limit_signal_checkpoints_requeues_and_the_job_resumes_exactly(tmp_path, uninterrupted_slow_sum):
    fit = [*SLOW_SUM_ON_TWO_RANKS, "--checkpoint-every", "100"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_slurm_commands(bin_dir)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONPATH": python_path(REPO),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # two gloo ranks on the CPU, also on a machine with one GPU
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
        "REQUEUE_LOG": str(tmp_path / "requeue.log"),
    }
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(SlurmOptions(gpus_per_node=2, port=free_port()), [*fit, "--out", "run"]))
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert job.stdout is not None
    for line in job.stdout:
        if line.startswith("step 8/"):
            break
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@...` does
    rest, stderr = job.communicate(timeout=240)
    assert job.returncode == 0, stderr[-3000:]
    assert "time limit near" in rest
    assert (tmp_path / "requeue.log").read_text().split() == ["requeue", "4242"]
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert len(checkpoints) == 1 and checkpoints[0] < "step-00000040.pt"  # saved on the signal
    assert not (tmp_path / "run" / "summary.json").exists()

    again = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )  # fmt: skip  (the requeued job)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after step" in again.stdout
    expected = load_file(uninterrupted_slow_sum / "model.safetensors")
    actual = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
