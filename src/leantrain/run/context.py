"""What a run is given before any of its parts is built: the config, the task, where it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from leantrain.cluster import ClusterEnv
from leantrain.config import TrainConfig
from leantrain.run.hooks import Instruments
from leantrain.run.mirror import RunMirror
from leantrain.strategies.dims import ParallelDims


@dataclass(frozen=True)
class RunContext:
    """The run's inputs, as ``Trainer.fit`` checked and resolved them; every builder reads them here."""

    cfg: TrainConfig
    task: Any
    env: ClusterEnv
    device: torch.device  # the device this process drives (the local rank's GPU, or the CPU)
    run_dir: Path
    dims: ParallelDims  # how the processes are arranged (the strategy's ``dims``)
    instruments: Instruments  # the doctor's measurements, or ``NoInstruments``
    started: float  # perf_counter() when fit() began
    mirror: RunMirror | None = None  # out_dir is a URL: run_dir is its staging folder

    @property
    def data_env(self) -> ClusterEnv:
        """The processes as the data sees them: the stages of one pipeline load the same samples."""
        return self.dims.data_env(self.env)
