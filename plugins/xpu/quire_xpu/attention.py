"""Paged attention on Intel GPUs through IPEX, with the core's portable Triton backend
for whatever IPEX lacks.

Written against the IPEX API docs (``ipex.llm.modules.PagedAttention``), NOT run on an
Intel GPU. What runs is decided once, when the backend is made, per operation:

- writes: IPEX's ``reshape_and_cache_flash``;
- attention: IPEX's ``flash_attn_varlen_func``, one call for a whole mixed step (decode
  rows are queries of length 1; the older ``single_query_cached_kv_attention`` decode
  kernel wants another cache layout and is not used). It must take
  ``window_size_left``/``window_size_right``; a soft cap needs its ``softcap`` argument too;
- anything the installed IPEX lacks (or all of it, without IPEX): the core's
  ``quire.kernels.triton_backend.TritonAttentionBackend``, which Triton compiles for XPU.

Mixing the two per operation is sound only because both use the same cache layout, the
cpu reference's ``[2, num_blocks, block_size, Hkv, D]`` (``kv_cache[0]`` keys,
``kv_cache[1]`` values; IPEX calls it the "flash" layout). :func:`make_backend` checks
that the Triton backend still says so before mixing.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from quire.interfaces.attention import AttentionBackend, AttentionBatch, check_attention_options

logger = logging.getLogger(__name__)

#: What IPEX can do here: write the cache, attend (with windows), attend with a soft cap.
WRITE, VARLEN, SOFTCAP = "reshape_and_cache_flash", "flash_attn_varlen_func", "softcap"
_ALL = frozenset({WRITE, VARLEN, SOFTCAP})
#: A probe shape for comparing layouts: (num_blocks, block_size, Hkv, D).
_PROBE = (3, 16, 2, 64)


def make_backend() -> AttentionBackend:
    """IPEX for what it can do, the Triton backend for the rest (or everything).

    :raises RuntimeError: when some operation has neither, naming why.
    """
    ops, abilities, why = _ipex_paged_attention()
    if abilities == _ALL:
        return IpexAttentionBackend(ops, abilities)
    try:
        from quire.kernels.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        raise RuntimeError(f"no complete attention backend for xpu: IPEX {why}, and the "
                           f"Triton backend cannot be imported ({exc})") from exc
    triton = TritonAttentionBackend()
    logger.info("xpu attention: IPEX %s; the Triton backend serves that", why)
    if ops is None:
        return triton
    return IpexAttentionBackend(ops, abilities, fallback=triton)


def _ipex_paged_attention() -> tuple[Any, frozenset[str], str]:
    """``(ipex.llm.modules.PagedAttention or None, what it can do, what it cannot)``."""
    try:
        import intel_extension_for_pytorch as ipex
    except Exception as exc:  # not installed, or built for another torch: Triton instead
        return None, frozenset(), f"cannot be imported: {type(exc).__name__}: {exc}"
    ops = getattr(getattr(getattr(ipex, "llm", None), "modules", None), "PagedAttention", None)
    if ops is None:
        return None, frozenset(), "has no llm.modules.PagedAttention"
    abilities = {WRITE} if hasattr(ops, WRITE) else set()
    try:
        params = set(inspect.signature(ops.flash_attn_varlen_func).parameters)
    except (AttributeError, TypeError, ValueError):  # absent, or a builtin we cannot inspect
        params = set()
    if "window_size_left" in params and "window_size_right" in params:
        abilities.add(VARLEN)
        if SOFTCAP in params:
            abilities.add(SOFTCAP)
    missing = ", ".join(sorted(_ALL - abilities))
    return ops, frozenset(abilities), f"{getattr(ipex, '__version__', '?')} lacks {missing}"


@dataclass(frozen=True)
class IpexMetadata:
    """One step's arguments for IPEX's kernels, built once for every layer."""

    slot_mapping: torch.Tensor  # int64 [T]
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    cu_seqlens_k: torch.Tensor  # int32 [B+1], prefix sums of the full sequence lengths
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    max_query_len: int
    max_seq_len: int
    #: The fallback backend's own metadata, when there is a fallback.
    fallback: Any = None


class IpexAttentionBackend(AttentionBackend):
    """IPEX's kernels over the paged cache, a fallback backend for what they lack.

    GQA by head index ``h // G``: IPEX follows flash-attention, which matches the Hugging
    Face convention.

    :param paged_attention: ``ipex.llm.modules.PagedAttention`` (passed in, so importing
        this module never imports IPEX).
    :param abilities: which of :data:`WRITE`, :data:`VARLEN`, :data:`SOFTCAP` it has.
    :param fallback: serves what IPEX lacks; must share this backend's layout.
    :raises ValueError: when IPEX lacks something and there is no fallback, or the
        fallback's layout differs.
    """

    name = "xpu-ipex"

    def __init__(self, paged_attention: Any, abilities: frozenset[str],
                 fallback: AttentionBackend | None = None) -> None:
        if fallback is None and abilities != _ALL:
            raise ValueError(f"IPEX lacks {', '.join(sorted(_ALL - abilities))} and no "
                             "fallback backend was given")
        if fallback is not None and fallback.kv_cache_shape(*_PROBE) != self.kv_cache_shape(
                *_PROBE):
            raise ValueError(f"the fallback backend '{fallback.name}' uses another KV layout "
                             f"({fallback.kv_cache_shape(*_PROBE)} for {_PROBE}); its "
                             "operations cannot be mixed with IPEX's")
        self._ops = paged_attention
        self._abilities = abilities
        self._fallback = fallback
        if fallback is not None:
            self.name = f"xpu-ipex+{fallback.name}"

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, batch: AttentionBatch) -> IpexMetadata:
        cu_k = torch.zeros(batch.num_seqs + 1, dtype=torch.int32, device=batch.seq_lens.device)
        cu_k[1:] = torch.cumsum(batch.seq_lens, 0)  # the copy narrows int64 to int32
        return IpexMetadata(
            slot_mapping=batch.slot_mapping.long(),
            cu_seqlens_q=batch.query_start_loc.int(),
            cu_seqlens_k=cu_k,
            block_tables=batch.block_tables.int(),
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            fallback=self._fallback.build_metadata(batch) if self._fallback else None,
        )

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: IpexMetadata,
    ) -> None:
        if WRITE not in self._abilities and self._fallback is not None:
            self._fallback.write_kv(key, value, kv_cache, metadata.fallback)
            return
        self._ops.reshape_and_cache_flash(key, value, kv_cache[0], kv_cache[1],
                                          metadata.slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: IpexMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        check_attention_options(sliding_window, logits_soft_cap)
        needs = {VARLEN} if logits_soft_cap is None else {VARLEN, SOFTCAP}
        if not needs <= self._abilities and self._fallback is not None:
            return self._fallback.attend(
                query, kv_cache, metadata.fallback, scale=scale,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        out = torch.empty_like(query)
        # flash-attention's window counts keys before the query, the query excluded:
        # our window of W keys ending at p is (W - 1, 0); -1 means unbounded.
        window = {"window_size_left": -1, "window_size_right": -1}
        if sliding_window is not None:
            window = {"window_size_left": sliding_window - 1, "window_size_right": 0}
        cap = {} if logits_soft_cap is None else {"softcap": logits_soft_cap}
        self._ops.flash_attn_varlen_func(
            out,
            query.contiguous(),
            kv_cache[0],
            kv_cache[1],
            metadata.cu_seqlens_q,
            metadata.cu_seqlens_k,
            metadata.max_query_len,
            metadata.max_seq_len,
            scale,
            True,  # causal, aligned bottom-right: queries are the last tokens of each sequence
            metadata.block_tables,
            None,  # alibi slopes
            **window,
            **cap,
        )
        return out
