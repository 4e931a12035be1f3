"""The Triton backend's host side, which needs no triton: config checks, per-step metadata,
the decode split rule, refusals, and that importing it leaves triton unimported.

The kernels themselves are compared with the cpu reference in tests/kernels/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quire.interfaces.attention import AttentionBatch
from quire.kernels import TritonAttentionBackend, TritonAttentionConfig


def batch_of(
    query_lens: tuple[int, ...], cached: tuple[int, ...], block_size: int = 4
) -> AttentionBatch:
    seq_lens = [c + q for c, q in zip(cached, query_lens, strict=True)]
    width = max(-(-s // block_size) for s in seq_lens)
    return AttentionBatch(
        slot_mapping=torch.arange(sum(query_lens)),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.zeros(len(query_lens), width, dtype=torch.int32),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens=query_lens,
    )


def test_importing_and_building_metadata_never_imports_triton() -> None:
    probe = textwrap.dedent(
        """
        import json, sys, torch
        import quire, quire.kernels
        from quire.kernels import TritonAttentionBackend
        from quire.interfaces.attention import AttentionBatch
        backend = TritonAttentionBackend()
        backend.kv_cache_shape(8, 16, 2, 64)
        backend.build_metadata(AttentionBatch(
            slot_mapping=torch.arange(3), query_start_loc=torch.tensor([0, 2, 3]),
            seq_lens=torch.tensor([2, 5]), block_tables=torch.zeros(2, 1, dtype=torch.int32),
            block_size=16, max_query_len=2, max_seq_len=5, query_lens=(2, 1)))
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "triton")))
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


def test_metadata_maps_prefill_blocks_to_sequences() -> None:
    #            prefill 9, decode, prefill 16, decode, prefill 2
    batch = batch_of((9, 1, 16, 1, 2), cached=(0, 7, 4, 0, 30))
    backend = TritonAttentionBackend(TritonAttentionConfig(prefill_block_q=8))
    md = backend.build_metadata(batch)
    assert md.decode_seqs.tolist() == [1, 3]
    assert md.qblock_seq.tolist() == [0, 0, 2, 2, 4]
    assert md.qblock_idx.tolist() == [0, 1, 0, 1, 0]
    assert md.block_q == 8 and md.block_size == 4 and md.max_seq_len == 32
    assert md.query_start_loc.dtype == md.seq_lens.dtype == md.block_tables.dtype == torch.int32
    assert md.slot_mapping.dtype == torch.int64


def test_metadata_without_decode_kernel_sends_every_sequence_to_prefill() -> None:
    batch = batch_of((9, 1, 1), cached=(0, 7, 4))
    config = TritonAttentionConfig(prefill_block_q=8, use_decode_kernel=False)
    md = TritonAttentionBackend(config).build_metadata(batch)
    assert md.decode_seqs.tolist() == []
    assert md.qblock_seq.tolist() == [0, 0, 1, 2]
    assert md.qblock_idx.tolist() == [0, 1, 0, 0]


def test_metadata_refuses_inconsistent_batches() -> None:
    backend = TritonAttentionBackend()
    batch = batch_of((3, 1), cached=(0, 9))
    with pytest.raises(ValueError, match="query_lens sum to 4 but slot_mapping holds 3"):
        backend.build_metadata(AttentionBatch(**{**batch.__dict__,
                                                 "slot_mapping": torch.arange(3)}))
    with pytest.raises(ValueError, match="needs 3 blocks"):
        backend.build_metadata(AttentionBatch(**{**batch.__dict__,
                                                 "block_tables": batch.block_tables[:, :2]}))


@pytest.mark.parametrize(
    ("num_decode", "kv_heads", "max_seq_len", "window", "splits"),
    [
        # 8 programs want 32 shares; 64 tiles of 64 keys give at most 16 of 4 tiles
        (1, 8, 4096, None, 16),
        (1, 8, 1000, None, 4),  # 16 tiles: 4 shares of 4 tiles
        (1, 8, 768, None, 2),  # 12 tiles allow 3 shares, rounded down to a power of 2
        (64, 8, 4096, None, 1),  # 512 programs already reach the target of 256
        (2, 8, 200, None, 1),  # 4 tiles: too short to split
        (1, 8, 4096, 512, 2),  # the window bounds the work: 9 tiles -> 2 shares
        (0, 8, 4096, None, 1),  # no decode sequence
    ],
)
def test_decode_split_rule(
    num_decode: int, kv_heads: int, max_seq_len: int, window: int | None, splits: int
) -> None:
    backend = TritonAttentionBackend(TritonAttentionConfig(decode_split_target=256))
    query_lens = (1,) * num_decode + (5,)
    batch = batch_of(query_lens, cached=(max_seq_len - 1,) * num_decode + (0,), block_size=16)
    md = backend.build_metadata(batch)
    assert backend.decode_splits(md, kv_heads, window) == splits


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefill_block_q", 0),
        ("prefill_tile_n", 8),
        ("decode_tile_n", 48),
        ("prefill_max_rows", 8),  # below prefill_block_q (16)
        ("decode_max_splits", 3),
        ("num_warps", 0),
    ],
)
def test_config_refuses_values_the_kernels_cannot_use(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"TritonAttentionConfig.{field}"):
        TritonAttentionConfig(**{field: value})


@pytest.mark.parametrize(("args", "match"), [
    ((8, 0, 2, 64), "block_size must be >= 1"),
    ((8, 16, 2, 0), "head sizes 1..256"),
    ((8, 16, 2, 257), "head sizes 1..256"),
])
def test_kv_cache_shape_refuses_unsupported_sizes(args: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TritonAttentionBackend().kv_cache_shape(*args)


def test_kv_cache_layout_is_the_reference_layout() -> None:
    backend = TritonAttentionBackend()
    assert backend.kv_cache_shape(10, 12, 4, 80) == (2, 10, 12, 4, 80)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_cpu_tensors_without_the_interpreter_are_refused_with_the_fix() -> None:
    probe = textwrap.dedent(
        """
        import torch
        from quire.kernels import TritonAttentionBackend
        from quire.interfaces.attention import AttentionBatch
        backend = TritonAttentionBackend()
        md = backend.build_metadata(AttentionBatch(
            slot_mapping=torch.arange(1), query_start_loc=torch.tensor([0, 1]),
            seq_lens=torch.tensor([1]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
            block_size=16, max_query_len=1, max_seq_len=1, query_lens=(1,)))
        cache = torch.zeros(backend.kv_cache_shape(1, 16, 1, 16))
        try:
            backend.write_kv(torch.ones(1, 1, 16), torch.ones(1, 1, 16), cache, md)
        except RuntimeError as err:
            print(err)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout
