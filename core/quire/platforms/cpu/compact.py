"""Float32 weights kept in a smaller encoding that gives every one of them back exactly.

A lone decoding sequence streams the whole model from memory for each token, so its
speed is bytes of weights per token. Many float32 weights carry far fewer bits of
information than 32: those dequantised from a GGUF file (Q4_0, Q4_1, Q8_0: a few bits
and a scale per block of 32) and those upcast from a bf16 checkpoint. :func:`encode`
finds, for a 2-D float32 weight, the smallest of the encodings below that reproduces
**every** weight exactly (bit for bit, except that -0.0 may come back as +0.0, which
adds the same nothing to any sum), and checks that by decoding it with the float32
operations the C kernel uses (``csrc/compact_gemv.c``); when no encoding passes, the
layer keeps plain float32. Products over an encoding are therefore float32 products of the very
same weights, with only the order of the sums changed: this is not quantisation.

Encodings (32 weights per block along the input dimension, which must divide by 32):

- ``a4``: ``w = d * q + m``, ``q`` in 0..15, a float32 ``d`` and ``m`` per block
  (0.75 bytes a weight). Q4_1 and Q4_0 blocks are of this form.
- ``s8``: ``w = d * q``, ``q`` in -128..127, a float32 ``d`` per block (1.125 bytes a
  weight). Q8_0 and Q5_0 blocks are.
- ``bf16``: the weight's upper 16 bits (2 bytes a weight): any bf16 checkpoint.

The scale ``d`` is looked for among the values a quantiser would have stored, rounded to
float16 (what GGUF's legacy formats store); blocks of other quantisers (for example
importance-weighted ones that do not keep the block's extremes) fail the check and the
layer stays float32: slower, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
#: Encodings in the order they are tried (smallest first); the index is the kernel's id.
FORMATS = ("a4", "s8", "bf16")


@dataclass(frozen=True)
class CompactWeight:
    """A ``[out_features, in_features]`` float32 weight in one encoding.

    ``codes``: uint8 ``[out, in / 2]`` (a4: per block of 32, eight little-endian 16-bit
    lanes, lane ``j`` holding the codes of weights ``j``, ``j + 8``, ``j + 16``, ``j + 24``
    in its nibbles 0..3, the order the kernel unpacks), int8 ``[out, in]`` (s8) or int16
    ``[out, in]`` bf16 bits; ``scales`` and ``offsets``: float32 ``[out, in / 32]``
    (``offsets`` a4 only, else an empty tensor).
    """

    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int
    in_features: int

    @property
    def format_id(self) -> int:
        return FORMATS.index(self.format)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def decode(self) -> torch.Tensor:
        """The float32 weight, by the kernel's operations (``d * q`` then ``+ m``)."""
        shape = (self.out_features, self.in_features)
        if self.format == "bf16":
            return self.codes.view(torch.bfloat16).float().view(shape)
        if self.format == "a4":
            q = _unpack_nibbles(self.codes.view(self.out_features, -1, BLOCK // 2))
        else:
            q = self.codes.view(self.out_features, -1, BLOCK)
        w = self.scales.unsqueeze(-1) * q.float()
        if self.format == "a4":
            w = w + self.offsets.unsqueeze(-1)
        return w.view(shape)


def encode(weight: torch.Tensor, formats: tuple[str, ...] = FORMATS) -> CompactWeight | None:
    """The first of ``formats`` that gives ``weight`` back bit for bit, or None.

    :param weight: float32 ``[out, in]`` on the host.
    """
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    out_features, in_features = weight.shape
    # NaN and infinities need no test of their own: no encoding rebuilds them (NaN
    # compares unequal to itself), so the proof below refuses them.
    if in_features % BLOCK or weight.numel() == 0:
        return None
    weight = weight.detach().contiguous()
    for fmt in formats:
        found = _ENCODERS[fmt](weight)
        if found is None:
            continue
        candidate = CompactWeight(fmt, *found, out_features, in_features)
        # The proof: decoding is the float32 arithmetic the kernel does; anything not
        # reproduced exactly is not accepted. Equal as numbers: a -0.0 weight (Q4_0's
        # code 8 under a negative scale) may come back +0.0, which changes no sum.
        if torch.equal(candidate.decode(), weight):
            return candidate
    return None


# -- encoders: a guess per block; encode() checks it ---------------------------------------


def _encode_bf16(weight: torch.Tensor):
    bits = weight.view(torch.int32)
    if bool((bits & 0xFFFF).any()):
        return None
    codes = (bits >> 16).to(torch.int16)
    return codes, torch.empty(0), torch.empty(0)


#: Largest code magnitudes a block's largest weight may have, tried in turn: Q8_0's
#: (+-127 d), then Q5_0's (w = d (q - 16): -16 d, or +15 d when no code is 0).
_S8_PEAKS = (127, 16, 15)


def _encode_s8(weight: torch.Tensor):
    blocks = weight.view(weight.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1)
    d, q = torch.zeros_like(amax), torch.zeros_like(blocks)
    done = torch.zeros_like(amax, dtype=torch.bool)
    for peak in _S8_PEAKS:  # d = amax / peak rounded to float16, as the quantiser stored
        d_try = (amax / peak).half().float()
        q_try = torch.round(blocks / d_try.clamp_min(torch.finfo(torch.float32).tiny)
                            .unsqueeze(-1)).clamp_(-128, 127)
        ok = (q_try * d_try.unsqueeze(-1)).eq(blocks).all(-1)
        take = ok & ~done
        d = torch.where(take, d_try, d)
        q = torch.where(take.unsqueeze(-1), q_try, q)
        done |= ok
        if bool(done.all()):
            break
    if not _few_bits(d, 16):
        return None
    return q.to(torch.int8).view(weight.shape), d, torch.empty(0)


def _encode_a4(weight: torch.Tensor):
    blocks = weight.view(weight.shape[0], -1, BLOCK)
    lo, hi = torch.aminmax(blocks, dim=-1)
    # Q4_1: m is the block's minimum (q = 0), its maximum is q = 15.
    d = ((hi - lo) / 15).half().float()
    m = lo
    q, ok = _nibbles_for(blocks, d, m)
    if not bool(ok.all()):
        # Q4_0: w = d (q - 8); the largest magnitude is q = 0, so d = -it / 8, m = -8 d.
        signed_max = torch.where(hi.abs() >= lo.abs(), hi, lo)
        d0 = (-signed_max / 8).half().float()
        q0, ok0 = _nibbles_for(blocks, d0, -8 * d0)
        if not bool((ok | ok0).all()):
            return None
        use0 = ~ok & ok0
        d = torch.where(use0, d0, d)
        m = torch.where(use0, -8 * d0, m)
        q = torch.where(use0.unsqueeze(-1), q0, q)
    if not _few_bits(d, 20):
        return None
    quarters = q.view(*q.shape[:-1], 4, BLOCK // 4)  # [.., 4, 8]: weights 8i + j
    lanes = (quarters[..., 0, :] | (quarters[..., 1, :] << 4) | (quarters[..., 2, :] << 8)
             | (quarters[..., 3, :] << 12))
    packed = lanes.to(torch.int16).contiguous().view(torch.uint8)  # little-endian lanes
    return packed.view(weight.shape[0], -1), d, m.contiguous()


def _nibbles_for(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """q in 0..15 nearest to (w - m) / d, and whether d * q + m is w for a whole block.

    A zero d is divided by 1 instead: the block then passes only if it is all m.
    """
    m = m.unsqueeze(-1)
    q = (blocks - m).div_(torch.where(d == 0, 1.0, d).unsqueeze(-1)).round_().clamp_(0, 15)
    ok = (q * d.unsqueeze(-1)).add_(m).eq_(blocks).all(-1)
    return q.to(torch.int32), ok


def _few_bits(d: torch.Tensor, bits: int) -> bool:
    """Whether every scale has at most ``bits`` significant bits, so d * q is exact."""
    mantissa = d.view(torch.int32) & 0x7FFFFF
    return not bool((mantissa & ((1 << (24 - bits)) - 1)).any())


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[.., 16]`` bytes of a4 blocks -> ``[.., 32]`` codes in weight order."""
    lanes = packed.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [.., 8]
    return torch.cat([(lanes >> shift) & 0x0F for shift in (0, 4, 8, 12)], dim=-1)


_ENCODERS = {"a4": _encode_a4, "s8": _encode_s8, "bf16": _encode_bf16}
