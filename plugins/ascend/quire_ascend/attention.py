"""Paged attention on Ascend NPUs with torch_npu's operators.

Written against the torch_npu / CANN operator docs, NOT run on an NPU. Per step:

- writes: ``torch_npu._npu_reshape_and_cache`` scatters K/V into their slots;
- decode-only steps without a window: ``torch_npu._npu_paged_attention``, CANN's
  single-query paged kernel (it takes the sequence lengths as a host tensor);
- everything else with prefill rows or a window: ``torch_npu.npu_fused_infer_attention_score``
  ("FIA") in the ``TND`` layout over the paged cache, with the compressed 2048 x 2048
  causal mask: ``sparse_mode=3`` (causal, aligned bottom-right, so a chunk after a cached
  prefix sees the prefix) or ``sparse_mode=4`` (a band of ``pre_tokens`` keys before the
  query, for sliding windows);
- a soft cap, which neither kernel takes: the core's reference attention (plain torch
  ops, correct on any device, slow) over the same cache.

Layout (vLLM-Ascend's, the same as the cpu reference's): ``[2, num_blocks, block_size,
Hkv, D]``; ``kv_cache[0]`` keys, ``kv_cache[1]`` values. FIA reads each as
``[num_blocks, block_size, Hkv * D]``, a view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from quire.interfaces.attention import AttentionBackend, AttentionBatch, check_attention_options
from quire.ops.attention import ReferenceAttentionBackend

#: Side of the compressed causal mask FIA takes in sparse modes 3 and 4 (fixed by CANN).
MASK_SIZE = 2048


@dataclass(frozen=True)
class AscendMetadata:
    """One step's arguments for the NPU operators, built once for every layer."""

    slot_mapping: torch.Tensor  # int32 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    #: int32 [B] on the host: _npu_paged_attention's context_lens.
    seq_lens_host: torch.Tensor
    #: FIA's TND arguments: cumulative query ends, and per-sequence KV lengths.
    query_ends: list[int]
    seq_lens: list[int]
    decode_only: bool
    #: bool [2048, 2048] on the device, True above the diagonal (masked out).
    causal_mask: torch.Tensor
    #: Kept for the soft-cap path, which builds the reference's own metadata.
    batch: AttentionBatch


class AscendAttentionBackend(AttentionBackend):
    """torch_npu paged attention. GQA by head index ``h // G`` (the Hugging Face
    convention, which CANN's grouped attention follows)."""

    name = "ascend"

    def __init__(self, torch_npu: Any) -> None:
        #: The ``torch_npu`` module, passed in so that importing this module imports none.
        self._npu = torch_npu

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, batch: AttentionBatch) -> AscendMetadata:
        """One device-to-host copy per step: the sequence lengths, which both kernels take
        on the host (AttentionBatch carries only the query lengths there)."""
        seq_lens_host = batch.seq_lens.to("cpu", torch.int32)
        ends, total = [], 0
        for q in batch.query_lens:
            total += q
            ends.append(total)
        device = batch.seq_lens.device
        return AscendMetadata(
            slot_mapping=batch.slot_mapping.int(),
            block_tables=batch.block_tables.int(),
            seq_lens_host=seq_lens_host,
            query_ends=ends,
            seq_lens=seq_lens_host.tolist(),
            decode_only=batch.max_query_len == 1,
            causal_mask=torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool,
                                   device=device).triu_(1),
            batch=batch,
        )

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AscendMetadata,
    ) -> None:
        self._npu._npu_reshape_and_cache(key=key, value=value, key_cache=kv_cache[0],
                                         value_cache=kv_cache[1],
                                         slot_indices=metadata.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AscendMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        check_attention_options(sliding_window, logits_soft_cap)
        if logits_soft_cap is not None:
            reference = ReferenceAttentionBackend()  # plain torch ops: runs on the NPU too
            return reference.attend(query, kv_cache, reference.build_metadata(metadata.batch),
                                    scale=scale, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap)
        if metadata.decode_only and sliding_window is None:
            return self._paged_decode(query, kv_cache, metadata, scale)
        return self._fused(query, kv_cache, metadata, scale, sliding_window)

    def _paged_decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
                      metadata: AscendMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        self._npu._npu_paged_attention(
            query=query.contiguous(),
            key_cache=kv_cache[0],
            value_cache=kv_cache[1],
            num_kv_heads=kv_cache.shape[3],
            num_heads=query.shape[1],
            scale_value=scale,
            block_table=metadata.block_tables,
            context_lens=metadata.seq_lens_host,
            out=out,
        )
        return out

    def _fused(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AscendMetadata,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        band = {}
        if sliding_window is not None:
            # band mode: keys p - pre_tokens .. p + next_tokens; ours are the W keys up to p
            band = {"sparse_mode": 4, "pre_tokens": sliding_window - 1, "next_tokens": 0}
        out, _ = self._npu.npu_fused_infer_attention_score(
            query.contiguous(),
            kv_cache[0].view(num_blocks, block_size, num_kv_heads * head_size),
            kv_cache[1].view(num_blocks, block_size, num_kv_heads * head_size),
            atten_mask=metadata.causal_mask,
            block_table=metadata.block_tables,
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=metadata.query_ends,
            actual_seq_lengths_kv=metadata.seq_lens,
            num_key_value_heads=num_kv_heads,
            num_heads=query.shape[1],
            scale=scale,
            **({"sparse_mode": 3} | band),
        )
        return out
