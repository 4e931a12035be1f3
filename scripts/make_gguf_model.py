"""Write a GGUF file of random weights shaped like a real Llama model.

Quire and llama.cpp are compared on load time, resident memory and speed at the scale of
Llama 3.2 1B and Llama 3.1 8B without downloading either: what those measure depends on
the shapes and tensor types, not on the values, so random weights give real memory and
speed (and meaningless text). The file loads in llama.cpp and in Quire like a converted
and quantised checkpoint.

Usage::

    python scripts/make_gguf_model.py --preset llama-3.1-8b --type q4_k_m \\
        --output /tmp/llama8b-q4km.gguf [--seed 0] [--layers 8 ...]

Tensor types (``--type``):

- ``q4_k_m`` (default): llama.cpp's ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` mix, as
  ``llama_tensor_get_type_impl`` in ``src/llama-quant.cpp`` picks it for a dense
  (non-MoE, non-70B, non-Falcon) llama model without an imatrix:

  - ``output.weight`` is Q6_K; with tied embeddings (no ``output.weight``) the shared
    ``token_embd.weight`` takes the output's type, Q6_K; untied, ``token_embd`` is Q4_K.
  - ``attn_v`` and ``ffn_down`` of the "use more bits" layers are Q6_K: layer ``i`` of
    ``n`` where ``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2`` (integer division).
    llama.cpp counts ``attn_v`` tensors in file order; this file lists layers in order,
    so the count is the layer index.
  - every other 2-D weight (``attn_q/k/output``, ``ffn_gate/up``) is Q4_K.
  - a row length not divisible by 256 falls back as llama.cpp's
    ``tensor_type_fallback`` does: Q4_K to Q5_0, Q6_K to Q8_0.
- ``q4_0``, ``q8_0``, ``f16``: every 2-D weight of that one type (llama.cpp's
  ``--pure``; its non-pure Q4_0 would still give ``output.weight`` Q6_K).

Norms and ``rope_freqs`` are F32 in every file.

The values: each block's f16 scale fields (``d``, and ``dmin`` for Q4_K) are small,
finite and normal, chosen per type so that the dequantised weights have a standard
deviation near 0.02 and a mean near 0 (for Q4_K, each sub-block's minimum is 7.5 times
its scale, the middle of the 0..15 nibble range); the quantised integers are random bits.
Norm weights are 1. Block layouts are ggml's (``ggml-common.h``).

What a real conversion has that this file imitates or leaves out:

- Llama 3's rope scaling is llama.cpp's ``rope_freqs.weight`` tensor (head_dim / 2
  frequency divisors, computed here as llama.cpp's converter computes them); no
  ``rope.scaling.*`` keys, as the converter writes none for ``llama3``.
- llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` for its rope kernel
  (and Quire un-permutes them on load). Random rows do not care, so none is done here.
- The tokenizer is synthetic, SentencePiece-style (``tokenizer.ggml.model = "llama"``):
  ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens ``<0x00>``..``<0xFF>``, then every
  string of 1, 2, 3... characters over a small alphabet (``▁``, letters, digits, some
  punctuation) until the vocabulary is full, scored so shorter pieces merge first. Each
  piece splits into two shorter pieces of the vocabulary (all shorter lengths are
  complete), so merges can build every piece; text outside the alphabet falls back to
  the byte tokens.

Memory: one tensor is built at a time, in chunks of at most 64 MiB of random input, and
written with ``GGUFWriter.write_tensor_data``; peak memory is about the largest tensor
(the 8B's Q6_K ``output.weight``: 431 MB) plus one chunk.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import string
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.constants import GGML_QUANT_VERSION
from gguf.quants import quant_shape_to_byte_shape

Q = GGMLQuantizationType

#: The synthetic tokenizer's special ids and fixed tokens (see the module docs).
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIXED_TOKENS = ("<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)))
#: The characters of the filler pieces (no ``<``, so none can spell a fixed token).
ALPHABET = "\u2581" + string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'-"


# -- model shapes ------------------------------------------------------------------------

@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1/3.2's ``rope_scaling`` (``rope_type: llama3``) from ``config.json``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context_length: int


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters of a llama-architecture model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    tie_embeddings: bool
    context_length: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    #: None: ``hidden_size // num_heads``.
    head_dim: int | None = None
    rope_scaling: Llama3RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size",
                     "vocab_size", "context_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_size <= 0 or self.head_size % 2:
            raise ValueError(f"head_dim must be positive and even, got {self.head_size}")
        # Every weight's row length is one of these; 32 is the smallest quantised block.
        for name, size in (("hidden_size", self.hidden_size), ("ffn_size", self.ffn_size),
                           ("num_heads * head_dim", self.num_heads * self.head_size)):
            if size % 32:
                raise ValueError(f"{name} ({size}) must be a multiple of 32 (a block)")
        if self.vocab_size < len(FIXED_TOKENS):
            raise ValueError(f"vocab_size ({self.vocab_size}) is below the "
                             f"{len(FIXED_TOKENS)} special and byte tokens")

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


PRESETS: dict[str, ModelShape] = {
    # meta-llama/Llama-3.2-1B config.json
    "llama-3.2-1b": ModelShape(
        hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_size=8192,
        vocab_size=128256, tie_embeddings=True, context_length=131072, head_dim=64,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192)),
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": ModelShape(
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_size=14336,
        vocab_size=128256, tie_embeddings=False, context_length=131072, head_dim=128,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192)),
    # ~1.5 MB; four layers so that Q4_K_M has both Q4_K and Q6_K layers.
    "tiny": ModelShape(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, ffn_size=512,
        vocab_size=1024, tie_embeddings=False, context_length=2048,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192)),
}


# -- tensor types ------------------------------------------------------------------------

#: ``--type`` -> (``general.file_type``, the one weight type; None: the Q4_K_M mix).
FILE_TYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType | None]] = {
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, None),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
}
#: llama.cpp's ``tensor_type_fallback`` for rows not divisible by 256.
_K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: its GGUF name, row-major shape and stored type."""

    name: str
    #: Row-major (``[out, in]`` for a weight); GGUF lists it reversed.
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth, and every third between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def q4_k_m_type(role: str, layer: int, shape: ModelShape) -> GGMLQuantizationType:
    """The Q4_K_M type of a 2-D weight (``role``: ``token_embd``, ``output`` or a block
    tensor such as ``attn_v``; ``layer`` is ignored outside blocks)."""
    if role == "output" or (role == "token_embd" and shape.tie_embeddings):
        return Q.Q6_K
    if role in ("attn_v", "ffn_down") and use_more_bits(layer, shape.num_layers):
        return Q.Q6_K
    return Q.Q4_K


