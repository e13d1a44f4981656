"""``--sync-batchnorm``: BatchNorm statistics over every process's micro-batch (ddp and fsdp, on CUDA).

torch's SyncBatchNorm gathers each layer's batch statistics from all processes in forward, so
the layer normalises over their micro-batches together, as one process would over their union
(see ``step/batch_norm.py`` for why that matters). It needs processes that each run the whole
model on a share of the batch, which is what the strategies that mix ``SyncsBatchNorm`` in do,
and it runs on CUDA only.

Checked before the run starts: ``check_sync_batch_norm`` (by ``check_config``) refuses another
strategy and a configured device that is not CUDA; ``auto`` becomes a device only in each
process (a SLURM job is submitted from a machine without GPUs), where ``input_device`` checks it.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from leantrain.config import TrainConfig
from leantrain.errors import ConfigError, LeantrainWarning
from leantrain.step.batch_norm import to_sync_batch_norm
from leantrain.strategies.base import Strategy

_INSTEAD = (
    "use ddp or fsdp on several CUDA devices (leantrain launch --nproc-per-node N fit ...), or set it false"
)


class SyncsBatchNorm(Strategy):
    """Mixed into the strategies whose processes each run the whole model on their share of the
    batch: there, ``sync_batchnorm`` converts the model's BatchNorm layers before ``wrap`` wraps it."""

    @classmethod
    def can_sync_batch_norm(cls, device: torch.device) -> bool:
        return device.type == "cuda"

    @classmethod
    def input_device(cls, cfg: TrainConfig, device: torch.device) -> torch.device:
        if cfg.sync_batchnorm:
            _refuse_off_cuda(device, cfg.device)
        return super().input_device(cfg, device)

    def with_synced_batch_norm(self, model: nn.Module) -> nn.Module:
        """``model`` with SyncBatchNorm layers when the config asks for them. Call it before wrapping:
        the wrappers take the modules as they find them (``fully_shard`` shards their parameters)."""
        if not self.cfg.sync_batchnorm:
            return model
        model, converted = to_sync_batch_norm(model)
        if converted:
            self.notes.append(
                f"sync_batchnorm: {len(converted)} BatchNorm layer(s) converted to SyncBatchNorm"
            )
        elif not dist.is_initialized() or dist.get_rank() == 0:  # as the run's own warnings: rank 0
            warnings.warn(
                "sync_batchnorm is true but the model has no BatchNorm layer to convert: nothing changes",
                LeantrainWarning,
                stacklevel=2,
            )
        return model


def check_sync_batch_norm(cfg: TrainConfig, strategy: type[Strategy] | None) -> None:
    """A ConfigError when ``sync_batchnorm`` cannot apply (``strategy``: None while not yet known)."""
    if not cfg.sync_batchnorm:
        return
    if cfg.device != "auto":
        _refuse_off_cuda(torch.device(cfg.device), cfg.device)
    if strategy is None or issubclass(strategy, SyncsBatchNorm):
        return
    if strategy.multi_process:
        why = "does not run the whole model in each process, as SyncBatchNorm needs"
    else:
        why = "runs one process, with no other process's micro-batch to share BatchNorm statistics with"
    raise ConfigError("sync_batchnorm", True, f"strategy {strategy.name} {why}; {_INSTEAD}")


def _refuse_off_cuda(device: torch.device, configured: str) -> None:
    if SyncsBatchNorm.can_sync_batch_norm(device):
        return
    found = " (device auto found no CUDA device)" if configured == "auto" else ""
    raise ConfigError(
        "sync_batchnorm",
        True,
        f"torch's SyncBatchNorm runs on CUDA only, not on {device.type}{found}; run on CUDA devices, or set "
        "it false (each process's BatchNorm layers then normalise its own micro-batch)",
    )
