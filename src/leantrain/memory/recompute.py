"""Activation checkpointing (recomputation): keep a block's input, recompute its inside in backward.

A checkpointed block saves only its input for backward; the activations inside it are
recomputed during backward from that input. Saved-activation memory then scales with the
number of blocks instead of the number of layers inside them, for about one extra forward
of the checkpointed blocks.

``--activation-checkpointing`` takes a block policy (see ``blocks.py``): class names,
``every:N``, ``first:N``, or ``auto`` (the fewest of the repeated blocks that let the
micro-batch fit the memory budget, see ``estimate.fewest_checkpointed_blocks``).

``selective`` checkpoints the picked blocks op by op (torchtitan's ``op`` policy, through
``create_selective_checkpoint_contexts``): the outputs of their matrix products (``mm``,
``addmm``, ``bmm``, ``baddbmm``, the fused attention kernels) and of their collectives are kept,
everything else (norms, activations, dropout, softmax, views) is recomputed: backward redoes a
block's elementwise work, not its matrix products, and no collective (a second one would cost
communication, and hang if ranks recomputed different ones). Every product is kept, not every
second one as torchtitan does: that trades about half the products' bytes for recomputing half
the products, which ``Block,every:2`` already offers at block granularity, and "products kept,
the rest recomputed" stays one rule to reason about. The kept outputs live in checkpoint's own cache, which
autograd's saved-tensor hooks never see: the policy reports them to the accountant.

Recomputation uses ``torch.utils.checkpoint`` in its non-reentrant form, which supports
keyword arguments, composes with autocast and DDP, and restores the RNG state before
recomputing, so dropout masks are the same in both passes.

A block that appends to a key/value cache (transformers' decoder layers, whose models fill
one in training too while ``use_cache`` is on) would append again when it is recomputed: the
cache is not passed to a recomputed block while it trains (what transformers' own switch
does), unless its class declares that it only reads the cache.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from leantrain.blocks import BlockPolicy, matching_blocks
from leantrain.errors import ConfigError
from leantrain.memory.accountant import count_held_for_backward

# Functional collectives (DTensor's, tensor parallelism's): recomputing one is communication spent
# twice, and a hang when ranks recompute different ones.
_COLLECTIVES = frozenset({"_c10d_functional", "_c10d_functional_autograd"})


class _KeepMatmuls:
    """Selective checkpointing's policy: keep matrix products and collectives, recompute the rest. The
    products' op packets are looked up with each checkpointed module (not at import, where the mutation
    check cannot reach: tests/MUTATION.md)."""

    def __init__(self) -> None:
        # The matrix products kept, by name: those this torch has.
        names = (
            "mm",
            "addmm",
            "bmm",
            "baddbmm",
            "_scaled_mm",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_fused_attention_overrideable",
            # Composite (decomposed before dispatch) in the torch this was written on; kept if one is not.
            "_scaled_dot_product_attention_math",
        )
        aten = torch.ops.aten
        self.kept = frozenset(getattr(aten, name) for name in names if hasattr(aten, name))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        kept = getattr(op, "overloadpacket", None) in self.kept
        if not (kept or getattr(op, "namespace", None) in _COLLECTIVES):
            return CheckpointPolicy.PREFER_RECOMPUTE
        for tensor in tree_leaves(getattr(ctx, "op_output", None)):
            if isinstance(tensor, torch.Tensor):
                count_held_for_backward(tensor)
        return CheckpointPolicy.MUST_SAVE


class _Recomputed:
    """A module's forward, run under non-reentrant checkpointing while the module trains."""

    def __init__(self, module: nn.Module, selective: bool = False) -> None:
        self.module = module
        self.forward = module.forward
        self.context: dict[str, Any] = {}  # checkpoint's default unless selective
        if selective:  # keep the products, recompute the rest
            self.context["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, _KeepMatmuls()
            )
        # The arguments a recomputed forward is not given (looked up once, not per call).
        self.cache = None if getattr(module, "_can_checkpoint_with_cache", False) else _cache_class()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.module.training:  # evaluation keeps no activations: nothing to save
            return self.forward(*args, **kwargs)
        cache = self.cache
        if cache is not None:
            args = tuple(None if isinstance(a, cache) else a for a in args)
            kwargs = {k: None if isinstance(v, cache) else v for k, v in kwargs.items()}
        return checkpoint(self.forward, *args, use_reentrant=False, **self.context, **kwargs)


def _checkpoints_itself(model: nn.Module) -> bool:
    """Whether transformers' own switch (``gradient_checkpointing_enable``) is on in this model."""
    # transformers 5 renamed the property (the old name warns); asking the class does not call it.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _cache_class() -> type | None:
    """transformers' key/value cache base class, if transformers is in use (never imported here)."""
    return getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)


def apply_activation_checkpointing(model: nn.Module, policy: BlockPolicy) -> list[str]:
    """Checkpoint the blocks the policy names (before any wrapper); returns their names."""
    if policy.auto:
        raise ValueError("resolve an auto policy first (estimate.fewest_checkpointed_blocks)")
    if _checkpoints_itself(model):
        raise ConfigError(
            policy.field,
            ",".join(policy.classes) or f"every:{policy.every}",
            "the model checkpoints its own layers already (gradient_checkpointing_enable() in "
            "task.model()): recomputing them twice costs a second forward; use one of the two",
        )
    blocks = matching_blocks(model, policy)
    for _, module in blocks:
        module.forward = _Recomputed(module, policy.selective)  # type: ignore[method-assign]
    return [name for name, _ in blocks]


def cache_note(model: nn.Module) -> str | None:
    """The run log's line when the model would fill a key/value cache in training (transformers'
    ``config.use_cache``, on by default) that its recomputed blocks leave empty."""
    if not getattr(getattr(model, "config", None), "use_cache", False):
        return None
    return (
        f"activation checkpointing: {type(model).__name__}'s key/value cache (config.use_cache) is not "
        "filled by recomputed blocks in training: recomputing them would fill it twice"
    )
