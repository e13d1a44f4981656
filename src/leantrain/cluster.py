"""Which process this is: single, launched by torchrun, or a SLURM task.

torchrun's variables take precedence over SLURM's: under ``srun torchrun ...`` both are
set, and torchrun's describe the worker processes it started.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from leantrain.errors import LeantrainError

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ClusterEnv:
    source: str  # "single", "torchrun" or "slurm"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # processes on this node
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, checkpoints, the summary and the weights."""
        return self.rank == 0


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnv:
    """The cluster environment described by ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return ClusterEnv(
            "torchrun",
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=_int(env, "WORLD_SIZE"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        return ClusterEnv(
            "slurm",
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            world_size=_int(env, "SLURM_NTASKS"),
            local_world_size=_slurm_tasks_on_this_node(env),
            master_addr=env.get("MASTER_ADDR") or (first_host(nodes) if nodes else "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        )
    return ClusterEnv("single")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise LeantrainError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LeantrainError(f"environment variable {name}={raw!r} is not an integer") from None


def _slurm_tasks_on_this_node(env: Mapping[str, str]) -> int:
    """SLURM_NTASKS_PER_NODE, else the first count of SLURM_TASKS_PER_NODE ("4(x2),3" -> 4)."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    match = re.match(r"(\d+)", env.get("SLURM_TASKS_PER_NODE", ""))
    return int(match.group(1)) if match else 1


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise LeantrainError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]
