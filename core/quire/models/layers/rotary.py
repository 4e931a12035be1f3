"""Rotary position embedding (RoPE) on a flattened batch.

Two parts:

- *Inverse frequencies* per rope type, computed here from the checkpoint's config the
  way Hugging Face defines each type, so angles agree with the reference to rounding.
  Both config styles are read: transformers v5's ``config.rope_parameters`` dict, and the
  older ``config.rope_theta`` plus ``config.rope_scaling`` dict.
- :class:`RotaryEmbedding`: a cos/sin table for every position up to its
  ``max_position``, indexed by each step's positions. The rotation is the "rotate half"
  (GPT-NeoX) style Llama, Mistral and Qwen use: dimension ``i`` pairs with ``i + D/2``.
  On the host the table is filled as positions reach it: a long context's table is
  large (``max_position`` rows of ``2D`` floats, per table), and untouched rows of an
  empty tensor hold no memory. On a device it is filled whole when the module moves.

Supported types and where they differ from Hugging Face:

=============  ===========================================================================
``default``    ``1 / theta^(2i/D)``
``linear``     default divided by ``factor`` (position interpolation)
``dynamic``    NTK-aware; frequencies as HF uses them for sequences up to
               ``max_position_embeddings``, which is the default's. HF recomputes them
               for a longer batch; a paged cache cannot (keys already written keep their
               angles), so the table stops at ``max_position_embeddings``.
``yarn``       NTK-by-parts with the attention factor (``mscale``) folded into cos/sin;
               the table covers ``original_max_position_embeddings * factor``.
``llama3``     Llama 3.1's smoothed low-frequency scaling
``longrope``   short factors below ``original_max_position_embeddings``, long factors
               from there on, *per position*. HF switches a whole sequence to the long
               factors once it passes that length; cached keys cannot be re-rotated, so
               here each position keeps one angle for good.
=============  ===========================================================================

A ``config.rope_freq_factors`` list (what a GGUF file's ``rope_freqs`` tensor holds:
llama.cpp's per-frequency divisors, e.g. Llama 3.1 scaling) divides the inverse
frequencies of any type.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
#: Rows a host table computes at its first step, at least (a short prompt's step).
_FIRST_ROWS = 256


class RotaryEmbedding(nn.Module):
    """cos/sin of ``position * inv_freq`` for positions ``0 .. max_position - 1``.

    :param head_size: ``D``, the rotated size (the whole head).
    :param inv_freq: float32 [D/2].
    :param max_position: number of positions in the table.
    :param attention_scaling: multiplies cos and sin (YaRN's and LongRoPE's factor).
    :param long_inv_freq: float32 [D/2], used from ``long_from`` on (LongRoPE).
    :param long_from: first position that uses ``long_inv_freq``.

    The table is a non-persistent buffer (never in a checkpoint), built in float32. The
    engine's ``.to(dtype=...)`` casts it to the model dtype, which is the same rounding
    Hugging Face applies when it casts its float32 cos/sin to the activations' dtype.
    """

    def __init__(
        self,
        head_size: int,
        inv_freq: torch.Tensor,
        *,
        max_position: int,
        attention_scaling: float = 1.0,
        long_inv_freq: torch.Tensor | None = None,
        long_from: int | None = None,
    ) -> None:
        super().__init__()
        if head_size % 2 or inv_freq.shape != (head_size // 2,):
            raise ValueError(
                f"need an even head size and head_size/2 inverse frequencies; got "
                f"head_size={head_size}, inv_freq of shape {tuple(inv_freq.shape)}"
            )
        self.head_size = head_size
        self.max_position = max_position
        self._inv_freq = inv_freq.float()
        self._long_inv_freq = None if long_inv_freq is None else long_inv_freq.float()
        self._long_from = max_position if long_from is None else long_from
        self._scaling = attention_scaling
        #: Rows of ``cos_sin_cache`` computed so far (:meth:`cover`); the rest is unset.
        self.filled = 0
        # [P, 2D]: cos | cos | -sin | sin, the full-width factors of apply_rotary
        cache = torch.empty(max_position, 2 * head_size, dtype=torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rows(self, start: int, end: int) -> torch.Tensor:
        """Rows ``start .. end - 1`` of the table, float32 ``[end - start, 2D]``."""
        positions = torch.arange(start, end, dtype=torch.int64,
                                 device=self._inv_freq.device).float()
        freqs = positions[:, None] * self._inv_freq[None, :]  # [n, D/2]
        if self._long_inv_freq is not None and self._long_from < end:
            at = max(self._long_from - start, 0)
            freqs[at:] = positions[at:, None] * self._long_inv_freq[None, :]
        cos, sin = freqs.cos() * self._scaling, freqs.sin() * self._scaling
        return torch.cat((cos, cos, -sin, sin), -1)

    def cover(self, end: int) -> None:
        """Make rows up to ``end`` (exclusive, capped at ``max_position``) hold their
        values: at least twice the rows already there, so a growing context fills the
        table in a few steps. Each row is computed on its own, as a whole-table build
        computes it."""
        if end <= self.filled:
            return
        end = min(self.max_position, max(end, 2 * self.filled, _FIRST_ROWS))
        table = self.cos_sin_cache
        self._inv_freq = self._inv_freq.to(table.device)
        if self._long_inv_freq is not None:
            self._long_inv_freq = self._long_inv_freq.to(table.device)
        table[self.filled:end].copy_(self._rows(self.filled, end))
        self.filled = end

    def cover_positions(self, positions: torch.Tensor) -> None:
        """:meth:`cover` the largest of ``positions`` (int64, any shape): a read of one
        host tensor, and nothing once the table is whole (on a device it always is)."""
        if self.filled < self.max_position and positions.numel():
            self.cover(int(positions.max()) + 1)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        # rows moved or cast keep their values; off the host the table is filled whole,
        # so a device step never reads a position back to the host
        module = super()._apply(fn, recurse)
        if self.cos_sin_cache.device.type != "cpu":
            self.cover(self.max_position)
        return module

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's rotation factors for :func:`apply_rotary`, in ``dtype``: cos as
        ``[T, 1, D]`` (the half-width cos twice) and sin as ``[T, 1, D]`` (``-sin | sin``).

        :param positions: int64 [T], each below ``max_position`` (not checked here: that
            would cost a device sync every step; the engine caps its context length).
        """
        self.cover_positions(positions)
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return cos, sin

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.max_position}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, D] queries or keys by :meth:`RotaryEmbedding.forward`'s factors;
    returns a new tensor.

    ``x * cos + roll(x, D/2) * sin`` with ``sin = (-s | s)``: halves ``(x1 c + x2 (-s),
    x2 c + x1 s)``, bit for bit HF's ``x * cos + rotate_half(x) * sin`` (its
    ``rotate_half`` negates ``x2``; here ``s`` is negated in the table, and either
    negation is exact). Four kernels; a decode step runs this once per layer, and
    small kernels are what such a step is made of.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def get_rope(config: Any, head_size: int) -> RotaryEmbedding:
    """Build the rotary embedding a Hugging Face config asks for.

    :raises ValueError: for an unsupported rope type (listing the supported ones),
        per-layer-type rope parameters, or partial rotary.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial rotary (partial_rotary_factor={partial}) is not supported")
    max_pos = int(config.max_position_embeddings)
    base = float(params["rope_theta"])
    kwargs: dict[str, Any] = {"max_position": max_pos}

    if rope_type == "default":
        inv_freq = default_inv_freq(base, head_size)
    elif rope_type == "linear":
        inv_freq = default_inv_freq(base, head_size) / params["factor"]
    elif rope_type == "dynamic":
        inv_freq = _dynamic_ntk_inv_freq(base, head_size, params["factor"], max_pos)
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(base, head_size, params, _original_max(config, params))
    elif rope_type == "yarn":
        original = _original_max(config, params)
        inv_freq, scaling, factor = _yarn(base, head_size, params, original, max_pos)
        kwargs.update(attention_scaling=scaling, max_position=max(max_pos, int(original * factor)))
    else:  # longrope
        original = _original_max(config, params)
        inv_freq, long_inv_freq, scaling = _longrope(base, head_size, params, original, max_pos)
        kwargs.update(attention_scaling=scaling, long_inv_freq=long_inv_freq, long_from=original)

    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        divisor = torch.as_tensor(factors, dtype=torch.float32)
        inv_freq = inv_freq / divisor
        if kwargs.get("long_inv_freq") is not None:
            kwargs["long_inv_freq"] = kwargs["long_inv_freq"] / divisor
    return RotaryEmbedding(head_size, inv_freq, **kwargs)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope settings as one flat dict with ``rope_type`` and ``rope_theta``.

    Reads transformers v5's ``rope_parameters``, else the older ``rope_scaling`` (whose
    type key may be ``type``) with ``rope_theta`` beside it. Returns a copy.

    :raises ValueError: for per-layer-type rope parameters (e.g. Gemma 3's).
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        params = getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"per-layer-type rope parameters are not supported (keys: {sorted(params)})"
        )
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """``1 / base^(2i/dim)`` for ``i < dim/2``, float32."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base**exponents)


