"""``charlm``: a small GPT-style character model on text that ships with Python.

The text is ``pydoc_data.topics`` (the help topics of the Python docs, about 460 K
characters). The loss is token-level: a :class:`~leantrain.task.LossSum` of the
cross-entropy over every predicted character and the number of characters.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from leantrain.task import LossSum


@cache
def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class CharChunks(Dataset):
    """Item ``i``: ``block`` characters from offset ``i * block`` and the same shifted by one."""

    def __init__(self, codes: torch.Tensor, block: int) -> None:
        self.codes = codes
        self.block = block

    def __len__(self) -> int:
        return (len(self.codes) - 1) // self.block

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} chunks")
        start = index * self.block
        chunk = self.codes[start : start + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.mlp(self.norm2(x)))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, heads: int, width: int, dropout: float) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.token.weight  # tied input and output embeddings
        # Small embeddings (GPT-2's 0.02): with nn.Embedding's N(0, 1), the tied head's first
        # logits are ~sqrt(width) large and the first loss is ~30 instead of ~log(vocab).
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(codes.shape[1], device=codes.device)
        x = self.token(codes) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CharLMTask:
    """Next-character prediction; the last 10% of the text is the validation set."""

    def __init__(
        self,
        block: int = 64,
        layers: int = 4,
        heads: int = 4,
        width: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        max_chars: int | None = None,
    ) -> None:
        self.block, self.layers, self.heads, self.width = block, layers, heads, width
        self.dropout, self.lr = dropout, lr
        text = corpus()[:max_chars]
        self.alphabet = sorted(set(corpus()))
        lookup = {char: code for code, char in enumerate(self.alphabet)}
        self.codes = torch.tensor([lookup[char] for char in text], dtype=torch.long)
        self.split_at = int(len(self.codes) * 0.9)

    def model(self) -> nn.Module:
        return CharGPT(len(self.alphabet), self.block, self.layers, self.heads, self.width, self.dropout)

    def train_data(self) -> Dataset:
        return CharChunks(self.codes[: self.split_at], self.block)

    def val_data(self) -> Dataset:
        return CharChunks(self.codes[self.split_at :], self.block)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
        inputs, targets = batch
        logits = model(inputs)
        total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        return LossSum(total, targets.numel())

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
