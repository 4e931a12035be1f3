"""The attention-backend contract: paged KV storage and attention over it.

A backend owns two things: the *layout* of one layer's KV cache tensor, and the two
operations the model calls every layer: writing the step's new keys/values into their
pages, and attention of the step's queries over everything in the pages.

Vocabulary used below (all counts are per engine step):

- ``T``: number of new tokens in the flattened batch (prefill chunks and decode tokens
  concatenated, sequence after sequence).
- ``B``: number of sequences in the batch.
- ``Hq`` / ``Hkv``: query / key-value heads on this rank (``Hq % Hkv == 0``, GQA). Query
  head ``h`` reads KV head ``h // (Hq // Hkv)`` (Hugging Face's ``repeat_interleave``).
- ``D``: head size.
- A *slot* is one token position in the cache: ``slot = block_id * block_size + offset``.

The reference backend (``quire.ops.attention``, plain torch) is the oracle every
other backend is measured against by the conformance suite.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

#: Quantised page dtypes (int8, fp8 e4m3). A quantised head row is its ``D`` one-byte
#: elements, then one float16 scale per :data:`KV_SCALE_GROUP` of them (``D / 8`` bytes):
#: ``D + D / 8`` bytes, ``D`` a multiple of the group (``quire.ops.kv_quant``).
QUANTIZED_KV_TORCH_DTYPES = (torch.int8, torch.float8_e4m3fn)
KV_SCALE_GROUP = 16


def kv_scale_bytes(head_size: int) -> int:
    """Bytes of the scales after a quantised head row of ``head_size``."""
    return 2 * head_size // KV_SCALE_GROUP


def kv_row_size(head_size: int, dtype: torch.dtype) -> int:
    """Elements of one head row in pages of ``dtype``: ``D``, or ``D + D / 8`` quantised."""
    if dtype in QUANTIZED_KV_TORCH_DTYPES:
        return head_size + kv_scale_bytes(head_size)
    return head_size


def kv_head_size(row_size: int, dtype: torch.dtype) -> int:
    """``D`` of a head row of ``row_size`` elements in pages of ``dtype``
    (:func:`kv_row_size`'s inverse)."""
    if dtype in QUANTIZED_KV_TORCH_DTYPES:
        return row_size * KV_SCALE_GROUP // (KV_SCALE_GROUP + 2)
    return row_size


def check_kv_cache_dtype(backend: "AttentionBackend", platform: str, kv_cache_dtype: str,
                         model_dtype: torch.dtype, head_size: int) -> torch.dtype:
    """The pages' dtype for ``kv_cache_dtype``, once the backend is known to take it:
    what an engine checks at start, before it loads a page.

    :raises ValueError: one line naming the option, the platform and what it supports.
    """
    from quire.ops.kv_quant import kv_torch_dtype

    dtype = kv_torch_dtype(kv_cache_dtype, model_dtype)
    if kv_cache_dtype != "auto" and dtype != model_dtype \
            and kv_cache_dtype not in backend.kv_cache_dtypes:
        supported = ", ".join(("auto", *backend.kv_cache_dtypes))
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype} is not supported by the "
                         f"{platform!r} platform's attention backend ({backend.name}); "
                         f"supported: {supported}")
    if kv_cache_dtype == "int8" and not getattr(backend, "kv_int8_hadamard", False):
        raise ValueError(f"kv_cache_dtype: int8 pages of the {platform!r} platform's "
                         f"attention backend ({backend.name}) are of the layout before "
                         f"plugin API 1.6 (kv_int8_hadamard is not set); use fp8 or "
                         f"a float dtype, or a plugin built for API 1.6")
    if dtype in QUANTIZED_KV_TORCH_DTYPES and head_size % KV_SCALE_GROUP:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype} needs a head size that is a "
                         f"multiple of {KV_SCALE_GROUP} (a scale per {KV_SCALE_GROUP} "
                         f"values); this model's is {head_size}")
    return dtype


