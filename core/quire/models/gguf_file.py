"""GGUF files (llama.cpp's format) read back into Hugging Face names, layouts and config.

What llama.cpp's converter changed, and what this module undoes:

- *Names*: ``token_embd``, ``blk.N.attn_q`` ... instead of ``model.embed_tokens``,
  ``model.layers.N.self_attn.q_proj`` ... (table :data:`BLOCK_NAMES`).
- *Dimension order*: GGUF lists dimensions fastest-first (``[in, out]`` for a weight).
  Reading the bytes in order gives the row-major ``[out, in]`` tensor (the dims reversed).
- *Quantisation*: every tensor is dequantised to float32 (F16/BF16 too), one tensor at
  a time, by :mod:`quire.models.gguf_reader` (the same float32 operations as
  ``gguf.quants``, whole tensors at once in torch; ``gguf.quants`` for other types).
- *Q/K rows, llama architecture only*: for its interleaved rope kernel the converter
  reorders each head's rows of ``q_proj``/``k_proj`` (weights and biases) from
  rotate-half pairs ``(i, i + D/2)`` to adjacent pairs ``(2i, 2i + 1)``. Qwen2/Qwen3 use
  llama.cpp's NeoX rope and are stored unpermuted. (transformers' GGUF loader agrees:
  it un-permutes for ``llama`` only.)
- *Gemma 3 norms*: the converter stores every ``(1 + weight)`` norm as ``weight + 1``;
  this module subtracts the 1 again (in float32, as transformers' GGUF loader does), and
  maps Gemma's four per-layer norms (:data:`ARCH_BLOCK_NAMES`).
- *Config*: transformers builds the config from the metadata; this module adds what it
  leaves out for these families: ``head_dim`` from ``attention.key_length``,
  ``attention_bias``/``mlp_bias`` from the bias tensors present, rope scaling from
  ``rope.scaling.*`` (linear, yarn), and the ``rope_freqs`` tensor (Llama 3.1's
  frequency divisors) as ``config.rope_freq_factors`` (not in the rope parameters,
  whose keys transformers checks and warns about, once per config it builds).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PretrainedConfig

from quire.models.gguf_reader import dequantize, quantized, read_gguf_index
from quire.models.gguf_rotary_rows import RowsSource, rotary_rows
from quire.quantization.tensor import QuantizedTensor

#: GGUF ``general.architecture`` values this reader maps.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

#: Tensors outside the blocks: GGUF name -> Hugging Face module path.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
#: Per-block tensors: GGUF name (after ``blk.N.``) -> HF path (after ``model.layers.N.``).
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: Per-architecture differences from :data:`BLOCK_NAMES` (Gemma's sandwich norms).
ARCH_BLOCK_NAMES = {
    "gemma3": {
        **BLOCK_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
#: Architectures whose converter stored ``(1 + weight)`` norms as ``weight + 1``.
NORM_PLUS_ONE_ARCHITECTURES = ("gemma3",)
#: Tensors that are settings rather than weights; read into the config instead.
CONFIG_TENSORS = ("rope_freqs.weight",)

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face parameter name of a GGUF tensor of architecture ``arch``.

    :raises ValueError: for a name this reader does not know.
    """
    block_names = ARCH_BLOCK_NAMES.get(arch, BLOCK_NAMES)
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.fullmatch(gguf_name)
    if m and m.group(1) in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name known to quire")


