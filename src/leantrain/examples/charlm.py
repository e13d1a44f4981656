"""``charlm``: a small GPT-style character model on text that ships with Python.

The text is ``pydoc_data.topics`` (the help topics of the Python docs, about 460 K
characters). The loss is token-level: a :class:`~leantrain.task.LossSum` of the
cross-entropy over every predicted character and the number of characters.

``layout`` chooses the training items: ``chunks`` (the default: ``block`` characters and the same
shifted by one), ``documents`` (the text's paragraphs, each cut to at most ``block`` characters, as
1-D tensors: the token documents that ``--pack-length`` packs, at most ``block``) or ``padded`` (the
same documents padded to ``block``: ``input_ids``, ``labels`` with -100 at the padding, and
``attention_mask``; what training on documents costs without packing). A packed batch's
``position_ids`` and ``document_ids`` reach the model, whose attention then stays inside each document
(``document_attention``).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from leantrain.data.document_attention import document_attention
from leantrain.data.packing import IGNORE_INDEX
from leantrain.errors import TaskError
from leantrain.task import LossSum

LAYOUTS = ("chunks", "documents", "padded")


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


def at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the loss: 16-bit ones in float32 (an exact softmax sum), float64 ones kept."""
    return logits if logits.dtype == torch.float64 else logits.float()


def paragraphs(codes: torch.Tensor, break_code: int, longest: int) -> list[torch.Tensor]:
    """The text's paragraphs (split at blank lines), each cut into pieces of at most ``longest`` codes."""
    breaks = ((codes[:-1] == break_code) & (codes[1:] == break_code)).nonzero().flatten().tolist()
    documents = []
    for start, stop in zip([0, *(at + 2 for at in breaks)], [*breaks, len(codes)], strict=True):
        documents += [piece for piece in codes[start:stop].split(longest) if len(piece) > 1]
    return documents


class Documents(Dataset):
    """Token documents: item ``i`` is document ``i``, or (``pad_to``) a dict of it padded to ``pad_to``."""

    def __init__(self, documents: list[torch.Tensor], pad_to: int | None = None) -> None:
        self.documents, self.pad_to = documents, pad_to

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> torch.Tensor | dict[str, torch.Tensor]:
        document = self.documents[index]
        if self.pad_to is None:
            return document
        padding = self.pad_to - len(document)
        labels = torch.cat([document[1:], document.new_full((padding + 1,), IGNORE_INDEX)])
        return {
            "input_ids": F.pad(document, (0, padding)),
            "labels": labels,
            "attention_mask": F.pad(torch.ones_like(document), (0, padding)),
        }


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.head_width = heads, width // heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(width)
        # Each head's query, key and value rows side by side: a split of the rows by rank (--tp)
        # then holds whole heads.
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        # Under --tp, x holds this rank's share of the positions (sequence parallelism) and qkv all
        # of them, for this rank's heads (-1): the shapes are qkv's.
        qkv = self.qkv(self.norm1(x))
        batch, length = qkv.shape[:2]
        qkv = qkv.view(batch, length, -1, 3, self.head_width)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        dropout = self.dropout if self.training else 0.0
        if document_ids is None:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:  # a packed row: each document attends only to itself
            attended = document_attention(q, k, v, document_ids, dropout)
        x = x + self.drop(self.proj(attended.transpose(1, 2).flatten(2)))
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

    def forward(
        self,
        codes: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        positions = (
            torch.arange(codes.shape[1], device=codes.device) if position_ids is None else position_ids
        )
        x = self.token(codes) + self.position(positions)
        for block in self.blocks:
            x = block(x, document_ids)
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
        layout: str = "chunks",
    ) -> None:
        if layout not in LAYOUTS:
            raise TaskError(f"charlm: unknown layout {layout!r}; available: {', '.join(LAYOUTS)}")
        self.block, self.layers, self.heads, self.width = block, layers, heads, width
        self.layout = layout
        self.dropout, self.lr = dropout, lr
        text = corpus()[:max_chars]
        self.alphabet = sorted(set(corpus()))
        lookup = {char: code for code, char in enumerate(self.alphabet)}
        self.codes = torch.tensor([lookup[char] for char in text], dtype=torch.long)
        self.split_at = int(len(self.codes) * 0.9)

    def model(self) -> nn.Module:
        return CharGPT(len(self.alphabet), self.block, self.layers, self.heads, self.width, self.dropout)

    def _data(self, codes: torch.Tensor) -> Dataset:
        if self.layout == "chunks":
            return CharChunks(codes, self.block)
        documents = paragraphs(codes, self.alphabet.index("\n"), self.block)
        return Documents(documents, self.block if self.layout == "padded" else None)

    def train_data(self) -> Dataset:
        return self._data(self.codes[: self.split_at])

    def val_data(self) -> Dataset:
        return self._data(self.codes[self.split_at :])

    def loss(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]
    ) -> LossSum:
        if isinstance(batch, dict):  # documents: padded, or packed rows (position_ids, document_ids)
            inputs, targets = batch["input_ids"], batch["labels"]
            logits = model(inputs, batch.get("position_ids"), batch.get("document_ids"))
            count: torch.Tensor | int = (targets != IGNORE_INDEX).sum()
        else:
            inputs, targets = batch
            logits = model(inputs)
            count = targets.numel()
        total = F.cross_entropy(at_least_float32(logits.flatten(0, 1)), targets.flatten(), reduction="sum")
        return LossSum(total, count)

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)

    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        """How ``--tp`` splits CharGPT: in each block, attention's qkv and the MLP's first layer by
        output (each rank computes its heads and its hidden units), the layers after them by input.
        Between them (sequence parallelism, unless --sequence-parallel false) each rank holds its
        share of the positions: from the first block's input to the head's, the norms run on it,
        qkv and mlp.0 gather it, proj and mlp.2 reduce-scatter into it. The tied embedding and
        head stay whole: a vocabulary of ~100 characters is little to split, and rarely divides."""
        return {
            "blocks.0": "sequence_split",
            "blocks.*.norm1": "sequence_parallel",
            "blocks.*.qkv": "sequence_colwise",
            "blocks.*.proj": "sequence_rowwise",
            "blocks.*.norm2": "sequence_parallel",
            "blocks.*.mlp.0": "sequence_colwise",
            "blocks.*.mlp.2": "sequence_rowwise",
            "norm": "sequence_parallel",
            "head": "sequence_gather",
        }
