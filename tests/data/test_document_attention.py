"""The flex_attention block mask of packed documents: what CUDA runs (charlm's attention) and what a
transformers model with ``attn_implementation="flex_attention"`` is given. flex_attention runs on the CPU
too, uncompiled: slow, but the same mask, so its mask is checked here against SDPA's boolean one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leantrain.data.document_attention import _flex_block_mask, document_mask

# The rows hold different documents: a mask made for one row only (or for none) gives another answer.
# 144 positions: more than one of flex_attention's 128-position blocks, so a whole block is skipped.
DOCUMENT_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4] * 9, [0] * 80 + [1] * 64])


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_the_flex_block_mask_lets_each_position_attend_to_its_own_document_up_to_itself():
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, DOCUMENT_IDS.shape[1], 8) for _ in range(3))
    block_mask = _flex_block_mask(DOCUMENT_IDS)
    assert block_mask.shape == (2, 1, DOCUMENT_IDS.shape[1], DOCUMENT_IDS.shape[1])
    flex = flex_attention(q, k, v, block_mask=block_mask)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(DOCUMENT_IDS))
    torch.testing.assert_close(flex, masked, rtol=0, atol=1e-5)
    # the guard: attending across documents (or to itself only, or not to itself) moves the output by ~1
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (causal - masked).abs().max() > 0.1
