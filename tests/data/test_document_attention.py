"""The attention masks of packed documents: what each attention kind of a transformers model is given,
and the flex_attention block mask (what CUDA runs for charlm's attention, and what a transformers model
with ``attn_implementation="flex_attention"`` gets). flex_attention runs on the CPU too, uncompiled: slow,
but the same mask, so its mask is checked here against SDPA's boolean one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from leantrain.data.document_attention import (
    _flex_block_mask,
    document_attention,
    document_mask,
    flex_document_attention,
    transformers_inputs,
)
from leantrain.errors import TaskError

# The rows hold different documents: a mask made for one row only (or for none) gives another answer.
# 144 positions: more than one of flex_attention's 128-position blocks, so a whole block is skipped.
DOCUMENT_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4] * 9, [0] * 80 + [1] * 64])


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_the_flex_block_mask_lets_each_position_attend_to_its_own_document_up_to_itself():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, DOCUMENT_IDS.shape[1], 8) for _ in range(3))
    block_mask = _flex_block_mask(DOCUMENT_IDS)
    assert block_mask.shape == (2, 1, DOCUMENT_IDS.shape[1], DOCUMENT_IDS.shape[1])
    flex = flex_document_attention(q, k, v, DOCUMENT_IDS)  # what CUDA runs
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(DOCUMENT_IDS))
    torch.testing.assert_close(flex, masked, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        document_attention(q, k, v, DOCUMENT_IDS), masked, rtol=0, atol=0
    )  # no dropout
    torch.manual_seed(1)
    dropped = document_attention(q, k, v, DOCUMENT_IDS, dropout_p=0.5)  # SDPA: flex_attention has no dropout
    torch.manual_seed(1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(DOCUMENT_IDS), dropout_p=0.5)
    assert torch.equal(dropped, expected) and not torch.equal(dropped, masked)
    # the guard: attending across documents (or to itself only, or not to itself) moves the output by ~1
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (causal - masked).abs().max() > 0.1


class Inner(torch.nn.Module):
    """A transformers-like model: its attention kind in ``config._attn_implementation``."""

    def __init__(self, kind: str | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        if kind is not None:
            self.config = SimpleNamespace(_attn_implementation=kind)

    def forward(self, input_ids=None, position_ids=None, attention_mask=None):
        raise NotImplementedError


class Wrapper(torch.nn.Module):
    """What DDP and DataParallel put around a model: ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        raise NotImplementedError


class PeftLike(torch.nn.Module):
    """What peft puts around a model: ``get_base_model()``, and a forward that takes anything."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base

    def get_base_model(self) -> torch.nn.Module:
        return self.base

    def forward(self, *args, **kwargs):
        raise NotImplementedError


PACKED = {
    "input_ids": torch.tensor([[5, 6, 7, 8]]),
    "position_ids": torch.tensor([[0, 1, 0, 1]]),
    "document_ids": torch.tensor([[0, 0, 1, 1]]),
}


@pytest.mark.parametrize("kind", ["sdpa", None, "eager", "flex_attention", "flash_attention_2"])
def test_a_transformers_model_gets_the_document_mask_its_attention_reads(kind):
    """Read through the wrappers a run puts around the model (DDP's ``.module``, peft's base)."""
    inputs = transformers_inputs(Wrapper(Wrapper(PeftLike(Inner(kind)))), PACKED)
    assert inputs["input_ids"] is PACKED["input_ids"] and inputs["position_ids"] is PACKED["position_ids"]
    allowed = document_mask(PACKED["document_ids"])
    if kind == "flash_attention_2":  # its variable-length kernel cuts at each position 0
        assert set(inputs) == {"input_ids", "position_ids"}
    elif kind == "flex_attention":
        assert torch.equal(
            inputs["attention_mask"].to_dense().bool(), torch.ones(1, 1, 1, 1, dtype=torch.bool)
        )
        assert inputs["attention_mask"].mask_mod(0, 0, torch.tensor(2), torch.tensor(1)).item() is False
    elif kind == "eager":  # additive, in the model's dtype
        mask = inputs["attention_mask"]
        assert mask.dtype == torch.float64 and torch.equal(mask == 0, allowed)
        assert torch.equal(mask[~allowed], torch.full_like(mask[~allowed], torch.finfo(torch.float64).min))
    else:  # sdpa, also when the model names no attention kind
        assert torch.equal(inputs["attention_mask"], allowed)


class NoMask(torch.nn.Module):
    def forward(self, input_ids=None, position_ids=None):
        raise NotImplementedError


class NoPositions(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None):
        raise NotImplementedError


@pytest.mark.parametrize("model", [NoMask(), NoPositions()], ids=["no attention_mask", "no position_ids"])
def test_a_model_that_cannot_keep_documents_apart_is_one_line_naming_it(model):
    with pytest.raises(TaskError) as refused:
        transformers_inputs(Wrapper(model), PACKED)
    assert str(refused.value) == (
        f"pack_length: {type(model).__name__}.forward takes no position_ids or no attention_mask, so its "
        "documents would attend to each other: train it without pack_length"
    )
