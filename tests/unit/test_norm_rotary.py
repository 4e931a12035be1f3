"""RMSNorm and rotary embedding against Hugging Face's Llama code, bit for bit in float32.

Both are rewritten for fewer kernels per decode step (a fused ``torch.rms_norm``, a
rotation by ``roll``); these tests hold them to HF's exact float32 results on seeded
random inputs (never zeros), so greedy parity with ``transformers`` does not rest on
luck.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from quire.models.layers.norm import RMSNorm
from quire.models.layers.rotary import apply_rotary, get_rope


@pytest.mark.parametrize("hidden", [7, 64, 576, 2048])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norm_is_hf_bit_for_bit(hidden: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(hidden * 31 + rows)
    ours, hf = RMSNorm(hidden, eps=1e-6), LlamaRMSNorm(hidden, eps=1e-6)
    weight = torch.randn(hidden, generator=gen)
    ours.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen)
    assert torch.equal(ours(x), hf(x))
    normed, stream = ours(x, residual)
    assert torch.equal(stream, residual + x) and torch.equal(normed, hf(residual + x))


def test_rms_norm_in_bfloat16_rounds_where_hf_does() -> None:
    gen = torch.Generator().manual_seed(3)
    ours, hf = RMSNorm(64, eps=1e-5), LlamaRMSNorm(64, eps=1e-5)
    weight = torch.randn(64, generator=gen).bfloat16()
    ours.weight.data = weight.clone()
    hf.weight.data = weight.clone()
    x = torch.randn(5, 64, generator=gen).bfloat16()
    assert torch.equal(ours(x), hf(x))


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                          {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 64}])
def test_rotary_is_hf_bit_for_bit(rope_scaling: dict | None) -> None:
    config = LlamaConfig(hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                         max_position_embeddings=256, rope_theta=10000.0,
                         rope_scaling=rope_scaling)
    head = 32
    rope = get_rope(config, head)
    gen = torch.Generator().manual_seed(5)
    positions = torch.tensor([0, 1, 7, 63, 64, 200, 255])
    q = torch.randn(len(positions), 3, head, generator=gen)
    k = torch.randn(len(positions), 1, head, generator=gen)
    cos, sin = rope(positions, torch.float32)
    hf_rope = LlamaRotaryEmbedding(config)
    hf_cos, hf_sin = hf_rope(q, positions[None])  # [1, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      hf_cos, hf_sin)
    # the same angles (the table is built as HF builds it) ...
    assert torch.equal(cos[:, 0], hf_cos[0])
    assert torch.equal(sin[:, 0, head // 2:], hf_sin[0, :, head // 2:])
    assert torch.equal(sin[:, 0, :head // 2], -hf_sin[0, :, :head // 2])
    # ... and the same rotation, bit for bit
    assert torch.equal(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1))
