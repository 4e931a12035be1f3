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


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                                 "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 512}])
def test_a_table_filled_as_positions_grow_is_hf_bit_for_bit(rope_scaling) -> None:
    """Steps reaching further each time fill the table in pieces; every factor they
    read is HF's, bit for bit, as a table built whole gives."""
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=8192, rope_theta=500000.0,
                         rope_scaling=rope_scaling)
    head = 64
    rope, whole = get_rope(config, head), get_rope(config, head)
    whole.cover(whole.max_position)
    hf_rope = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, 1, head)
    for step in ([0, 1, 2], [3, 200], [255, 256, 700], [701, 5000, 4], [8191]):
        positions = torch.tensor(step)
        cos, sin = rope(positions, torch.float32)
        assert rope.filled > max(step)
        hf_cos, hf_sin = hf_rope(x, positions[None])
        assert torch.equal(cos[:, 0], hf_cos[0])
        assert torch.equal(sin[:, 0, head // 2:], hf_sin[0, :, head // 2:])
        whole_cos, whole_sin = whole(positions, torch.float32)
        assert torch.equal(cos, whole_cos) and torch.equal(sin, whole_sin)
    assert rope.filled == rope.max_position


def test_a_host_table_holds_memory_only_for_the_positions_used() -> None:
    """A 2^20-position table of 256 floats a row would take 1 GiB built whole; a step at
    position 1000 leaves it far below that."""
    config = LlamaConfig(hidden_size=128, num_attention_heads=1, num_key_value_heads=1,
                         max_position_embeddings=1 << 20)
    before = _rss_mib()
    rope = get_rope(config, 128)
    rope(torch.tensor([5, 1000]), torch.float32)
    filled = rope.filled
    assert 1000 < filled < 4096
    for _ in range(8):  # steps within the rows there fill nothing more
        rope(torch.tensor([999, 3]), torch.float32)
    assert rope.filled == filled
    assert _rss_mib() - before < 64


def test_a_table_keeps_its_rows_through_a_cast_and_fills_the_rest_in_the_new_dtype():
    config = LlamaConfig(hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                         max_position_embeddings=4096)
    rope, whole = get_rope(config, 64), get_rope(config, 64)
    whole.cover(whole.max_position)
    rope(torch.tensor([10]), torch.float32)
    rope.to(dtype=torch.bfloat16)
    whole.to(dtype=torch.bfloat16)
    positions = torch.tensor([3, 300, 3000])
    for got, want in zip(rope(positions, torch.bfloat16), whole(positions, torch.bfloat16)):
        assert torch.equal(got, want)


def test_a_table_off_the_host_is_filled_whole_when_it_moves() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                         max_position_embeddings=2048)
    rope = get_rope(config, 64)
    assert rope.filled == 0
    rope.to("meta")
    assert rope.filled == rope.max_position


def test_m_rope_fills_the_table_for_its_three_rows_of_positions() -> None:
    from quire.models.layers.rotary import MRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                         max_position_embeddings=8192)
    rope = get_rope(config, 64)
    mrope = MRotaryEmbedding(rope, [16, 8, 8])
    positions = torch.tensor([[1, 2, 3000], [1, 5, 6], [1, 7, 4000]])
    cos, sin = mrope(positions, torch.float32)
    assert rope.filled > 4000
    whole = get_rope(config, 64)
    whole.cover(whole.max_position)
    want_cos, want_sin = MRotaryEmbedding(whole, [16, 8, 8])(positions, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
