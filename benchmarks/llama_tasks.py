"""Llama 3.1 tasks at their published sizes, for ``leantrain plan --cluster`` (never trained here).

The model is transformers' ``LlamaForCausalLM`` built from the published configs (no weights are
downloaded: ``plan --cluster`` builds it on fake tensors); the data is token ids of ``seq_len`` drawn
from a seeded generator, one item at a time (the plan reads one micro-batch's shapes); the loss is
torchtitan's: cross-entropy over every position, on float32 logits. The optimizer is AdamW, as theirs.

``leantrain plan --task benchmarks.llama_tasks:Llama31_8B --cluster 8xH100 --strategy fsdp
--global-batch-size 8 --micro-batch-size 1 --precision bf16-mixed``

``Llama31_8B_torchtitan_op`` (and ``_70B_``) checkpoint each decoder layer inside ``model()`` with
torchtitan's own ``op`` policy (``torchtitan/parallelisms/parallelize_llama.py`` at ``9dec370``): the
outputs of ``mm``, the fused attention kernels, ``reduce_scatter_tensor``, ``abs`` and ``max`` kept,
**except every second ``mm``** of a layer's forward (of q, k, v, o, gate, up, down: k, o and up are
recomputed), the rest recomputed. leantrain's ``--activation-checkpointing selective`` keeps every
product: these tasks are planned without ``--activation-checkpointing``, to compare with torchtitan's
published rows like for like. On the fake CPU the fused attention is
``_scaled_dot_product_flash_attention_for_cpu``, kept as torchtitan keeps the CUDA flash kernel's output.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

# Meta's published configs (config.json of meta-llama/Llama-3.1-8B and -70B), the fields that set shapes.
CONFIGS = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}  # fmt: skip
VOCAB = 128256


class RandomTokens(Dataset):
    """``length`` items of ``seq_len + 1`` token ids, each drawn from a generator seeded by its index."""

    def __init__(self, seq_len: int, length: int = 1 << 20) -> None:
        self.seq_len, self.length = seq_len, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(index)
        return torch.randint(0, VOCAB, (self.seq_len + 1,), generator=generator)


def _torchtitan_saved_ops() -> frozenset[Any]:
    """torchtitan's ``_save_list`` at 9dec370, plus the CPU flash kernel the fake step runs instead."""
    aten = torch.ops.aten
    names = ("mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "abs", "max")  # fmt: skip
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    return frozenset(ops | {torch.ops._c10d_functional.reduce_scatter_tensor.default})


def _torchtitan_op_context() -> Any:
    """One layer's forward (and its recompute): torchtitan's ``_get_custom_policy``, mm counted per pass."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from leantrain.memory.accountant import count_held_for_backward

    saved, meta = _torchtitan_saved_ops(), defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        if func in saved and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0):
            # The accountant counts what checkpoint's cache holds, as for leantrain's own policy.
            if not ctx.is_recompute:
                for tensor in torch.utils._pytree.tree_leaves(getattr(ctx, "op_output", None)):
                    if isinstance(tensor, torch.Tensor):
                        count_held_for_backward(tensor)
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _TorchtitanOp:
    """A decoder layer's forward under non-reentrant checkpointing with torchtitan's op policy
    (``ptd_checkpoint_wrapper(preserve_rng_state=False)``), applied before FSDP as torchtitan does."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.forward = layer, layer.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.layer.training:
            return self.forward(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        kwargs = {k: None if k in ("cache", "past_key_values") else v for k, v in kwargs.items()}
        return checkpoint(
            self.forward, *args, use_reentrant=False, context_fn=_torchtitan_op_context,
            preserve_rng_state=False, **kwargs,
        )  # fmt: skip


class Llama31Task:
    def __init__(
        self, size: str = "8b", seq_len: int = 8192, lr: float = 3e-4, checkpoint: str | None = None
    ) -> None:
        if size not in CONFIGS:
            raise ValueError(f"size must be one of {', '.join(CONFIGS)}, not {size!r}")
        if checkpoint not in (None, "torchtitan-op"):
            raise ValueError(f"checkpoint must be None or 'torchtitan-op', not {checkpoint!r}")
        self.size, self.seq_len, self.lr, self.checkpoint = size, seq_len, lr, checkpoint

    def model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=max(self.seq_len, 8192), rope_theta=500000.0,
            tie_word_embeddings=False, attn_implementation="sdpa", **CONFIGS[self.size],
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        if self.checkpoint == "torchtitan-op":
            for layer in model.model.layers:
                layer.forward = _TorchtitanOp(layer)
        return model

    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        """torchtitan's tensor-parallel plan (``apply_tp`` at 9dec370) in leantrain's styles: the embedding
        split by vocabulary; sequence parallelism from the first block's input to the head (the norms and
        the residual stream on each rank's share of the positions); attention's and the MLP's inputs
        gathered whole (torchtitan's ``PrepareModuleInput``), q/k/v and gate/up split by output, o and down
        split by input and reduce-scattered back into the positions; the head split by vocabulary (its loss
        on the split logits: ``--loss-parallel``, leantrain's default). transformers' own plan has no
        sequence parallelism: each rank would keep every block's whole input."""
        layers = "model.layers.*"
        return {
            "model.embed_tokens": "embedding_rowwise",
            "model.layers.0": "sequence_split",
            f"{layers}.input_layernorm": "sequence_parallel",
            f"{layers}.self_attn": "sequence_gather",
            **{f"{layers}.self_attn.{name}_proj": "colwise" for name in ("q", "k", "v")},
            f"{layers}.self_attn.o_proj": "sequence_rowwise",
            f"{layers}.post_attention_layernorm": "sequence_parallel",
            f"{layers}.mlp": "sequence_gather",
            **{f"{layers}.mlp.{name}_proj": "colwise" for name in ("gate", "up")},
            f"{layers}.mlp.down_proj": "sequence_rowwise",
            "model.norm": "sequence_parallel",
            "lm_head": "sequence_colwise",
        }

    def train_data(self) -> Dataset:
        return RandomTokens(self.seq_len)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.1, fused=False)


def Llama31_8B(**options: Any) -> Llama31Task:  # a task name on the command line
    return Llama31Task("8b", **options)


def Llama31_70B(**options: Any) -> Llama31Task:
    return Llama31Task("70b", **options)


def Llama31_8B_torchtitan_op(**options: Any) -> Llama31Task:  # torchtitan's selective op policy
    return Llama31Task("8b", checkpoint="torchtitan-op", **options)


def Llama31_70B_torchtitan_op(**options: Any) -> Llama31Task:
    return Llama31Task("70b", checkpoint="torchtitan-op", **options)
