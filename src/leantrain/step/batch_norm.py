"""BatchNorm: the one layer whose math follows the micro-batch split.

Everywhere else the split changes how the work is cut, never the result (``step/accumulator.py``).
A BatchNorm layer in training normalises over the batch it is given: under accumulation that is a
micro-batch, and on several processes each process's share. Its statistics, its running averages
and so the gradients then differ from one forward over the global batch. leantrain cannot make
that exact without changing the layer, so it says so once, with the remedies.
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


def split_statistics_warning(layers: dict[str, bool], split: BatchSplit) -> str | None:
    """Why ``layers`` train otherwise under ``split`` than on the global batch at once, if they do.

    A SyncBatchNorm normalises over every process's micro-batch: only accumulation splits it.
    """
    synced_whole = split.accumulation_steps == 1
    names = [name for name, synced in layers.items() if not (synced and synced_whole)]
    if not names or split.micro_batch_size == split.global_batch_size:
        return None
    shown = ", ".join(names[:_NAMES_SHOWN]) + (
        f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    )
    where = f"{split.micro_batch_size} samples"
    if split.world_size > 1:
        where += f" on each of {split.world_size} processes"
    remedies = []
    if split.accumulation_steps > 1:
        remedies.append(f"no accumulation (micro_batch_size {split.per_rank_batch_size})")
    remedies.append("GroupNorm or LayerNorm in place of BatchNorm")
    if split.world_size > 1 and not all(layers[name] for name in names):
        remedies.append("torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) in task.model() (CUDA only)")
    return (
        f"{len(names)} BatchNorm layer(s) ({shown}) normalise each micro-batch of {where}, not the "
        f"global batch of {split.global_batch_size}: their statistics, and so the gradients, follow the "
        "split (the one place it changes the math). Remedies: " + "; ".join(remedies)
    )
