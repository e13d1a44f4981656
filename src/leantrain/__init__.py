"""leantrain: a PyTorch training engine that is fast, memory-lean, and says why a run is slow."""

from leantrain.config import TrainConfig
from leantrain.errors import ConfigError, DataError, LeantrainError, NonFiniteLossError, TaskError
from leantrain.task import LossSum, Task, load_task
from leantrain.trainer import Callback, FitResult, StepStats, Trainer

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "ConfigError",
    "DataError",
    "FitResult",
    "LeantrainError",
    "LossSum",
    "NonFiniteLossError",
    "StepStats",
    "Task",
    "TaskError",
    "TrainConfig",
    "Trainer",
    "__version__",
    "load_task",
]