def _original_max(config: Any, params: dict[str, Any]) -> int:
    # HF gives a top-level original_max_position_embeddings precedence (Phi-3 keeps it
    # there), then the rope dict, then max_position_embeddings.
    value = getattr(config, "original_max_position_embeddings", None)
    value = value or params.get("original_max_position_embeddings")
    return int(value or config.max_position_embeddings)


def _dynamic_ntk_inv_freq(base: float, dim: int, factor: float, max_pos: int) -> torch.Tensor:
    # HF's formula evaluated at seq_len == max_position_embeddings, the length up to which
    # it keeps these frequencies (the bracket is 1 there, up to rounding, as in HF).
    seq_len = max_pos
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(base, dim)


def _llama3_inv_freq(
    base: float, dim: int, params: dict[str, Any], original: int
) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a ramp between."""
    inv_freq = default_inv_freq(base, dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    low_freq_wavelen = original / low
    high_freq_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    base: float, dim: int, params: dict[str, Any], original: int, max_pos: int
) -> tuple[torch.Tensor, float, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; plus mscale.

    :returns: (inv_freq, attention scaling, factor).
    """
    factor = params.get("factor") or max_pos / original
    scaling = params.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits ``rotations`` times in the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate fully

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_extrapolated = 1.0 / pos_freqs
    inv_interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = inv_interpolated * (1 - extrapolation) + inv_extrapolated * extrapolation
    return inv_freq, float(scaling), float(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(
    base: float, dim: int, params: dict[str, Any], original: int, max_pos: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE: per-frequency rescaling, short and long factor sets.

    :returns: (short inv_freq, long inv_freq, attention scaling).
    """
    factor = params.get("factor") or max_pos / original
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def inv(ext_factors: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base**shape)

    return inv(params["short_factor"]), inv(params["long_factor"]), float(scaling)


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE (Qwen2-VL's M-RoPE) over a :class:`RotaryEmbedding`'s table: each
    token has three positions (time, height, width), and ``sections`` splits the
    ``D/2`` frequencies among them in that order; both halves of the head take the same
    split (transformers' ``mrope_section``).

    :param rope: the table of one-position RoPE (any rope type :func:`get_rope` builds).
    :param sections: frequencies per axis, summing to ``D/2``.
    :raises ValueError: for sections that are not three or do not sum to ``D/2``.
    """

    def __init__(self, rope: RotaryEmbedding, sections: list[int]) -> None:
        super().__init__()
        half = rope.head_size // 2
        if len(sections) != 3 or sum(sections) != half or min(sections) < 0:
            raise ValueError(f"mrope_section {list(sections)} must be three sizes summing "
                             f"to head_dim / 2 = {half}")
        self.rope = rope
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
        # the axis each column of the table's cos | cos | -sin | sin rows reads
        self.register_buffer("axis_of_column", axis.repeat(4)[None, None, :],
                             persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`RotaryEmbedding.forward`'s factors for int64 positions [3, T] (time,
        height, width rows), or [T] (three equal positions: plain RoPE)."""
        if positions.dim() == 1:
            return self.rope(positions, dtype)
        self.rope.cover_positions(positions)
        table = self.rope.cos_sin_cache
        rows = table.index_select(0, positions.reshape(-1)).view(3, positions.shape[1], -1)
        axis = self.axis_of_column.expand(1, positions.shape[1], -1)
        cos_sin = rows.gather(0, axis)[0].to(dtype).unsqueeze(1)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return cos, sin
