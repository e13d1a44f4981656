"""Helpers to run leantrain as several real processes (torchrun, gloo, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
LEANTRAIN = str(Path(sys.executable).parent / "leantrain")


def worker_env() -> dict[str, str]:
    """One intra-op thread per process (2 cores are shared), and the tests importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def leantrain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [LEANTRAIN, *args], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"leantrain {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@pytest.fixture
def quiet_fit_flags() -> list[str]:
    return ["--progress", "plain", "--tensorboard", "false", "--log-every-n-steps", "5"]
