"""The reference ops: plain torch, the same operations Hugging Face's models run.

Every platform's op is checked against these on random inputs (``quire conformance``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, offset: float = 0.0
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``(offset + weight) * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    With ``residual``, normalises ``x + residual`` and also returns that sum (the new
    residual stream). Statistics in float32; the normalised value is cast back to the
    input dtype before the weight multiplies it (Llama's order), except with
    ``offset`` (Gemma's ``1 + weight``), where the product is taken in float32 and then
    cast, as Gemma does.

    :param x: [..., H]; :param weight: [H]; :param residual: same shape and dtype as x.
    """
    if residual is not None:
        x = residual + x
        return _rms(x, weight, eps, offset), x
    return _rms(x, weight, eps, offset)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    dtype = x.dtype
    if offset:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (offset + weight.float())).to(dtype)
    if dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float, residual: torch.Tensor | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dimension; with ``residual``, of ``x + residual``, also
    returning that sum. :param x: [..., H]; :param weight: [H]; :param bias: [H] or None.
    """
    if residual is not None:
        x = residual + x
        return F.layer_norm(x, weight.shape, weight, bias, eps), x
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: ``silu(x[..., :I]) * x[..., I:]`` (Llama's gated MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: ``gelu_tanh(x[..., :I]) * x[..., I:]`` (Gemma's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary_write_kv(qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate queries and keys, and write the rotated keys and the values into the pages:
    one layer's rotary embedding fused with its KV write.

    The rotation is ``quire.models.layers.rotary.apply_rotary``'s, ``x * cos + roll(x,
    D/2) * sin`` in ``x``'s dtype (rotate-half pairs: dimension ``i`` with ``i + D/2``);
    the write is the paged backends' (``quire.ops.attention``): key and value of token
    ``t`` to ``kv_cache[0 / 1].view(-1, Hkv, D)[slot_mapping[t]]``. The model calls this
    only where its attention backend names the slots (``AttentionBackend.kv_slots``), and
    then attends without writing.

    :param qk: [T, Hq + Hkv, D]: the query heads, then the key heads.
    :param value: [T, Hkv, D], the cache's dtype.
    :param cos: [T, 1, D] and :param sin: [T, 1, D]: ``RotaryEmbedding.forward``'s
        factors (``cos | cos`` and ``-sin | sin``), any strides.
    :param kv_cache: [2, num_blocks, block_size, Hkv, D]; changed in place at the slots
        of ``slot_mapping`` and nowhere else. int8/fp8 pages (rows of ``D + D / 8``,
        ``quire.ops.kv_quant``): keys and values quantised with a scale per 16 values.
    :param slot_mapping: int [T], each token's slot (``AttentionBatch.slot_mapping``).
    :returns: the rotated queries, [T, Hq, D] (new memory; ``qk`` is not changed).
    """
    num_kv_heads = value.shape[1]
    rotated = qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin
    q, k = rotated.split([qk.shape[1] - num_kv_heads, num_kv_heads], dim=1)
    if kv_cache.dtype in (torch.int8, torch.float8_e4m3fn):  # rows of D + D / 8 with scales
        from quire.ops.kv_quant import write_kv

        write_kv(kv_cache, slot_mapping, k, value)
        return q
    # a view, never a copy: a copy would silently drop the write
    pages = kv_cache.view(2, -1, *kv_cache.shape[3:])
    pages[0].index_copy_(0, slot_mapping.long(), k.to(kv_cache.dtype))
    pages[1].index_copy_(0, slot_mapping.long(), value.to(kv_cache.dtype))
    return q
