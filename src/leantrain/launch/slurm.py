"""``leantrain slurm``: an sbatch script that runs ``leantrain launch`` on every node.

One SLURM task per node runs torchrun, which starts one worker per GPU. Before the time
limit SLURM sends SIGUSR1 to the batch shell (``--signal=B:USR1@...``); the shell forwards
it to the job step, torchrun forwards it to the workers, the workers save a checkpoint and
stop, and the shell requeues the job, which resumes with ``--resume auto``.

The script is plain text (``--dry-run`` prints it): what runs is what you can read.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from leantrain.errors import LeantrainError


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int = 1
    gpus_per_node: int = 1
    partition: str | None = None
    time: str | None = None  # SLURM's format, e.g. "2:00:00"
    job_name: str = "leantrain"
    cpus_per_gpu: int = 8
    signal_seconds: int = 120  # warning before the time limit, to save a checkpoint
    port: int = 29500  # the rendezvous port on the first node

    def check(self) -> None:
        for name in ("nodes", "gpus_per_node", "cpus_per_gpu", "signal_seconds", "port"):
            if getattr(self, name) < 1:
                raise LeantrainError(f"invalid {name}={getattr(self, name)}: must be 1 or more")


def _with_resume(fit_arguments: Sequence[str]) -> list[str]:
    """The fit arguments, with ``--resume auto`` added: a requeued job continues its run."""
    arguments = list(fit_arguments)
    if not any(a in ("--out", "--out-dir") or a.startswith(("--out=", "--out-dir=")) for a in arguments):
        raise LeantrainError(
            "leantrain slurm needs fit --out DIR: the run folder that a requeued job resumes"
        )
    if not any(a == "--resume" or a.startswith("--resume=") for a in arguments):
        arguments += ["--resume", "auto"]
    return arguments


def sbatch_script(options: SlurmOptions, fit_arguments: Sequence[str]) -> str:
    options.check()
    fit = shlex.join(_with_resume(fit_arguments))
    python = shlex.quote(sys.executable)  # this environment's Python, on every node
    directives = [
        f"--job-name={options.job_name}",
        f"--nodes={options.nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={options.gpus_per_node}",
        f"--cpus-per-task={options.cpus_per_gpu * options.gpus_per_node}",
        f"--signal=B:USR1@{options.signal_seconds}",
        "--requeue",
        "--open-mode=append",
        "--output=%x-%j.out",
    ]
    if options.partition:
        directives.append(f"--partition={options.partition}")
    if options.time:
        directives.append(f"--time={options.time}")
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    return f"""#!/bin/bash
{header}
# Written by `leantrain slurm`. One task per node runs torchrun (`leantrain launch`).
set -u
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
requeue=0
on_time_limit() {{
    # SLURM warns before the time limit: the workers save a checkpoint and stop, then requeue.
    echo "leantrain: time limit near: checkpointing and requeueing job $SLURM_JOB_ID"
    requeue=1
    scancel --signal=USR1 "$SLURM_JOB_ID.$step_id" 2>/dev/null || kill -USR1 "$step_pid"
}}
trap on_time_limit USR1
srun --kill-on-bad-exit=1 {python} -m leantrain launch \\
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node {options.gpus_per_node} \\
    --rdzv-endpoint "$head_node:{options.port}" --rdzv-id "$SLURM_JOB_ID" \\
    fit {fit} &
step_pid=$!
step_id=0
wait "$step_pid"
status=$?
if [ "$requeue" = 1 ]; then
    wait "$step_pid"  # the first wait returned when the trap ran; wait for the checkpoint
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
"""


def submit(script: str) -> str:
    """Submit with sbatch; the job id."""
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as handle:
        handle.write(script)
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", handle.name], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise LeantrainError("sbatch is not installed here; use --dry-run to print the script") from None
    finally:
        Path(handle.name).unlink(missing_ok=True)
    if done.returncode != 0:
        raise LeantrainError(f"sbatch failed: {' '.join(done.stderr.split())}")
    return done.stdout.strip().split(";")[0]
