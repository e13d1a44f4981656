"""``hf-gpt2``: a Hugging Face transformers language model fed by a Hugging Face ``datasets`` table.

What a transformers user brings to leantrain, in one file: a ``GPT2LMHeadModel`` (or, with
``architecture="llama"``, a ``LlamaForCausalLM``) built from a small config (no download),
learning the bytes of Python's help text (``pydoc_data.topics``, the ``charlm`` example's
corpus); the data is a ``datasets.Dataset`` of dict rows in torch format, which leantrain's
default collation stacks into a dict of tensors. The loss is token-level: a
:class:`~leantrain.task.LossSum` of the cross-entropy over every predicted byte. With
``--pack-length``, a packed batch goes through ``transformers_inputs`` (position ids and a mask
that keeps each document to itself), and the loss counts the labels that are not -100.

Needs ``pip install 'leantrain[hf]'`` (transformers and datasets); without them, the task
is a one-line error naming that extra.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.data.document_attention import transformers_inputs
from leantrain.data.packing import IGNORE_INDEX
from leantrain.errors import TaskError
from leantrain.examples.charlm import at_least_float32, corpus
from leantrain.task import LossSum

ARCHITECTURES = ("gpt2", "llama")
VOCAB = 256  # bytes


def require_hf(what: str) -> None:
    """TaskError naming the extra unless transformers and datasets can be imported."""
    missing = [name for name in ("transformers", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        raise TaskError(f"{what} needs {' and '.join(missing)}: pip install 'leantrain[hf]'")


@cache
def corpus_bytes() -> torch.Tensor:
    return torch.frombuffer(bytearray(corpus().encode()), dtype=torch.uint8).long()


def byte_rows(codes: torch.Tensor, block: int) -> Any:
    """A ``datasets.Dataset``: row ``i`` holds ``block`` bytes from ``i * block`` (``input_ids``)
    and the same shifted by one (``labels``), as torch tensors."""
    from datasets import Dataset

    rows = (len(codes) - 1) // block
    inputs = codes[: rows * block].view(rows, block)
    labels = codes[1 : rows * block + 1].view(rows, block)
    return Dataset.from_dict({"input_ids": inputs.numpy(), "labels": labels.numpy()}).with_format("torch")


def _causal_lm(
    architecture: str, block: int, layers: int, heads: int, width: int, dropout: float
) -> nn.Module:
    """A freshly initialised transformers causal language model over bytes (``architecture`` checked)."""
    if architecture == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=block, n_embd=width, n_layer=layers, n_head=heads,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=block,
        attention_dropout=dropout, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class HFCausalLMTask:
    """Next-byte prediction with a transformers model; the last 10% of the text is the validation set."""

    def __init__(
        self,
        architecture: str = "gpt2",
        block: int = 64,
        layers: int = 4,
        heads: int = 4,
        width: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        max_chars: int | None = None,
    ) -> None:
        require_hf(f"the {architecture} example task")
        if architecture not in ARCHITECTURES:
            raise TaskError(f"unknown architecture {architecture!r}; available: {', '.join(ARCHITECTURES)}")
        self.architecture, self.block, self.layers, self.heads = architecture, block, layers, heads
        self.width, self.dropout, self.lr = width, dropout, lr
        self.codes = corpus_bytes()[:max_chars]
        self.split_at = int(len(self.codes) * 0.9)

    def model(self) -> nn.Module:
        return _causal_lm(self.architecture, self.block, self.layers, self.heads, self.width, self.dropout)

    def train_data(self) -> Any:
        return byte_rows(self.codes[: self.split_at], self.block)

    def val_data(self) -> Any:
        return byte_rows(self.codes[self.split_at :], self.block)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
        labels = batch["labels"]
        if "document_ids" in batch:  # packed rows
            logits = model(**transformers_inputs(model, batch)).logits
            count: torch.Tensor | int = (labels != IGNORE_INDEX).sum()
        else:
            logits = model(input_ids=batch["input_ids"]).logits
            count = labels.numel()
        total = F.cross_entropy(at_least_float32(logits.flatten(0, 1)), labels.flatten(), reduction="sum")
        return LossSum(total, count)

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
