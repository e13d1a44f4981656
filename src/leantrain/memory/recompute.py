"""Activation checkpointing (recomputation): keep a block's input, recompute its inside in backward.

A checkpointed block saves only its input for backward; the activations inside it are
recomputed during backward from that input. Saved-activation memory then scales with the
number of blocks instead of the number of layers inside them, for about one extra forward
of the checkpointed blocks.

``--activation-checkpointing`` takes a block policy (see ``blocks.py``): class names,
``every:N``, ``first:N``, or ``auto`` (the fewest of the repeated blocks that let the
micro-batch fit the memory budget, see ``estimate.fewest_checkpointed_blocks``).

Recomputation uses ``torch.utils.checkpoint`` in its non-reentrant form, which supports
keyword arguments, composes with autocast and DDP, and restores the RNG state before
recomputing, so dropout masks are the same in both passes.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from leantrain.blocks import BlockPolicy, matching_blocks


class _Recomputed:
    """A module's forward, run under non-reentrant checkpointing while the module trains."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.forward = module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.module.training:  # evaluation keeps no activations: nothing to save
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, policy: BlockPolicy) -> list[str]:
    """Checkpoint the blocks the policy names (before any wrapper); returns their names."""
    if policy.auto:
        raise ValueError("resolve an auto policy first (estimate.fewest_checkpointed_blocks)")
    blocks = matching_blocks(model, policy)
    for _, module in blocks:
        module.forward = _Recomputed(module)  # type: ignore[method-assign]
    return [name for name, _ in blocks]
