"""leantrain: a PyTorch training engine that is fast, memory-lean, and says why a run is slow."""

from typing import TYPE_CHECKING, Any

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
    SpikeError,
    StorageError,
    TaskError,
)
from leantrain.task import LossSum, Task, load_task

if TYPE_CHECKING:
    from leantrain import diagnose
    from leantrain.checkpoint import load_weights
    from leantrain.data.mixture import Mixture
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
    "Mixture",
    "NonFiniteLossError",
    "RunInterrupted",
    "SpikeError",
    "StepStats",
    "StorageError",
    "Task",
    "TaskError",
    "TrainConfig",
    "Trainer",
    "__version__",
    "diagnose",
    "load_task",
    "load_weights",
]

# The Trainer and the diagnostics (``lt.diagnose.HostSyncs`` and friends) are imported on first
# use: `import leantrain` in a task file, and every `leantrain` command that does not train,
# then costs little more than `import torch`.
_FROM_TRAINER = ("Callback", "FitResult", "StepStats", "Trainer")


def __getattr__(name: str) -> Any:
    # `import x.y as z` binds the submodule without asking this function for it again.
    if name == "diagnose":
        import leantrain.diagnose as diagnose

        return diagnose
    if name == "Mixture":
        from leantrain.data.mixture import Mixture

        return Mixture
    if name == "load_weights":
        from leantrain.checkpoint import load_weights

        return load_weights
    if name in _FROM_TRAINER:
        import leantrain.trainer as trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'leantrain' has no attribute {name!r}")
