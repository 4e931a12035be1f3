"""The cpu platform's prompt attention kernel (csrc/prompt_attention.c) against a
float64 oracle on random inputs, at every ISA level this CPU runs.

Inputs are views into one fused q/k/v projection (rows with a stride, as the model
passes them), several prompts of lengths across the kernel's steps (4-row register
blocks, 16-position work items, 32/16/8-key tiles), GQA groups 1-8, head dims that are
whole vectors, one with an 8-lane rest (72) and one with a scalar rest (20).

Tolerances: float32 ``rtol = atol = 1e-5`` against float64 (float32 sums in another
order; the gap seen is ~1e-6). bfloat16: the oracle reads the same bf16 inputs and is
rounded to bf16 itself; the kernel's float32 result rounded to bf16 may land one bf16
step (at most 2**-7 relative) away where the two sit on either side of a rounding
boundary.
"""

from __future__ import annotations

import pytest
import torch
from quire.platforms.cpu.native import NativeKernels

LENS = [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100]


def _inputs(seed: int, lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
            lead: int = 3):
    """q, k, v [T, H, D] as views into one [T, (Hq + 2 Hkv) D] projection, the prompts
    (first row, rows) one after another from row ``lead``."""
    gen = torch.Generator().manual_seed(seed)
    total = lead + sum(lens)
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    starts, at = [], lead
    for n in lens:
        starts.append(at)
        at += n
    return (q.view(total, hq, d), k.view(total, hkv, d), v.view(total, hkv, d),
            tuple(zip(starts, lens)))


def _dense(q, k, v, prompts, scale, window) -> torch.Tensor:
    """Each prompt causal over its own rows (the last ``window`` positions with one),
    float64, Hugging Face's repeat_interleave GQA."""
    outs = []
    for start, n in prompts:
        qq, kk, vv = (t[start:start + n].double() for t in (q, k, v))
        g = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        i = torch.arange(n)
        hidden = i[None, :] > i[:, None]
        if window is not None:
            hidden |= i[:, None] - i[None, :] >= window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


@pytest.mark.parametrize("groups", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128, 72, 20])
def test_float32_matches_float64(kernels: NativeKernels, groups: int, d: int) -> None:
    hkv = 2
    q, k, v, prompts = _inputs(d + groups, LENS, groups * hkv, hkv, d, torch.float32)
    for window in (None, 1, 7, 33):
        out = kernels.prompt_attention(q, k, v, prompts, d ** -0.5, window)
        assert out is not None and out.dtype == torch.float32
        assert out.shape == (sum(LENS), groups * hkv, d)
        torch.testing.assert_close(out.double(), _dense(q, k, v, prompts, d ** -0.5, window),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups,d", [(3, 64), (1, 72), (8, 20)])
def test_bfloat16_matches_float64_rounded(kernels: NativeKernels, groups: int,
                                          d: int) -> None:
    hkv = 3
    q, k, v, prompts = _inputs(7 * d + groups, LENS, groups * hkv, hkv, d, torch.bfloat16)
    for window in (None, 9):
        out = kernels.prompt_attention(q, k, v, prompts, 0.3, window)
        assert out is not None and out.dtype == torch.bfloat16
        expected = _dense(q, k, v, prompts, 0.3, window).bfloat16().double()
        torch.testing.assert_close(out.double(), expected, rtol=2 ** -7, atol=1e-6)


def test_a_long_prompt_with_one_kv_head(kernels: NativeKernels) -> None:
    """Over many work items and tiles: one prompt of 700 positions, MQA (one KV head)."""
    q, k, v, prompts = _inputs(11, [700], 6, 1, 64, torch.float32, lead=0)
    out = kernels.prompt_attention(q, k, v, prompts, 0.125, None)
    torch.testing.assert_close(out.double(), _dense(q, k, v, prompts, 0.125, None),
                               rtol=1e-5, atol=1e-5)


def test_only_the_prompts_rows_are_read(kernels: NativeKernels) -> None:
    """Rows outside every prompt hold NaN, and one prompt's rows hold none of another's:
    a kernel reading past a prompt's first or last row shows it."""
    q, k, v, prompts = _inputs(5, [9, 40, 17], 6, 2, 16, torch.float32)
    for t in (q, k, v):
        t[:3] = float("nan")
    out = kernels.prompt_attention(q, k, v, prompts, 0.25, None)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), _dense(q, k, v, prompts, 0.25, None),
                               rtol=1e-5, atol=1e-5)
    # the middle prompt alone: the same rows as its share of the whole
    alone = kernels.prompt_attention(q, k, v, prompts[1:2], 0.25, None)
    torch.testing.assert_close(alone, out[9:49], rtol=0, atol=0)


def test_inputs_it_does_not_take_are_declined(kernels: NativeKernels) -> None:
    q, k, v, prompts = _inputs(3, [5, 9], 4, 2, 8, torch.float32)
    assert kernels.prompt_attention(q.half(), k.half(), v.half(), prompts, 1.0, None) is None
    assert kernels.prompt_attention(q, k.bfloat16(), v, prompts, 1.0, None) is None
    assert kernels.prompt_attention(q, k, v, (), 1.0, None) is None
    assert kernels.prompt_attention(q, k, v, ((3, 0),), 1.0, None) is None
    assert kernels.prompt_attention(q, k, v, ((10, 9),), 1.0, None) is None  # past the end
    assert kernels.prompt_attention(q.transpose(1, 2), k, v, prompts, 1.0, None) is None
    assert kernels.prompt_attention(q[:, :3], k, v, prompts, 1.0, None) is None  # 3 % 2
    assert kernels.prompt_attention(q, k.contiguous(), v, prompts, 1.0, None) is None
