"""BatchNorm: the one layer whose math follows the micro-batch split.

Everywhere else the split changes how the work is cut, never the result (``step/accumulator.py``).
A BatchNorm layer in training normalises over the batch it is given: under accumulation that is a
micro-batch, and on several processes each process's share. Its statistics, its running averages
and so the gradients then differ from one forward over the global batch. leantrain cannot make
that exact without changing the layer, so it says so once, with the remedies. One changes the
layer across processes: torch's SyncBatchNorm (``--sync-batchnorm``, ddp or fsdp on CUDA, through
``to_sync_batch_norm``) normalises over every process's micro-batch together; under accumulation
a process's micro-batches still pass one after another, so it cannot join them.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from leantrain.step.batching import BatchSplit

_NAMES_SHOWN = 3


def batch_norm_layers(model: nn.Module) -> dict[str, bool]:
    """``model``'s BatchNorm layers by qualified name: whether each is a SyncBatchNorm."""
    return {
        name or type(module).__name__: isinstance(module, nn.SyncBatchNorm)
        for name, module in model.named_modules()
        if isinstance(module, _BatchNorm)
    }


def to_sync_batch_norm(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """``model`` with every BatchNorm layer a SyncBatchNorm, and the names of those converted.

    torch's conversion keeps the layers' parameters and buffers (the optimizer's parameters stay
    the ones it will update) and changes ``model`` in place, unless ``model`` is itself a BatchNorm.
    It runs anywhere; only a SyncBatchNorm's training forward among several processes needs CUDA.
    """
    converted = [name for name, synced in batch_norm_layers(model).items() if not synced]
    return nn.SyncBatchNorm.convert_sync_batchnorm(model), converted


def split_statistics_warning(layers: dict[str, bool], split: BatchSplit, can_sync: bool = True) -> str | None:
    """Why ``layers`` train otherwise under ``split`` than on the global batch at once, if they do.

    A SyncBatchNorm normalises over every process's micro-batch together: only accumulation
    splits it. ``can_sync``: whether ``--sync-batchnorm`` could apply to the run (ddp or fsdp on
    CUDA), to offer it as a remedy.
    """
    synced_whole = split.accumulation_steps == 1
    names = [name for name, synced in layers.items() if not (synced and synced_whole)]
    if not names or split.micro_batch_size == split.global_batch_size:
        return None
    shown = ", ".join(names[:_NAMES_SHOWN]) + (
        f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    )
    synced = all(layers[name] for name in names)
    if synced and split.world_size > 1:
        where = (
            f"{split.micro_batch_size * split.world_size} samples ({split.micro_batch_size} from each "
            f"of {split.world_size} processes, synchronised)"
        )
    else:
        where = f"{split.micro_batch_size} samples"
        if split.world_size > 1:
            where += f" on each of {split.world_size} processes"
    remedies = []
    if split.accumulation_steps > 1:
        remedies.append(f"no accumulation (micro_batch_size {split.per_rank_batch_size})")
    remedies.append("GroupNorm or LayerNorm in place of BatchNorm")
    if split.world_size > 1 and not synced and can_sync:
        remedies.append("--sync-batchnorm true (ddp or fsdp, on CUDA)")
    return (
        f"{len(names)} BatchNorm layer(s) ({shown}) normalise each micro-batch of {where}, not the "
        f"global batch of {split.global_batch_size}: their statistics, and so the gradients, follow the "
        "split (the one place it changes the math). Remedies: " + "; ".join(remedies)
    )
