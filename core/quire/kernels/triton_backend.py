"""The Triton paged-attention backend: the :class:`AttentionBackend` over our Triton kernels.

Hardware-agnostic: GPU platform plugins return it from ``make_attention_backend``
with launch parameters tuned for their hardware (:class:`TritonAttentionConfig`). Importing
this module does not import triton; the kernels (:mod:`quire.kernels.triton_attention`)
are imported on the first launch.

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, Hkv, D]`` (0 = keys,
1 = values), the cpu reference's layout. A slot's ``[Hkv, D]`` row is contiguous, so
writing a token is one dense store, and a kernel reading a tile of keys for one kv head
reads ``D`` contiguous elements per key.

Supported: any ``block_size >= 1`` (each key finds its page, so a tile may span pages; 1
and sizes that are not powers of two included), head sizes 1..256 (padded to a power of
two, at least 16, with masks), any ``Hq`` that is a multiple of ``Hkv``, cache dtypes
float32, float16 and bfloat16. Everything else is refused with ``ValueError``.

Per step, sequences with one new token go to the decode kernel, the others (prefills and
prefill chunks) to the prefill kernel; each row of the output is written by exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from quire.interfaces.attention import (
    QUANTIZED_KV_TORCH_DTYPES,
    AttentionBackend,
    AttentionBatch,
    check_attention_options,
    kv_head_size,
    kv_row_size,
)

#: Largest head size the kernels take; bigger ones would not fit a tile in registers.
MAX_HEAD_SIZE = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Launch parameters. They change speed, never results (beyond float rounding).

    :raises ValueError: naming the field, for a value the kernels cannot use.
    """

    #: Query tokens per prefill program.
    prefill_block_q: int = 16
    #: Most rows (tokens x query heads of one GQA group) per prefill program; a larger
    #: group is split into head chunks. Power of two >= ``prefill_block_q``.
    prefill_max_rows: int = 64
    #: Keys per inner-loop tile of the prefill / decode kernels; powers of two >= 16
    #: (the smallest ``tl.dot`` operand).
    prefill_tile_n: int = 32
    decode_tile_n: int = 64
    #: Programs the decode launch should reach (say, a few per compute unit). While
    #: ``decode sequences x kv heads`` is below it, each sequence's keys are split in
    #: ``2**k`` shares merged by a second kernel. 1 never splits.
    decode_split_target: int = 256
    #: Fewest key tiles in one share, so short contexts stay in one program.
    decode_min_tiles_per_split: int = 4
    #: Most shares per sequence; a power of two.
    decode_max_splits: int = 32
    num_warps: int = 4
    num_stages: int = 2
    #: False sends one-token sequences through the prefill kernel too (for comparisons).
    use_decode_kernel: bool = True

    def __post_init__(self) -> None:
        positive = ("prefill_block_q", "decode_split_target", "decode_min_tiles_per_split",
                    "num_warps", "num_stages")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"TritonAttentionConfig.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        for name in ("prefill_tile_n", "decode_tile_n"):
            value = getattr(self, name)
            if not (_is_pow2(value) and value >= 16):
                raise ValueError(f"TritonAttentionConfig.{name} must be a power of two "
                                 f">= 16, got {value}")
        if not (_is_pow2(self.prefill_max_rows) and self.prefill_max_rows >= self.prefill_block_q):
            raise ValueError(
                "TritonAttentionConfig.prefill_max_rows must be a power of two >= "
                f"prefill_block_q ({self.prefill_block_q}), got {self.prefill_max_rows}"
            )
        if not _is_pow2(self.decode_max_splits):
            raise ValueError("TritonAttentionConfig.decode_max_splits must be a power of "
                             f"two, got {self.decode_max_splits}")


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """One step's launch data, on the batch's device; shared by every layer of the step."""

    #: int64 [T]: where each new token's K/V goes.
    slot_mapping: torch.Tensor
    #: int32 [B+1], [B], [B, max_blocks]: the batch's tensors in the kernels' index type.
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    #: int32 [B_dec]: sequences the decode kernel handles (one new token each).
    decode_seqs: torch.Tensor
    #: int32 [NQB]: for each prefill program row, its sequence and its block's index within
    #: that sequence's new tokens (block ``k`` is tokens ``k*block_q .. k*block_q+block_q``).
    qblock_seq: torch.Tensor
    qblock_idx: torch.Tensor
    #: Query tokens per prefill block (the config's ``prefill_block_q``).
    block_q: int
    block_size: int
    #: Host-side: longest sequence, to size the decode split.
    max_seq_len: int


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton kernels, for any device Triton compiles for.

    On CPU tensors it runs only in Triton's interpreter (``TRITON_INTERPRET=1`` set before
    triton is first imported), which is how the kernels are tested without a GPU.

    :param config: launch parameters; the platform's tuning.
    """

    name = "triton"
    #: int8 / fp8 pages (``quire.ops.kv_quant``): written by torch ops, dequantised in
    #: the attention kernels.
    kv_cache_dtypes = ("int8", "fp8")
    kv_int8_hadamard = True

    def __init__(self, config: TritonAttentionConfig | None = None) -> None:
        self.config = config or TritonAttentionConfig()

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """:raises ValueError: for a block size < 1 or a head size outside 1..256."""
        _check_block_size(block_size)
        # a quantised cache asks at D + D / 8 (its rows hold their scales; D a multiple
        # of 16): D alone is checked
        scaled = kv_head_size(head_size, torch.int8)
        _check_head_size(scaled if head_size > MAX_HEAD_SIZE
                         and kv_row_size(scaled, torch.int8) == head_size else head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        """Split sequences into decode and prefill, and map prefill blocks to sequences.

        The mapping is built from the host-side ``query_lens`` with tensor ops (no loop
        over tokens, no device sync) and copied to the device once.

        :raises ValueError: when ``query_lens`` disagrees with the number of tokens, the
            block size is < 1, or ``block_tables`` is narrower than the longest sequence.
        """
        if sum(batch.query_lens) != batch.num_tokens:
            raise ValueError(
                f"query_lens sum to {sum(batch.query_lens)} but slot_mapping holds "
                f"{batch.num_tokens} tokens"
            )
        _check_block_size(batch.block_size)
        n_blocks = -(-batch.max_seq_len // batch.block_size)
        if n_blocks > batch.block_tables.shape[1]:
            raise ValueError(
                f"block_tables has {batch.block_tables.shape[1]} columns but a sequence of "
                f"{batch.max_seq_len} tokens needs {n_blocks} blocks of {batch.block_size}"
            )
        device = batch.seq_lens.device
        block_q = self.config.prefill_block_q
        q_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
        decode = (q_lens == 1) & self.config.use_decode_kernel
        prefill_seqs = torch.nonzero(~decode & (q_lens > 0)).squeeze(1)
        blocks = (q_lens[prefill_seqs] + block_q - 1) // block_q
        first_block = torch.cumsum(blocks, 0) - blocks
        qblock_seq = torch.repeat_interleave(prefill_seqs, blocks)
        qblock_idx = torch.arange(qblock_seq.numel()) - torch.repeat_interleave(first_block, blocks)

        def to_device(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=device, dtype=torch.int32)

        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping.to(torch.int64),
            query_start_loc=to_device(batch.query_start_loc),
            seq_lens=to_device(batch.seq_lens),
            block_tables=to_device(batch.block_tables),
            decode_seqs=to_device(torch.nonzero(decode).squeeze(1)),
            qblock_seq=to_device(qblock_seq),
            qblock_idx=to_device(qblock_idx),
            block_q=block_q,
            block_size=batch.block_size,
            max_seq_len=batch.max_seq_len,
        )

    def update_metadata(self, metadata: TritonAttentionMetadata, batch: AttentionBatch) -> bool:
        """For a graph's replay: a batch of one new token per sequence, as many sequences
        as ``metadata`` was built for, copied into its tensors (the int32 conversion in
        the copy). The decode split stays the capture's, sized for its ``max_seq_len``:
        a shorter sequence leaves some shares empty, which the merge weighs as 0."""
        b = metadata.seq_lens.shape[0]
        if (batch.num_seqs != b or batch.num_tokens != b
                or metadata.slot_mapping.shape[0] != b
                or batch.block_size != metadata.block_size
                or batch.block_tables.shape != metadata.block_tables.shape
                or batch.max_seq_len > metadata.max_seq_len):
            return False
        for dst, src in ((metadata.slot_mapping, batch.slot_mapping),
                         (metadata.query_start_loc, batch.query_start_loc),
                         (metadata.seq_lens, batch.seq_lens),
                         (metadata.block_tables, batch.block_tables)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        return True

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> None:
        _check_cache(kv_cache, metadata.block_size)
        _check_device(key)
        if kv_cache.dtype in QUANTIZED_KV_TORCH_DTYPES:  # every slot >= 0 (no graphs)
            from quire.ops.kv_quant import write_kv

            write_kv(kv_cache, metadata.slot_mapping, key, value)
            return
        _kernels().write_kv(
            _dense_rows(key), _dense_rows(value), kv_cache[0], kv_cache[1],
            metadata.slot_mapping, num_warps=self.config.num_warps,
        )

    def kv_slots(self, metadata: TritonAttentionMetadata) -> torch.Tensor:
        """The step's slots: the cache is the paged layout, so the op set's
        ``rotary_write_kv`` writes K/V with the rotation, and layers call :meth:`attend`."""
        return metadata.slot_mapping

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        check_attention_options(sliding_window, logits_soft_cap)
        _check_cache(kv_cache, metadata.block_size)
        _check_device(query)
        hq, hkv = query.shape[1], kv_cache.shape[3]
        if kv_row_size(query.shape[2], kv_cache.dtype) != kv_cache.shape[4] or hq % hkv != 0:
            raise ValueError(
                f"query [T, {hq}, {query.shape[2]}] does not fit a cache of {hkv} kv heads "
                f"of size {kv_cache.shape[4]} (Hq must be a multiple of Hkv)"
            )
        query = _dense_rows(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        kernels = _kernels()
        cfg = self.config
        common = dict(
            scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        kernels.decode_attention(
            out, query, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.seq_lens, metadata.decode_seqs,
            num_splits=self.decode_splits(metadata, hkv, sliding_window),
            tile_n=cfg.decode_tile_n, **common,
        )
        kernels.prefill_attention(
            out, query, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.seq_lens, metadata.qblock_seq, metadata.qblock_idx,
            block_q=metadata.block_q, max_rows=cfg.prefill_max_rows,
            tile_n=cfg.prefill_tile_n, **common,
        )
        return out

    def decode_splits(
        self, metadata: TritonAttentionMetadata, num_kv_heads: int, sliding_window: int | None
    ) -> int:
        """Key shares per decode sequence: a power of two, 1 when the batch fills the device.

        From host-side numbers only (the longest sequence stands in for all), so no sync.
        """
        cfg = self.config
        programs = int(metadata.decode_seqs.shape[0]) * num_kv_heads
        if programs == 0 or programs >= cfg.decode_split_target:
            return 1
        span = metadata.max_seq_len
        if sliding_window is not None:  # a window may straddle one extra tile
            span = min(span, sliding_window + cfg.decode_tile_n)
        tiles = -(-span // cfg.decode_tile_n)
        wanted = min(
            tiles // cfg.decode_min_tiles_per_split,
            -(-cfg.decode_split_target // programs),
            cfg.decode_max_splits,
        )
        # Powers of two only: NUM_SPLITS is a compile-time constant, so this bounds the
        # number of compiled variants to log2(decode_max_splits) + 1.
        return 1 << (max(1, wanted).bit_length() - 1)


def _kernels() -> ModuleType:
    """The kernel module; importing it imports triton, so it happens on first use only."""
    from quire.kernels import triton_attention

    return triton_attention


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def _check_head_size(head_size: int) -> None:
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(
            f"the triton attention backend supports head sizes 1..{MAX_HEAD_SIZE}, "
            f"got {head_size}"
        )


def _check_cache(kv_cache: torch.Tensor, block_size: int) -> None:
    """The cache has our layout, a supported dtype and a dense head dim."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[2] != block_size:
        raise ValueError(
            f"kv_cache of shape {tuple(kv_cache.shape)} is not [2, num_blocks, "
            f"{block_size}, Hkv, D]"
        )
    quantized = kv_cache.dtype in QUANTIZED_KV_TORCH_DTYPES
    if kv_cache.dtype not in SUPPORTED_DTYPES and not quantized:
        raise ValueError(f"the triton attention backend does not support cache dtype "
                         f"{kv_cache.dtype}; use float32, float16 or bfloat16 (or int8 / "
                         f"float8_e4m3fn pages with scales)")
    _check_head_size(kv_head_size(kv_cache.shape[4], kv_cache.dtype))
    if quantized and not kv_cache.is_contiguous():
        raise ValueError("quantised kv_cache pages must be contiguous")
    if kv_cache.stride(-1) != 1:
        # A copy would silently drop writes, so a strided head dim is refused, not fixed.
        raise ValueError("kv_cache's head dim must be contiguous (stride 1)")


def _check_device(tensor: torch.Tensor) -> None:
    """CPU tensors only work in the interpreter; say so instead of failing in the launch."""
    if tensor.device.type == "cpu" and not _kernels().INTERPRETED:
        raise RuntimeError(
            "the triton attention backend got CPU tensors, but triton was imported without "
            "TRITON_INTERPRET=1; set it before triton is first imported to run on CPU"
        )


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a contiguous last dim (the kernels' only layout assumption on inputs)."""
    return x if x.stride(-1) == 1 else x.contiguous()
