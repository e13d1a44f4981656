"""Llama 3.1 tasks at their published sizes, for ``leantrain plan --cluster`` (never trained here).

The model is transformers' ``LlamaForCausalLM`` built from the published configs (no weights are
downloaded: ``plan --cluster`` builds it on fake tensors); the data is token ids of ``seq_len`` drawn
from a seeded generator, one item at a time (the plan reads one micro-batch's shapes); the loss is
torchtitan's: cross-entropy over every position, on float32 logits. The optimizer is AdamW, as theirs.

``leantrain plan --task benchmarks.llama_tasks:Llama31_8B --cluster 8xH100 --strategy fsdp
--global-batch-size 8 --micro-batch-size 1 --precision bf16-mixed``
"""

from __future__ import annotations

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


class Llama31Task:
    def __init__(self, size: str = "8b", seq_len: int = 8192, lr: float = 3e-4) -> None:
        if size not in CONFIGS:
            raise ValueError(f"size must be one of {', '.join(CONFIGS)}, not {size!r}")
        self.size, self.seq_len, self.lr = size, seq_len, lr

    def model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=max(self.seq_len, 8192), rope_theta=500000.0,
            tie_word_embeddings=False, attn_implementation="sdpa", **CONFIGS[self.size],
        )  # fmt: skip
        return LlamaForCausalLM(config)

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
