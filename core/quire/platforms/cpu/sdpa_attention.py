"""The cpu platform's default attention: the native C kernels where they loaded, torch's
fused ``scaled_dot_product_attention`` where not and for soft-capped layers.

Same KV layout and the same :meth:`write_kv` as the reference
(:class:`~quire.ops.attention.ReferenceAttentionBackend`), which stays the oracle;
this backend only attends faster. A step's rows form at most three groups: decode rows,
whole prompts (no cached prefix), and chunks after a cached prefix; each group is one
C call per layer with the kernels, else one SDPA call (whole prompts: one per prompt):

- *keys/values*: one ``index_select`` per tensor gathers each sequence's slots, head by
  head in position order, into a contiguous ``[b, Hkv, L, D]`` (``L``: the group's
  longest sequence; SDPA reads a contiguous K/V ~30% faster than a transposed view,
  more than the finer gather costs). Positions past a sequence's end gather its
  position-0 slot instead: always written, so never NaN, and masked out anyway. No
  unwritten slot is ever read, which is what lets a poisoned cache pass.
- *GQA without copying K/V*: the ``G = Hq / Hkv`` query heads of one KV head are folded
  into SDPA's query-length axis, ``[b, Hkv, G * max_q, D]``, so every KV head is read
  once for its whole group.
- *masks*: additive float masks (0 or ``-inf``), built once per step for each sliding
  window the layers ask for, then shared by every layer with that window.
- *decode rows in C*: with the native kernels (:mod:`~quire.platforms.cpu.native`), the
  decode group of a float32 or bfloat16 cache skips the gather and the mask: the kernel
  reads each sequence's pages in place, once (1.7 ms against 4.1 ms a layer for 64
  sequences of ~190 tokens on 2 cores, float32). Without them, or for other dtypes or a
  soft cap, decode rows take the SDPA path like the rest.
- *whole prompts and chunks in C*: with the native kernels, every whole prompt of the
  group in one C call over the step's own keys and values (``csrc/prompt_attention.c``:
  causal, sliding windows too, float32 or bfloat16 rows read where the projection left
  them), about 4x torch's SDPA on W1's 64 prompts of 128 tokens; and every chunk after
  a cached prefix (prefix-cache hits, chunked prefill) in one call of the same kernel
  over its sequence's pages, with no gather, padding or mask (W4's prefixed steps: 2.8 s
  of SDPA became 0.85 s). Soft-capped layers take the torch path below.
- *whole prompts without them*: one causal SDPA call per prompt (``is_causal``, no mask):
  SDPA then skips the blocks above the diagonal and reads no mask, and no prompt is
  padded to the longest; W3's 2048-token steps of prompts up to 1024 tokens went from
  5.1-6.0 s (one padded, masked call) to 4.0-4.6 s that way. Layers with a soft cap
  or a sliding window take the masked path.

A logits soft cap has no SDPA form; those layers take the same gathered tensors through
explicit matmuls and a softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quire.heap import can_give_back, give_back
from quire.interfaces.attention import AttentionBatch, check_attention_options, kv_row_size
from quire.ops import kv_quant
from quire.ops.attention import ReferenceAttentionBackend
from quire.platforms.cpu.kv_prefault import MODES as PREFAULT_MODES
from quire.platforms.cpu.kv_prefault import BackgroundPrefault
from quire.platforms.cpu.native import NativeKernels


@dataclass(frozen=True)
class _Group:
    """One group's indices, shared by every layer of the step."""

    #: int64 [Tg]: the group's rows in the flat batch; None when they are all rows, in order.
    token_idx: torch.Tensor | None
    #: int64 [Tg]: those rows' cells in the padded ``[b * max_q]`` layout; None when the
    #: group has no padding (every sequence has ``max_q`` new tokens).
    padded_idx: torch.Tensor | None
    #: int64 [b, ceil(L / block_size)]: the group's block tables, cut to what it reads;
    #: the first layer that gathers keys turns them into slots (a native decode reads the
    #: pages in place and never does).
    tables: torch.Tensor
    block_size: int
    #: int64 [b, max_q]: position of each padded query row; padding rows repeat the last
    #: real one, so no row is fully masked.
    q_pos: torch.Tensor
    num_seqs: int
    max_q: int
    key_len: int
    #: int64 [b, blocks]: the group's block tables, for the native decode kernel; None
    #: for a prefill group.
    decode_tables: torch.Tensor | None
    #: int64 [b]: the group's sequence lengths (with this step's token).
    lens: torch.Tensor
    #: (first row, rows) of each sequence when none has a cached prefix: their keys and
    #: values are exactly this step's, so SDPA can run causal on them without a mask.
    fresh_rows: tuple[tuple[int, int], ...] | None
    #: (first row, rows) of each sequence's new tokens in the flat batch; empty for a
    #: decode group that is not all one-token prompts.
    rows: tuple[tuple[int, int], ...]
    #: (sliding window, GQA group, dtype) -> additive mask [b, 1, G * max_q, L]; filled by
    #: the first layer that asks, reused by the rest of the step.
    masks: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    #: Hkv -> int64 [b * Hkv * L]: row ``slot * Hkv + h`` of the cache seen as
    #: ``[slots * Hkv, D]``, for (sequence, KV head ``h``, key position) in that order.
    key_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    #: (dtype, Hkv, D) -> the [2, b * Hkv * L, D] buffer keys and values are gathered
    #: into: layers run one after another, so the step allocates it once, not per layer.
    gathered: dict[tuple[torch.dtype, int, int], torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class CpuSdpaMetadata:
    """One step's precomputed indices."""

    #: int64 [T]: where each new token's K/V goes (the reference's ``write_kv`` reads it).
    slot_mapping: torch.Tensor
    #: The non-empty groups (decode, whole prompts, prefixed chunks); at most three.
    groups: tuple[_Group, ...]


class CpuSdpaAttentionBackend(ReferenceAttentionBackend):
    """Paged attention through ``F.scaled_dot_product_attention``.

    A subclass of the reference for its KV layout and ``write_kv``; ``build_metadata``
    and ``attend`` are its own. Softmax runs inside SDPA (float32 accumulation for the
    half types); GQA follows Hugging Face: query head ``h`` reads KV head ``h // G``.
    """

    name = "cpu-sdpa"
    kv_cache_dtypes = ("float32", "bfloat16", "int8", "fp8")
    kv_int8_hadamard = True

    def __init__(self, native: NativeKernels | None = None,
                 prefault: str = "background") -> None:
        #: The C decode kernel, when the platform could build it.
        self.native = native
        #: When the KV pool's pages become resident (the ``kv_prefault`` option).
        if prefault not in PREFAULT_MODES:
            raise ValueError(f"prefault={prefault!r}: expected one of "
                             f"{', '.join(PREFAULT_MODES)}")
        self.prefault = prefault
        self._background: BackgroundPrefault | None = None

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_size: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
        """As the interface's, with the pages made resident (:mod:`.kv_prefault`): at
        once (``start``: zeros, over torch's threads), a margin ahead of the blocks
        steps reach by a thread on idle CPU (``background``; :meth:`build_metadata`
        reports how far steps got), or at each page's first write (``off``)."""
        shape = self.kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                    kv_row_size(head_size, dtype))
        if self.prefault == "start":
            return torch.zeros(shape, dtype=dtype, device=device)
        cache = torch.empty(shape, dtype=dtype, device=device)
        if self.prefault == "background" and cache.device.type == "cpu":
            if self._background is None:
                self._background = BackgroundPrefault()
            self._background.add(cache)
        return cache

    #: Pages go back to the OS with ``madvise(MADV_DONTNEED)`` (Linux).
    releases_kv_memory = can_give_back()

    def release_kv_pages(self, cache: torch.Tensor, start: int, stop: int) -> None:
        """As the interface's: both halves' pages ``[start, stop)`` given back (the OS
        pages they wholly cover), and kept from the background prefault."""
        if cache.device.type != "cpu" or stop <= start:
            return
        num_blocks = cache.shape[1]
        block_bytes = cache[0, 0].numel() * cache.element_size()
        for half in range(2):
            give_back(cache.data_ptr() + (half * num_blocks + start) * block_bytes,
                      (stop - start) * block_bytes)
        if self._background is not None:
            self._background.released(start)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                 kv_cache: torch.Tensor, metadata: CpuSdpaMetadata) -> None:
        """As the reference's; float32 rows into int8 or fp8 pages are quantised in C
        (the same bytes, one pass instead of a chain of torch ops)."""
        if (self.native is not None and kv_quant.is_quantized(kv_cache)
                and self.native.write_kv_quant(kv_cache, metadata.slot_mapping, key, value)):
            return
        super().write_kv(key, value, kv_cache, metadata)  # type: ignore[arg-type]

    def wait_for_prefault(self, timeout: float | None = None) -> bool:
        """Block until the background thread has caught up with the blocks steps have
        reached plus its margin (True), or ``timeout`` seconds pass (False); True at
        once in the other modes."""
        return self._background is None or self._background.idle.wait(timeout)

    def build_metadata(self, batch: AttentionBatch) -> CpuSdpaMetadata:  # type: ignore[override]
        """Split the batch into decode, whole-prompt and prefixed-chunk groups and build
        their indices.

        :raises ValueError: as the reference's (too few block-table columns, or
            ``query_lens`` that disagree with the number of tokens).
        """
        _check_batch(batch)
        if self._background is not None and batch.num_tokens:
            self._background.reached(int(batch.slot_mapping.max()) // batch.block_size)
        q_lens = batch.query_lens
        seq_lens = batch.seq_lens.tolist()  # host tensors on this platform: no sync
        if seq_lens and all(q == 1 for q in q_lens):  # a decode step: one group
            return CpuSdpaMetadata(slot_mapping=batch.slot_mapping.long(),
                                   groups=(_decode_group(batch, seq_lens),))
        groups = []
        for members in (
            [i for i, q in enumerate(q_lens) if q == 1],
            [i for i, q in enumerate(q_lens) if q > 1 and q == seq_lens[i]],
            [i for i, q in enumerate(q_lens) if 1 < q < seq_lens[i]],
        ):
            if members:
                groups.append(_build_group(batch, members, seq_lens))
        return CpuSdpaMetadata(slot_mapping=batch.slot_mapping.long(), groups=tuple(groups))

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuSdpaMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write then attend; a fresh prompt attends over ``key``/``value`` directly."""
        self.write_kv(key, value, kv_cache, metadata)
        return self._attend(query, kv_cache, metadata, scale, sliding_window,
                            logits_soft_cap, fresh=(key, value))

    def attend(  # type: ignore[override]
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuSdpaMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        return self._attend(query, kv_cache, metadata, scale, sliding_window,
                            logits_soft_cap, fresh=None)

    def _attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuSdpaMetadata,
        scale: float,
        window: int | None,
        cap: float | None,
        fresh: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        check_attention_options(window, cap)
        groups = metadata.groups
        if kv_cache.dtype != query.dtype:
            # int8/fp8 (or float pages of another dtype): every group reads the pages
            # (dequantised as gathered), so a prompt sees what its decode steps will; the
            # C kernels take pages of the query's dtype, and float32 queries over
            # bfloat16 pages, and decline the rest
            fresh = None
        if len(groups) == 1 and groups[0].token_idx is None:
            return _attend_group(query, kv_cache, groups[0], scale, window, cap, fresh,
                                 self.native)
        out = query.new_empty(query.shape)
        for group in groups:
            rows = _attend_group(query, kv_cache, group, scale, window, cap, fresh,
                                 self.native)
            out.index_copy_(0, group.token_idx, rows)
        return out


def _check_batch(batch: AttentionBatch) -> None:
    if sum(batch.query_lens) != batch.num_tokens:
        raise ValueError(
            f"query_lens sum to {sum(batch.query_lens)} but slot_mapping holds "
            f"{batch.num_tokens} tokens"
        )
    n_blocks = -(-batch.max_seq_len // batch.block_size)
    if n_blocks > batch.block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {batch.block_tables.shape[1]} columns but a sequence of "
            f"{batch.max_seq_len} tokens needs {n_blocks} blocks of {batch.block_size}"
        )


def _build_group(batch: AttentionBatch, members: list[int], seq_lens: list[int]) -> _Group:
    """Indices for the sequences ``members`` (indices into the batch, ascending)."""
    q_lens_host = [batch.query_lens[i] for i in members]
    max_q = max(q_lens_host)
    key_len = max(seq_lens[i] for i in members)
    device = batch.seq_lens.device
    seq_idx = torch.tensor(members, dtype=torch.int64, device=device)
    starts = batch.query_start_loc[seq_idx].long()  # [b]
    q_lens = torch.tensor(q_lens_host, dtype=torch.int64, device=device)
    lens = batch.seq_lens[seq_idx].long()  # [b]

    r = torch.arange(max_q, device=device)
    q_pos = (lens - q_lens)[:, None] + torch.minimum(r[None, :], q_lens[:, None] - 1)
    token_idx, padded_idx = _row_maps(starts, q_lens, max_q, ragged=min(q_lens_host) < max_q)
    n_blocks = -(-key_len // batch.block_size)
    tables = batch.block_tables[seq_idx, :n_blocks].long().contiguous()
    decode_tables = tables if max_q == 1 else None
    fresh = all(q == seq_lens[i] for q, i in zip(q_lens_host, members))
    # a decode group's are read only by the torch path of one-token prompts
    rows = tuple(zip(starts.tolist(), q_lens_host)) if max_q > 1 or fresh else ()
    fresh_rows = rows if fresh else None
    return _Group(
        token_idx=None if len(members) == batch.num_seqs else token_idx,
        padded_idx=padded_idx,
        tables=tables,
        block_size=batch.block_size,
        q_pos=q_pos,
        num_seqs=len(members),
        max_q=max_q,
        key_len=key_len,
        decode_tables=decode_tables,
        lens=lens,
        fresh_rows=fresh_rows,
        rows=rows,
    )


def _decode_group(batch: AttentionBatch, seq_lens: list[int]) -> _Group:
    """:func:`_build_group` for a batch whose every sequence has one new token, without
    the index arithmetic that its general case needs: the same fields in a few
    operators, each dearer than its work in a small model's decode step (its weights
    have flushed the caches)."""
    b = batch.num_seqs
    key_len = max(seq_lens)
    n_blocks = -(-key_len // batch.block_size)
    # copies: the batch's tensors are the runner's buffers, refilled every step
    tables = batch.block_tables[:b, :n_blocks].to(torch.int64, copy=True).contiguous()
    lens = batch.seq_lens[:b].to(torch.int64, copy=True)
    rows = tuple((i, 1) for i in range(b)) if all(n == 1 for n in seq_lens) else ()
    return _Group(token_idx=None, padded_idx=None, tables=tables,
                  block_size=batch.block_size, q_pos=(lens - 1)[:, None], num_seqs=b,
                  max_q=1, key_len=key_len, decode_tables=tables, lens=lens,
                  fresh_rows=rows or None, rows=rows)


def _key_slots(group: _Group) -> torch.Tensor:
    """int64 [b, L]: the slot of each sequence's key position ``j``.

    Position ``j`` lives in ``table[j // bs] * bs + j % bs``. Past a sequence's end,
    position 0 stands in: written, so finite, and the mask drops it.
    """
    bs, lens = group.block_size, group.lens
    j = torch.arange(group.key_len, device=lens.device)
    j = torch.where(j[None, :] < lens[:, None], j[None, :], 0)
    return torch.gather(group.tables, 1, j // bs) * bs + j % bs


def _row_maps(
    starts: torch.Tensor, q_lens: torch.Tensor, max_q: int, ragged: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(flat rows of the group's queries, their cells in ``[b * max_q]``, or None when
    every sequence has ``max_q`` rows and the padded layout is the flat one)."""
    r = torch.arange(max_q, device=starts.device)
    flat_rows = starts[:, None] + r[None, :]  # [b, max_q]
    if not ragged:
        return flat_rows.reshape(-1), None
    real = r[None, :] < q_lens[:, None]
    cells = torch.arange(flat_rows.numel(), device=starts.device).view_as(flat_rows)
    return flat_rows[real], cells[real]


def _attend_group(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: _Group,
    scale: float,
    window: int | None,
    cap: float | None,
    fresh: tuple[torch.Tensor, torch.Tensor] | None,
    native: NativeKernels | None = None,
) -> torch.Tensor:
    """One group's attention; returns its rows in flat order, ``[Tg, Hq, D]``."""
    if window is not None and window >= group.key_len:
        window = None  # wider than any sequence here: the causal mask alone decides
    if native is not None and group.decode_tables is not None and cap is None:
        rows = query if group.token_idx is None else query.index_select(0, group.token_idx)
        out = native.paged_decode(rows, kv_cache, group.decode_tables, group.lens, scale,
                                  window)
        if out is not None:
            return out
    if native is not None and group.decode_tables is None and cap is None:
        if fresh is not None and group.fresh_rows is not None:
            out = native.prompt_attention(query, fresh[0], fresh[1], group.fresh_rows, scale,
                                          window)
        else:  # over the pages: chunks after a cached prefix, or an attend-only call
            out = native.chunk_attention(query, kv_cache, group.tables, group.rows,
                                         group.lens, scale, window)
        if out is not None:
            return out
    if fresh is not None and group.fresh_rows is not None and window is None and cap is None:
        outs = [_fresh_prompt(query, fresh, rows, scale) for rows in group.fresh_rows]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    hkv, d = kv_cache.shape[3], query.shape[2]
    b, length = group.num_seqs, group.key_len
    g = query.shape[1] // hkv

    q = _fold_queries(query, group, hkv)  # [b, Hkv, G * max_q, D]
    gathered = _gather(kv_cache, group)
    if kv_quant.is_quantized(kv_cache):  # rows of D + D / 8: values, then scales
        gathered = kv_quant.dequantize(gathered, query.dtype)
    elif gathered.dtype != query.dtype:
        gathered = gathered.to(query.dtype)
    keys, values = gathered.view(2, b, hkv, length, d)
    mask = _mask(group, window, g, query.dtype)
    if cap is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    else:
        out = _capped_attention(q, keys, values, mask, scale, cap)
    return _unfold_rows(out, group, g)


def _gather(kv_cache: torch.Tensor, group: _Group) -> torch.Tensor:
    """Keys and values per sequence, head, then position: ``[2, b * Hkv * L, D]`` (rows
    of ``D + D / 8`` for quantised pages: still quantised)."""
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    rows = group.key_rows.get(hkv)
    if rows is None:  # first layer of the step
        key_slots = _key_slots(group)
        heads = torch.arange(hkv, device=key_slots.device)
        rows = (key_slots[:, None, :] * hkv + heads[None, :, None]).reshape(-1)
        group.key_rows[hkv] = rows
    out = group.gathered.get((kv_cache.dtype, hkv, d))
    if out is None:
        out = kv_cache.new_empty(2, rows.numel(), d)
        group.gathered[(kv_cache.dtype, hkv, d)] = out
    by_row = kv_cache.view(2, -1, d)
    torch.index_select(by_row[0], 0, rows, out=out[0])
    torch.index_select(by_row[1], 0, rows, out=out[1])
    return out


def _fresh_prompt(
    query: torch.Tensor,
    fresh: tuple[torch.Tensor, torch.Tensor],
    rows: tuple[int, int],
    scale: float,
) -> torch.Tensor:
    """Causal SDPA of one whole prompt over its own keys/values: ``[n, Hq, D]``."""
    start, n = rows
    q = query.narrow(0, start, n).transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    k = fresh[0].narrow(0, start, n).transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
    v = fresh[1].narrow(0, start, n).transpose(0, 1).unsqueeze(0)
    g = q.shape[1] // k.shape[1]
    if g > 1:  # is_causal cannot fold heads into rows; repeat K/V (n * Hq * D, small)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def _fold_queries(query: torch.Tensor, group: _Group, hkv: int) -> torch.Tensor:
    """``[T, Hq, D]`` rows of the group -> ``[b, Hkv, G * max_q, D]``, rows ``(g, t)``."""
    b, max_q = group.num_seqs, group.max_q
    hq, d = query.shape[1], query.shape[2]
    rows = query if group.token_idx is None else query.index_select(0, group.token_idx)
    if group.padded_idx is not None:
        padded = rows.new_zeros(b * max_q, hq, d)
        rows = padded.index_copy_(0, group.padded_idx, rows)
    if max_q == 1:
        return rows.view(b, hkv, hq // hkv, d)  # a view: (g, t) order is just g
    q = rows.view(b, max_q, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)
    return q.reshape(b, hkv, hq // hkv * max_q, d)


def _unfold_rows(out: torch.Tensor, group: _Group, g: int) -> torch.Tensor:
    """``[b, Hkv, G * max_q, D]`` -> the group's ``[Tg, Hq, D]`` rows in flat order."""
    b, hkv, _, d = out.shape
    max_q = group.max_q
    if max_q == 1:
        return out.reshape(b, hkv * g, d)
    rows = out.view(b, hkv, g, max_q, d).permute(0, 3, 1, 2, 4).reshape(b * max_q, hkv * g, d)
    return rows if group.padded_idx is None else rows.index_select(0, group.padded_idx)


def _mask(group: _Group, window: int | None, g: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[b, 1, G * max_q, L]``: 0 where row may read key ``j``, else -inf.

    Row at position ``p`` reads ``j <= p`` (which also keeps ``j`` inside the sequence)
    and, with a window, ``j > p - window``. Built once per step and window.
    """
    key = (window, g, dtype)
    mask = group.masks.get(key)
    if mask is not None:
        return mask
    j = torch.arange(group.key_len, device=group.q_pos.device)
    p = group.q_pos[:, :, None]  # [b, max_q, 1]
    blocked = j[None, None, :] > p
    if window is not None:
        blocked |= j[None, None, :] <= p - window
    b, max_q, length = group.num_seqs, group.max_q, group.key_len
    mask = torch.zeros(b, 1, max_q, length, dtype=dtype, device=j.device)
    mask.masked_fill_(blocked[:, None], float("-inf"))
    if max_q > 1 and g > 1:  # rows are (g, t): repeat the [max_q, L] block per head
        mask = mask.expand(b, g, max_q, length).reshape(b, 1, g * max_q, length)
    group.masks[key] = mask
    return mask


def _capped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float,
) -> torch.Tensor:
    """Soft-capped attention, ``cap * tanh(s / cap)`` before the mask; float32 scores."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)).mul_(scale)
    scores.div_(cap).tanh_().mul_(cap).add_(mask)
    return torch.matmul(scores.softmax(dim=-1), values.float()).to(q.dtype)
