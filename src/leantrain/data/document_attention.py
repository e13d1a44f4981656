"""Attention that never crosses a document, for the packed rows of ``--pack-length`` (``packing.py``).

A packed row holds several documents (segments) side by side; ``document_ids`` numbers them and
``position_ids`` restarts at each. What each attention kind is given:

- **a model of one's own** (the ``charlm`` example): :func:`document_attention` in place of
  ``scaled_dot_product_attention(..., is_causal=True)``: ``flex_attention`` with a document block
  mask on CUDA (blocks of other documents are skipped, not computed), SDPA with the boolean
  block-diagonal causal mask of :func:`document_mask` elsewhere and whenever attention dropout is on
  (flex_attention has none);
- **transformers models**: :func:`transformers_inputs` gives the model's keyword arguments:
  ``position_ids`` (rotary/learned positions restart per document) and, by attention
  implementation, nothing more for ``flash_attention_*`` (their variable-length kernels cut at
  each position 0), a 4D boolean mask for ``sdpa``, a 4D additive float mask for ``eager``, and a
  ``BlockMask`` for ``flex_attention``. transformers uses a 4D mask as it is. A model whose
  ``forward`` takes neither ``position_ids`` nor ``attention_mask`` is a one-line TaskError.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.errors import TaskError


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[rows, 1, N, N]`` booleans: query i may attend key j when both are in one document and j <= i."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    length = document_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)


def _flex_block_mask(document_ids: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(batch: Any, head: Any, query: Any, key: Any) -> Any:
        return (document_ids[batch, query] == document_ids[batch, key]) & (key <= query)

    rows, length = document_ids.shape
    return create_block_mask(same_document, rows, None, length, length, device=document_ids.device)


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention within each document of a packed row (``q, k, v``: ``[rows, heads, N, dim]``)."""
    if q.device.type == "cuda" and dropout_p == 0.0:
        return flex_document_attention(q, k, v, document_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(document_ids), dropout_p=dropout_p)


def flex_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor
) -> torch.Tensor:
    """:func:`document_attention` by ``flex_attention``: the blocks of other documents are skipped. What
    CUDA runs; the CPU runs it too, uncompiled and slowly (for tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=_flex_block_mask(document_ids))  # type: ignore[return-value]


def _inner_model(model: nn.Module) -> nn.Module:
    """The transformers model inside the wrappers a run may put around it (DDP, DataParallel, peft)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module  # type: ignore[assignment]
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def transformers_inputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The keyword arguments that run a packed batch through a transformers ``model`` with each
    document attending only to itself: ``input_ids``, ``position_ids`` and, but for flash
    attention, a 4D ``attention_mask``. The batch's ``labels`` are not passed (the task's loss
    reads them: they are already per position, and transformers would shift them again)."""
    inner = _inner_model(model)
    accepted = inspect.signature(inner.forward).parameters
    if "position_ids" not in accepted or "attention_mask" not in accepted:
        raise TaskError(
            f"pack_length: {type(inner).__name__}.forward takes no position_ids or no attention_mask, so its "
            "documents would attend to each other: train it without pack_length"
        )
    inputs: dict[str, Any] = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    kind = getattr(getattr(inner, "config", None), "_attn_implementation", None) or "sdpa"
    if kind.startswith("flash_attention"):
        return inputs
    document_ids = batch["document_ids"]
    if kind == "flex_attention":
        inputs["attention_mask"] = _flex_block_mask(document_ids)
    elif kind == "eager":
        dtype = next(inner.parameters()).dtype
        allowed = document_mask(document_ids)
        inputs["attention_mask"] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    else:
        inputs["attention_mask"] = document_mask(document_ids)
    return inputs
