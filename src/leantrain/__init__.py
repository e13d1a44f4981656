"""leantrain: a PyTorch training engine that is fast, memory-lean, and says why a run is slow."""

from leantrain._version import __version__
from leantrain.config import TrainConfig
from leantrain.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    LeantrainError,
    LeantrainWarning,
    NonFiniteLossError,
    RunInterrupted,
    StorageError,
    TaskError,
)
from leantrain.task import LossSum, Task, load_task
from leantrain.trainer import Callback, FitResult, StepStats, Trainer

__all__ = [
    "Callback",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "FitResult",
    "LeantrainError",
    "LeantrainWarning",
    "LossSum",
    "NonFiniteLossError",
    "RunInterrupted",
    "StepStats",
    "StorageError",
    "Task",
    "TaskError",
    "TrainConfig",
    "Trainer",
    "__version__",
    "diagnose",
    "load_task",
]

# Imported last: the diagnostics build on the Trainer. ``lt.diagnose.HostSyncs`` and friends.
from leantrain import diagnose