@dataclass(frozen=True)
class AttentionBatch:
    """The flattened batch as the model runner hands it to a backend, on the device.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``. Its new
    tokens are the *last* ``q_len_i`` of its ``seq_lens[i]`` tokens, so the first new token
    sits at position ``seq_lens[i] - q_len_i`` and may attend to every earlier position
    (the cached prefix) and causally to the new ones.
    """

    #: int64 [T]: cache slot that receives each new token's K/V.
    slot_mapping: torch.Tensor
    #: int64 [B+1]: prefix sums of per-sequence query lengths, starting at 0.
    query_start_loc: torch.Tensor
    #: int64 [B]: tokens of each sequence in the cache once this step's are written.
    seq_lens: torch.Tensor
    #: int32 [B, max_blocks]: physical block ids; entries past a sequence's last block are
    #: padding (any valid id) and are never read.
    block_tables: torch.Tensor
    #: Tokens per page.
    block_size: int
    #: Host-side maxima, so backends need not synchronise to size buffers.
    max_query_len: int
    max_seq_len: int
    #: Host-side per-sequence query lengths (len B); cheap to have, costly to recompute
    #: from a device tensor.
    query_lens: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def check_attention_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """What every :meth:`AttentionBackend.attend` checks first, in one place.

    :raises ValueError: for a window below 1 or a soft cap that is not positive.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if logits_soft_cap is not None and logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")


class AttentionBackend(ABC):
    """Paged attention for one platform. Stateless between steps; safe to share by layers.

    Ownership: the model runner allocates one KV tensor per layer through
    :meth:`allocate_kv_cache` and owns it; the backend only reads and writes it. The
    metadata returned by :meth:`build_metadata` belongs to one step and may be reused by
    every layer of that step, never by a later step.
    """

    #: Short name shown in logs and conformance tables.
    name: str = "abstract"

    #: ``kv_cache_dtype`` values this backend takes besides ``auto`` (pages of the model's
    #: dtype, which every backend takes): ``"float32"``/``"bfloat16"`` (float pages of
    #: another dtype than the model's: :meth:`write_kv` casts, :meth:`attend` reads them
    #: in float32 or the query's dtype), ``"int8"``/``"fp8"`` (quantised pages, below).
    #: The engine refuses at start (``check_kv_cache_dtype``) a value not named here.
    #: Default: none, so a backend written before plugin API 1.3 gets ``auto`` only.
    #:
    #: Quantised pages (``quire.ops.kv_quant``): one layer's tensor is the backend's
    #: :meth:`kv_cache_shape` at head size ``D + D / 8``, of dtype ``torch.int8`` (int8) or
    #: ``torch.float8_e4m3fn`` (fp8); each head row holds the ``D`` quantised elements
    #: then ``D / 16`` float16 scales, scale ``g`` for elements ``16 g .. 16 g + 15``
    #: (fp8: ``x ~= q * scale``, ``scale = absmax(x of the group) / 448``; int8 since
    #: plugin API 1.6: ``x ~= H (q * scale)``, ``scale = absmax(H x) / 127``, ``H`` the
    #: orthonormal 16 x 16 Hadamard matrix; scales rounded to float16, 1 where that is 0),
    #: per token and KV head, for keys and values.
    #: :meth:`write_kv` (and the op set's ``rotary_write_kv`` where :meth:`kv_slots`
    #: names slots) quantises the float K/V it is given; :meth:`attend` dequantises what
    #: it reads, and must match the reference (``quire.ops.attention``) reading the same
    #: pages. ``D % 16 == 0``. Plugin API 1.3.
    kv_cache_dtypes: tuple[str, ...] = ()

    #: Whether this backend's int8 pages hold their groups in the Hadamard basis (the
    #: int8 layout since plugin API 1.6, which the op set's reference writes and reads).
    #: A backend that declares ``"int8"`` without it was written for the plain layout of
    #: API 1.3-1.5 and is refused int8 at start (``check_kv_cache_dtype``), so that no
    #: page is written in one basis and read in the other. Default: False. Plugin API 1.6.
    kv_int8_hadamard: bool = False

    @abstractmethod
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor. Pure: changes nothing."""

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Allocate one layer's KV cache. Contents are undefined until written.

        ``dtype`` int8 or float8_e4m3fn: quantised pages, head rows of ``D + D / 8``
        (:attr:`kv_cache_dtypes`).

        :raises RuntimeError: (from the allocator) when the memory is not there.
        """
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                    kv_row_size(head_size, dtype))
        return torch.empty(shape, dtype=dtype, device=device)

    #: Whether :meth:`release_kv_pages` gives memory back. A pool that shares one
    #: memory budget with other models' pools (``quire serve`` with several models)
    #: is sized at the whole budget only where this is True; elsewhere each model's pool
    #: gets an equal part of it. Default: False. Plugin API 1.4.
    releases_kv_memory: bool = False

    def release_kv_pages(self, cache: torch.Tensor, start: int, stop: int) -> None:
        """Pages ``[start, stop)`` of one layer's ``cache`` hold nothing the engine will
        read before writing them again: give their memory back where the platform can
        (their contents are then undefined). Called between steps, never for a page a
        sequence holds. Default: nothing (the memory stays). Plugin API 1.4."""

    def kv_cache_bytes(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int, dtype: torch.dtype) -> int:
        """Bytes one layer's cache of ``num_blocks`` pages of ``dtype`` takes (quantised
        values and their scales): what the engine sizes the KV pool by. Pure. Default:
        :meth:`kv_cache_shape` (at head size ``D + D / 8`` for int8/fp8 pages) times the
        element size. Plugin API 1.3."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                    kv_row_size(head_size, dtype))
        return math.prod(shape) * dtype.itemsize

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> Any:
        """Precompute whatever the backend needs for this step (once, not per layer).

        Must not read or change any KV cache. The result is opaque to the core.
        """

    def update_metadata(self, metadata: Any, batch: AttentionBatch) -> bool:
        """Refill ``metadata`` in place for ``batch``, so that device work captured while
        reading it (a graph, ``quire.executor.graphs``) serves a later step.

        ``metadata`` came from :meth:`build_metadata` for a batch of the same query
        lengths and tensor shapes, with a ``max_seq_len`` no smaller than ``batch``'s;
        its tensors keep their addresses, and its host-side fields stay those of the
        capture. Must not sync the device. Plugin API 1.2.

        :returns: True when refilled; False when this backend cannot (the default), or
            not for this batch: the step then runs eagerly.
        """
        return False

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> None:
        """Store the step's new keys and values into their slots, in place.

        :param key: [T, Hkv, D], the cache's dtype.
        :param value: [T, Hkv, D], the cache's dtype.
        :param kv_cache: one layer's tensor from :meth:`allocate_kv_cache`; changed in place
            at the slots of ``slot_mapping`` and nowhere else.
        """

    def kv_slots(self, metadata: Any) -> torch.Tensor | None:
        """Where this step's new K/V go, for the op set's ``rotary_write_kv`` to write
        them (``quire.ops.reference.rotary_write_kv``); None: this backend writes them.

        A backend returns the slots only when its cache is the paged layout of
        ``quire.ops.attention`` (``[2, num_blocks, block_size, Hkv, D]``, slot ``s`` at
        ``[:, s // block_size, s % block_size]``). A model layer then rotates and writes
        through the op and calls :meth:`attend` alone, never :meth:`forward`. Called once
        per step, after :meth:`build_metadata`; must not sync the device.
        Default: None.

        :returns: int [T] on the cache's device (entries < 0: padding, not written), or
            None.
        """
        return None

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of the new queries over the paged keys/values. Read-only.

        The step's K/V must already be written (:meth:`write_kv`). Query row ``t`` of a
        sequence sits at position ``p``; it attends to that sequence's positions ``j <= p``
        (and ``j > p - sliding_window`` when a window is given).

        :param query: [T, Hq, D].
        :param scale: multiplier of ``q . k`` before the softmax (usually ``D ** -0.5``).
        :param logits_soft_cap: if set, scores become ``cap * tanh(scores / cap)``.
        :returns: [T, Hq, D], the query's dtype.
        """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write then attend; what a model layer calls. Backends may fuse the two."""
        self.write_kv(key, value, kv_cache, metadata)
        return self.attend(
            query,
            kv_cache,
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