def weight_type(role: str, layer: int, cols: int, shape: ModelShape,
                file_type: str) -> GGMLQuantizationType:
    """The stored type of a 2-D weight with rows of ``cols`` values."""
    uniform = FILE_TYPES[file_type][1]
    qtype = uniform if uniform is not None else q4_k_m_type(role, layer, shape)
    if cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = _K_FALLBACK[qtype]  # only K-quants have 256-blocks; ModelShape checks 32
    return qtype


def plan_tensors(shape: ModelShape, file_type: str) -> list[TensorPlan]:
    """Every tensor of the file, in llama.cpp's converter order.

    :raises ValueError: for an unknown ``file_type``.
    """
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown type {file_type!r}; known: {', '.join(FILE_TYPES)}")
    h, f, d = shape.hidden_size, shape.ffn_size, shape.head_size
    q, kv = shape.num_heads * d, shape.num_kv_heads * d

    def weight(name: str, role: str, layer: int, rows: int, cols: int) -> TensorPlan:
        return TensorPlan(name, (rows, cols), weight_type(role, layer, cols, shape, file_type))

    plans = []
    if shape.rope_scaling is not None:
        plans.append(TensorPlan("rope_freqs.weight", (d // 2,), Q.F32))
    plans.append(weight("token_embd.weight", "token_embd", 0, shape.vocab_size, h))
    block = (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q),
             ("ffn_gate", f, h), ("ffn_up", f, h), ("ffn_down", h, f))
    for i in range(shape.num_layers):
        plans.append(TensorPlan(f"blk.{i}.attn_norm.weight", (h,), Q.F32))
        plans += [weight(f"blk.{i}.{role}.weight", role, i, rows, cols)
                  for role, rows, cols in block[:4]]
        plans.append(TensorPlan(f"blk.{i}.ffn_norm.weight", (h,), Q.F32))
        plans += [weight(f"blk.{i}.{role}.weight", role, i, rows, cols)
                  for role, rows, cols in block[4:]]
    plans.append(TensorPlan("output_norm.weight", (h,), Q.F32))
    if not shape.tie_embeddings:
        plans.append(weight("output.weight", "output", 0, shape.vocab_size, h))
    return plans


# -- random blocks -----------------------------------------------------------------------
#
# Each maker returns ``[n, type_size]`` uint8 blocks. Scales are set so the dequantised
# weights have a standard deviation near TARGET_STD: d = TARGET_STD / (rms of the integer
# scale * std of the centred integer values), times a per-block jitter in [0.75, 1.25).

TARGET_STD = 0.02
_CHUNK_BYTES = 64 << 20


def _random_bytes(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    """``[n, width]`` uniformly random bytes (the generator's raw 64-bit output)."""
    words = rng.bit_generator.random_raw(-(-n * width // 8))
    return words.view(np.uint8)[:n * width].reshape(n, width)


def _f16_field(rng: np.random.Generator, n: int, base: float) -> np.ndarray:
    """``[n, 2]`` bytes: an f16 scale near ``base`` per block."""
    return (base * rng.uniform(0.75, 1.25, n)).astype("<f2").view(np.uint8).reshape(n, 2)


def _one_scale_blocks(size: int, q_std: float):
    """Blocks of ``size`` bytes that open with one f16 scale ``d`` and hold integers ``q``
    whose spread is ``q_std``, so that ``w = d * q`` has a spread near TARGET_STD:
    Q4_0 (18 bytes: d | 16 bytes of nibbles; w = d * (q - 8), std of q - 8: 4.64),
    Q5_0 (22: d | 4 bytes of high bits | 16 of nibbles; w = d * (q - 16): 9.25) and
    Q8_0 (34: d | 32 int8; w = d * q: 73.9)."""
    def blocks(rng: np.random.Generator, n: int) -> np.ndarray:
        out = _random_bytes(rng, n, size)
        out[:, 0:2] = _f16_field(rng, n, TARGET_STD / q_std)
        return out
    return blocks


def _q4_k_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    # d f16 | dmin f16 | 12 bytes: eight 6-bit scales and minima | 128 bytes of nibbles.
    # Sub-block j: w = d * sc[j] * q - dmin * m[j]; with m = sc and dmin = 7.5 d,
    # w = d * sc[j] * (q - 7.5): centred (std of q - 7.5: 4.61; rms of sc in 32..63: 48.2).
    blocks = _random_bytes(rng, n, 144)
    d = (TARGET_STD / (48.2 * 4.61)) * rng.uniform(0.75, 1.25, n)
    blocks[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = (7.5 * d).astype("<f2").view(np.uint8).reshape(n, 2)
    sc = rng.integers(32, 64, (n, 8), dtype=np.uint8)
    blocks[:, 4:16] = _pack_k_scales(sc, sc)
    return blocks


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``[n, 8]`` 6-bit scales and minima -> ggml's 12-byte packing (``get_scale_min_k4``
    read backwards): bytes 0-3 and 4-7 hold sub-blocks 0-3's scales and minima plus the
    top two bits of 4-7's; bytes 8-11 hold the low four bits of 4-7's."""
    low_sc, high_sc, low_m, high_m = sc[:, :4], sc[:, 4:], m[:, :4], m[:, 4:]
    return np.concatenate((low_sc | ((high_sc >> 4) << 6),
                           low_m | ((high_m >> 4) << 6),
                           (high_sc & 0x0F) | ((high_m & 0x0F) << 4)), axis=1)


def _q6_k_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    # 128 bytes low nibbles | 64 bytes high 2 bits | 16 int8 scales | d f16;
    # w = d * scale[j] * (q - 32), q in 0..63 (std 18.5; rms of scales in 8..16: 12.3).
    blocks = _random_bytes(rng, n, 210)
    blocks[:, 192:208] = rng.integers(8, 17, (n, 16), dtype=np.uint8)
    blocks[:, 208:210] = _f16_field(rng, n, TARGET_STD / (12.3 * 18.5))
    return blocks


_BLOCK_MAKERS: dict[GGMLQuantizationType, Callable[[np.random.Generator, int], np.ndarray]] = {
    Q.Q4_0: _one_scale_blocks(18, 4.64),
    Q.Q5_0: _one_scale_blocks(22, 9.25),
    Q.Q8_0: _one_scale_blocks(34, 73.9),
    Q.Q4_K: _q4_k_blocks,
    Q.Q6_K: _q6_k_blocks,
}


def random_tensor(plan: TensorPlan, shape: ModelShape,
                  rng: np.random.Generator) -> np.ndarray:
    """The stored data of one tensor: uint8 blocks ``[rows, bytes per row]`` for a
    quantised type, values otherwise. Built in chunks of rows (bounded temporaries)."""
    if plan.name == "rope_freqs.weight":
        assert shape.rope_scaling is not None
        return llama3_rope_freqs(shape.rope_scaling, shape.rope_theta, shape.head_size)
    if plan.qtype == Q.F32:
        return np.ones(plan.shape, dtype=np.float32)
    if plan.qtype == Q.F16:
        out = np.empty(plan.shape, dtype=np.float16)
    else:
        out = np.empty(quant_shape_to_byte_shape(plan.shape, plan.qtype), dtype=np.uint8)
    rows = plan.shape[0]
    step = max(1, _CHUNK_BYTES // out[0].nbytes)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        out[start:stop] = _random_rows(plan, rng, stop - start)
    return out


def _random_rows(plan: TensorPlan, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` rows of a 2-D F16 or quantised weight, as stored."""
    cols = plan.shape[1]
    if plan.qtype == Q.F16:
        return (rng.standard_normal((n, cols), dtype=np.float32) * TARGET_STD).astype(np.float16)
    block_size, type_size = GGML_QUANT_SIZES[plan.qtype]
    per_row = cols // block_size
    return _BLOCK_MAKERS[plan.qtype](rng, n * per_row).reshape(n, per_row * type_size)


def llama3_rope_freqs(scaling: Llama3RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for llama3 rope scaling: per frequency, the divisor of
    its rotation speed (1 for short wavelengths, ``factor`` for long, smooth between)."""
    low_wavelen = scaling.original_context_length / scaling.low_freq_factor
    high_wavelen = scaling.original_context_length / scaling.high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = ((scaling.original_context_length / wavelen - scaling.low_freq_factor)
                      / (scaling.high_freq_factor - scaling.low_freq_factor))
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(factors, dtype=np.float32)


# -- tokenizer ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Vocabulary:
    """``tokenizer.ggml.tokens``, ``.scores`` and ``.token_type``, index-aligned."""

    tokens: list[str]
    scores: list[float]
    types: list[int]


def synthetic_vocabulary(size: int) -> Vocabulary:
    """``size`` unique tokens: the fixed ones, then filler pieces, shortest first."""
    pieces = (
        "".join(chars)
        for length in itertools.count(1)
        for chars in itertools.product(ALPHABET, repeat=length)
    )
    fillers = list(itertools.islice(pieces, size - len(FIXED_TOKENS)))
    tokens = [*FIXED_TOKENS, *fillers]
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
             + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(fillers))
    scores = [0.0] * len(FIXED_TOKENS) + [-float(i) for i in range(len(fillers))]
    return Vocabulary(tokens, scores, [int(t) for t in types])


# -- the file ----------------------------------------------------------------------------

def _add_metadata(writer: GGUFWriter, shape: ModelShape, file_type: str, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[file_type][0])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.ffn_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_size)
    writer.add_key_length(shape.head_size)
    writer.add_value_length(shape.head_size)
    writer.add_vocab_size(shape.vocab_size)
    vocab = synthetic_vocabulary(shape.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def write_model(path: str, shape: ModelShape, file_type: str = "q4_k_m", seed: int = 0,
                name: str = "random llama") -> Counter[str]:
    """Write the GGUF file and return how many tensors of each type it holds.

    :raises ValueError: for an unknown ``file_type``.
    """
    plans = plan_tensors(shape, file_type)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    _add_metadata(writer, shape, file_type, name)
    for plan in plans:
        if plan.qtype in (Q.F32, Q.F16):
            dtype = np.dtype(np.float32 if plan.qtype == Q.F32 else np.float16)
            writer.add_tensor_info(plan.name, plan.shape, dtype,
                                   math.prod(plan.shape) * dtype.itemsize)
        else:
            byte_shape = quant_shape_to_byte_shape(plan.shape, plan.qtype)
            writer.add_tensor_info(plan.name, byte_shape, np.dtype(np.uint8),
                                   math.prod(byte_shape), raw_dtype=plan.qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for plan in plans:  # streaming: one tensor in memory at a time
            writer.write_tensor_data(random_tensor(plan, shape, rng))
    finally:
        writer.close()
    return Counter(plan.qtype.name for plan in plans)


# -- command line ------------------------------------------------------------------------

#: The integer overrides: ModelShape field (its flag is ``--field-name``) -> help.
_OVERRIDES = {
    "hidden_size": "hidden size",
    "num_layers": "decoder layers",
    "num_heads": "attention heads",
    "num_kv_heads": "key/value heads",
    "head_dim": "head dimension (default: hidden size / heads)",
    "ffn_size": "feed-forward size",
    "vocab_size": "vocabulary size",
    "context_length": "llama.context_length",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--type", choices=list(FILE_TYPES), default="q4_k_m", dest="file_type")
    parser.add_argument("--output", required=True, help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0)
    for field, text in _OVERRIDES.items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, help=text)
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction,
                        help="share token_embd as the output (no output.weight)")
    return parser.parse_args(argv)


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    """The preset with the flags given on the command line applied."""
    names = {f.name for f in fields(ModelShape)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    preset = PRESETS[args.preset]
    if ("hidden_size" in given or "num_heads" in given) and "head_dim" not in given:
        given["head_dim"] = None  # follow the new hidden size / heads
    return replace(preset, **given)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shape = shape_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    counts = write_model(args.output, shape, args.file_type, args.seed,
                         name=f"random {args.preset} {args.file_type} (quire synthetic)")
    seconds = time.perf_counter() - start
    size = os.path.getsize(args.output)
    print(f"{args.output}: {size:,} bytes ({size / 2**20:,.1f} MiB), written in {seconds:.1f} s")
    for qtype, count in sorted(counts.items()):
        print(f"  {qtype:5} {count:4} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
