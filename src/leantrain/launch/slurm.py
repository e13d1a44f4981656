"""``leantrain slurm``: an sbatch script that runs ``leantrain launch`` on every node.

One SLURM task per node runs torchrun, which starts one worker per GPU (or ``procs_per_node``
workers on a CPU cluster, ``gpus_per_node=0``). Before the time
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

# sbatch answers in a second; a slurmctld that does not answer must not hold the command forever.
SBATCH_SECONDS = 120
CPUS_PER_GPU = 8  # --cpus-per-task's default with GPUs: loader workers and the host side of each GPU


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int = 1
    gpus_per_node: int = 1  # 0: a CPU cluster (no GRES line); processes from procs_per_node
    procs_per_node: int | None = None  # None: one per GPU, or 1 without GPUs
    cpus_per_task: int | None = None  # None: CPUS_PER_GPU per GPU, or SLURM's default without GPUs
    partition: str | None = None
    time: str | None = None  # SLURM's format, e.g. "2:00:00"
    job_name: str = "leantrain"
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    sbatch_arg: tuple[str, ...] = ()  # further directives, written as given: "--mem=64G"
    signal_seconds: int = 120  # warning before the time limit, to save a checkpoint
    port: int = 29500  # the rendezvous port on the first node

    @property
    def processes_per_node(self) -> int:
        return self.procs_per_node or self.gpus_per_node or 1

    def check(self) -> None:
        for name in ("nodes", "signal_seconds", "port", "procs_per_node", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LeantrainError(f"invalid {name}={value}: must be 1 or more")
        if self.gpus_per_node < 0:
            raise LeantrainError(f"invalid gpus_per_node={self.gpus_per_node}: must be 0 (CPUs) or more")
        if self.gpus_per_node and self.procs_per_node not in (None, self.gpus_per_node):
            raise LeantrainError(
                f"invalid procs_per_node={self.procs_per_node}: with GPUs there is one process per GPU "
                f"({self.gpus_per_node}); leave it out, or give --gpus-per-node 0 for a CPU cluster"
            )
        for directive in self.sbatch_arg:
            if not directive.startswith("--") or any(c in directive for c in "\n\r"):
                raise LeantrainError(
                    f"invalid sbatch_arg={directive!r}: must be one sbatch option, such as --mem=64G"
                )

    def directives(self, run_dir: Path) -> list[str]:
        """The ``#SBATCH`` options, the job's output file in the run folder."""
        cpus = self.cpus_per_task or (CPUS_PER_GPU * self.gpus_per_node if self.gpus_per_node else None)
        optional = {
            "gpus-per-node": self.gpus_per_node or None,  # no GRES request on a CPU cluster
            "cpus-per-task": cpus,  # unset: SLURM's own default
            "partition": self.partition,
            "time": self.time,
            "account": self.account,
            "qos": self.qos,
            "constraint": self.constraint,
        }
        return [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes}",
            "--ntasks-per-node=1",
            *(f"--{name}={value}" for name, value in optional.items() if value is not None),
            *(["--exclusive"] if self.exclusive else []),
            f"--signal=B:USR1@{self.signal_seconds}",
            "--requeue",
            "--open-mode=append",
            f"--output={run_dir / 'slurm-%j.out'}",
            *self.sbatch_arg,
        ]


def run_folder(fit_arguments: Sequence[str]) -> Path:
    """The run folder that ``fit --out`` names (absolute: the job's output file goes there)."""
    arguments = list(fit_arguments)
    for index, argument in enumerate(arguments):
        for flag in ("--out", "--out-dir"):
            if argument == flag and index + 1 < len(arguments):
                return Path(arguments[index + 1]).resolve()
            if argument.startswith(flag + "="):
                return Path(argument.split("=", 1)[1]).resolve()
    raise LeantrainError("leantrain slurm needs fit --out DIR: the run folder that a requeued job resumes")


def _with_resume(fit_arguments: Sequence[str]) -> list[str]:
    """The fit arguments, with ``--resume auto`` added: a requeued job continues its run."""
    arguments = list(fit_arguments)
    if not any(a == "--resume" or a.startswith("--resume=") for a in arguments):
        arguments += ["--resume", "auto"]
    return arguments


def sbatch_script(options: SlurmOptions, fit_arguments: Sequence[str]) -> str:
    options.check()
    run_dir = run_folder(fit_arguments)
    fit = shlex.join(_with_resume(fit_arguments))
    python = shlex.quote(sys.executable)  # this environment's Python, on every node
    header = "\n".join(f"#SBATCH {directive}" for directive in options.directives(run_dir))
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
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node {options.processes_per_node} \\
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


def submit(script: str, run_dir: Path) -> str:
    """Submit with sbatch; the job id. The run folder is made first: SLURM writes the job's output
    file there, and does not make folders."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as handle:
        handle.write(script)
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", handle.name],
            capture_output=True,
            text=True,
            check=False,
            timeout=SBATCH_SECONDS,
        )
    except FileNotFoundError:
        raise LeantrainError("sbatch is not installed here; use --dry-run to print the script") from None
    except subprocess.TimeoutExpired:
        raise LeantrainError(
            f"sbatch did not answer within {SBATCH_SECONDS} s: the job may or may not be queued; "
            "look with squeue before submitting again"
        ) from None
    finally:
        Path(handle.name).unlink(missing_ok=True)
    if done.returncode != 0:
        raise LeantrainError(f"sbatch failed: {' '.join(done.stderr.split())}")
    return done.stdout.strip().split(";")[0]