def unpermute_rows(rows: Any, num_heads: int) -> Any:
    """Undo llama.cpp's per-head q/k row interleave (see the module docs).

    :param rows: [num_heads * D, ...] (a weight or a bias), numpy array or torch tensor.
    """
    head_pairs = rows.shape[0] // num_heads // 2
    return (
        rows.reshape(num_heads, head_pairs, 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def iter_gguf_weights(path: str, keep_blocks: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield (HF name, tensor) for every weight in the file, one at a time.

    :param keep_blocks: 2-D weights come as their blocks
        (:class:`~quire.quantization.tensor.QuantizedTensor`, views of a copy-on-write
        map of the file; llama's q/k rows in rotary order from the file
        :mod:`~quire.models.gguf_rotary_rows` keeps, or, where the cache cannot be
        written, reordered inside the map); norms and other 1-D tensors as float32
        always. Otherwise every tensor is dequantised to
        float32; F32 tensors are views of the map, which the model's weight loaders copy
        into their parameters.
    :raises ValueError: for an unsupported architecture, an unknown tensor name, or
        (``keep_blocks``) a tensor type quire does not run, before any tensor is read.
    """
    index = read_gguf_index(path)
    arch = index.metadata.get("general.architecture")
    _check_architecture(arch, path)
    num_heads = int(index.metadata[f"{arch}.attention.head_count"])
    num_kv_heads = int(index.metadata.get(f"{arch}.attention.head_count_kv") or num_heads)
    weights = [t for t in index.tensors if t.name not in CONFIG_TENSORS]
    names = [hf_tensor_name(t.name, arch) for t in weights]  # unknown names: refused now
    blocks = {t.name: quantized(t) for t in weights if keep_blocks and len(t.dims) == 2}
    heads_of = {t.name: (num_heads if ".q_proj." in name else num_kv_heads
                         if ".k_proj." in name else 0) if arch == "llama" else 0
                for t, name in zip(weights, names)}
    # each q/k weight's rows in rotary order: from the rows file, else reordered in the map
    orders = {t.name: unpermute_rows(torch.arange(blocks[t.name].rows), heads_of[t.name])
              for t in weights if t.name in blocks and heads_of[t.name]}
    rotary = rotary_rows(path, [RowsSource(t.name, blocks[t.name], t.offset, orders[t.name])
                                for t in weights if t.name in orders]) or {}
    for tensor, name in zip(weights, names):
        heads = heads_of[tensor.name]
        if tensor.name in blocks:
            data = blocks.pop(tensor.name)
            if tensor.name in rotary:
                data = rotary.pop(tensor.name)
            elif tensor.name in orders:  # the cache is not writable
                data.reorder_rows_(orders[tensor.name])
            yield name, data
            continue
        data = dequantize(tensor)
        if arch in NORM_PLUS_ONE_ARCHITECTURES and tensor.name.endswith("norm.weight"):
            data = data - 1
        if heads:
            data = unpermute_rows(data, heads)
        yield name, data


def load_gguf_config(path: str) -> PretrainedConfig:
    """The Hugging Face config of a GGUF file, completed for these families.

    :raises ValueError: for an unsupported architecture or rope scaling type.
    """
    # what this module adds comes from the scalars and the tensor index, which
    # read_gguf_index reads without the vocabulary's arrays
    index = read_gguf_index(path)
    arch = index.metadata.get("general.architecture")
    _check_architecture(arch, path)
    directory, name = os.path.split(os.path.abspath(path))
    from transformers import AutoConfig  # a conversion's only (gguf_hf_cache caches it)

    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    key_length = index.metadata.get(f"{arch}.attention.key_length")
    if key_length:
        config.head_dim = int(key_length)
    # No metadata says whether projections have biases; the tensors present do.
    tensors = {tensor.name: tensor for tensor in index.tensors}
    if "blk.0.attn_q.bias" in tensors:
        config.attention_bias = True
    if "blk.0.ffn_up.bias" in tensors:
        config.mlp_bias = True
    factors = tensors.get("rope_freqs.weight")
    if factors is not None:  # beside the rope parameters, which transformers validates
        config.rope_freq_factors = dequantize(factors).flatten().tolist()
    updates = _rope_updates(index.metadata, arch)
    if updates:
        _update_rope(config, updates)
    return config


def _rope_updates(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    updates: dict[str, Any] = {}
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        updates["rope_type"] = scaling
        updates["factor"] = float(metadata[f"{arch}.rope.scaling.factor"])
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            updates["original_max_position_embeddings"] = int(original)
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported (linear, yarn)")
    return updates


def _update_rope(config: PretrainedConfig, updates: dict[str, Any]) -> None:
    # transformers v5 keeps rope settings in rope_parameters; older ones in rope_scaling.
    # Gemma 3 keeps one dict per layer kind; GGUF rope scaling is its global layers'.
    per_kind = getattr(config, "rope_parameters", None)
    if isinstance(per_kind, dict) and isinstance(per_kind.get("full_attention"), dict):
        config.rope_parameters = {**per_kind,
                                  "full_attention": {**per_kind["full_attention"], **updates}}
    elif isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters = {**config.rope_parameters, **updates}
    else:
        config.rope_scaling = {**(getattr(config, "rope_scaling", None) or {}), **updates}


def _check_architecture(arch: Any, path: str) -> None:
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
