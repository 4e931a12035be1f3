"""Bidirectional attention within images through any backend's ``attend``
(:mod:`quire.models.image_blocks`) against a plain masked softmax: image rows see their
whole image, other rows stay causal, with and without sliding windows, after a cached
prefix, on the reference backend and the cpu platform's."""

from __future__ import annotations

import pytest
import torch

from quire.models.image_blocks import ImageBlocks
from quire.ops.attention import ReferenceAttentionBackend
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from tests.paged_cases import make_paged_case


def _expected(case, seqs, blocks, scale, window):
    """Per sequence: keys j visible to query position p when j <= p, or both in one
    block; and j > p - window."""
    outs = []
    for i, (cached, new) in enumerate(seqs):
        k, v = case.full_keys[i].float(), case.full_values[i].float()
        start = int(case.batch.query_start_loc[i])
        q = case.query[start:start + new].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        pos = torch.arange(cached, cached + new)[:, None]
        key = torch.arange(cached + new)[None, :]
        allowed = key <= pos
        for seq, lo, hi in blocks:
            if seq == i:
                allowed |= (pos >= lo) & (pos < hi) & (key >= lo) & (key < hi)
        if window is not None:
            allowed &= key > pos - window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


@pytest.mark.parametrize("backend_cls", [ReferenceAttentionBackend, CpuSdpaAttentionBackend])
@pytest.mark.parametrize("window", [None, 6, 40])
def test_image_rows_attend_over_their_whole_image(backend_cls, window):
    # (cached, new) per sequence; images as (sequence, first position, end position)
    seqs = [(0, 20), (9, 15), (0, 1)]
    # the second sequence's first image began in its cached prefix
    blocks = [(0, 3, 11), (0, 12, 19), (1, 5, 14), (1, 16, 22)]
    case = make_paged_case(seqs, block_size=4, group=2, dtype=torch.float32,
                           num_kv_heads=2, head_size=8, seed=3)
    backend = backend_cls()
    flat = case.kv_cache.view(2, -1, 2, 8)
    flat[0, case.batch.slot_mapping], flat[1, case.batch.slot_mapping] = case.key, case.value
    meta = backend.build_metadata(case.batch)
    scale = 8 ** -0.5
    causal = backend.attend(case.query, case.kv_cache, meta, scale=scale,
                            sliding_window=window)
    rows, owners, positions, ends = [], [], [], []
    for seq, lo, hi in blocks:
        cached = seqs[seq][0]
        start = int(case.batch.query_start_loc[seq])
        for p in range(max(lo, cached), hi):
            rows.append(start + p - cached)
            owners.append(seq)
            positions.append(p)
            ends.append(hi - 1)
    got = ImageBlocks(backend, case.batch, rows, owners, positions, ends).correct(
        causal, case.query, case.kv_cache, scale=scale, sliding_window=window,
        logits_soft_cap=None)
    torch.testing.assert_close(got, _expected(case, seqs, blocks, scale, window),
                               atol=1e-5, rtol=1e-5)
