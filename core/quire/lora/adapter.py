"""A LoRA adapter in PEFT's format: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``adapter_model.bin``), read and checked against the
base model.

PEFT names a tensor ``base_model.model.<module>.lora_A.weight`` ([r, in]) and
``...lora_B.weight`` ([out, r]), ``<module>`` in Hugging Face's module names
(``model.layers.3.self_attn.q_proj``, ``lm_head``); the update to ``y = W x`` is
``scaling * B (A x)``, ``scaling`` being ``lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``), per module where ``rank_pattern``/``alpha_pattern`` say so. The token
embedding's are ``...embed_tokens.lora_embedding_A`` ([r, vocab]) and
``...lora_embedding_B`` ([hidden, r]): token ``t``'s row gains
``scaling * B A[:, t]``; read here as ``a`` and ``b`` of the same shapes, ``in`` being
the vocabulary.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

#: The module names adapters may target (Hugging Face's): a decoder layer's products,
#: the token embedding and the LM head; other targets (experts) are refused for now.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj", "embed_tokens", "lm_head")
_SUPPORTED = (f"{', '.join(SUPPORTED_MODULES[:7])} of each decoder layer, "
              "embed_tokens and lm_head")
#: Each part's name in PEFT's files: a product's, and the embedding's.
_PARTS = {"A.weight": "A", "B.weight": "B", "embedding_A": "A", "embedding_B": "B"}
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAWeights:
    """One targeted module's update: ``scaling * B (A x)``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's updates by Hugging Face module name (``model.layers.0.mlp.up_proj``)."""

    path: str
    rank: int
    modules: dict[str, LoRAWeights]


def _config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} is not a LoRA adapter: it has no adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{path!r} is a {kind} adapter, not a LoRA adapter")
    return config


def _tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    binary = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ValueError(f"{path!r} has no adapter_model.safetensors nor adapter_model.bin")


def load_adapter(path: str, expected: dict[str, tuple[int, int]], max_rank: int
                 ) -> LoRAAdapter:
    """Read the adapter at ``path`` and check it against the base model.

    :param expected: Hugging Face module name -> (in, out) features of the base model's
        module, for every module an adapter may target.
    :raises ValueError: one line naming the problem: not an adapter, a rank above
        ``max_rank``, a target the model lacks or that is not supported, tensors whose
        shapes say another base model.
    """
    config = _config(path)
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a string is a regular expression: tensors tell)
        for target in targets:
            if target.rpartition(".")[2] not in SUPPORTED_MODULES:
                raise ValueError(f"{path!r}: target module {target!r} is not supported yet "
                                 f"(supported: {_SUPPORTED})")
    tensors = _tensors(path)
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    if config.get("modules_to_save"):
        raise ValueError(f"{path!r}: modules_to_save ({config['modules_to_save']}) are not "
                         "supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if _base_copy(name.removeprefix(_PREFIX), tensor, expected, path):
            continue
        module, _, part = name.removeprefix(_PREFIX).rpartition(".lora_")
        if part not in _PARTS:
            raise ValueError(f"{path!r}: tensor {name!r} is not a LoRA A or B weight "
                             "(DoRA adapters are not supported)")
        pairs.setdefault(module, {})[_PARTS[part]] = tensor
    modules: dict[str, LoRAWeights] = {}
    top = 0
    for module, ab in sorted(pairs.items()):
        short = module.rpartition(".")[2]
        if module not in expected:
            what = ("is not supported yet" if short not in SUPPORTED_MODULES
                    else "does not exist in the base model")
            raise ValueError(f"{path!r}: target module {module!r} {what} (supported: "
                             f"{_SUPPORTED})")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path!r}: {module} has lora_{'B' if 'A' in ab else 'A'} "
                             "missing")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        in_features, out_features = expected[module]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(f"{path!r}: {module} has lora_A {list(a.shape)} and lora_B "
                             f"{list(b.shape)}, the base model's module takes {in_features} "
                             f"and gives {out_features}: the adapter's base model differs")
        if rank > max_rank:
            raise ValueError(f"{path!r}: rank {rank} (of {module}) exceeds max_lora_rank="
                             f"{max_rank}")
        r = _pattern(rank_pattern, module, config.get("r", rank))
        alpha = _pattern(alpha_pattern, module, config.get("lora_alpha", r))
        scaling = alpha / (math.sqrt(r) if rslora else r)
        modules[module] = LoRAWeights(a.float(), b.float(), float(scaling))
        top = max(top, rank)
    if not modules:
        raise ValueError(f"{path!r}: the adapter holds no LoRA weights")
    return LoRAAdapter(path, top, modules)


def _base_copy(name: str, tensor: torch.Tensor, expected: dict[str, tuple[int, int]],
               path: str) -> bool:
    """Whether ``name`` is the copy of the base embedding or LM head that PEFT saves
    beside their adapters (``save_embedding_layers``, in case the vocabulary grew): taken
    to be the base model's, so skipped. A grown vocabulary is refused.

    :raises ValueError: for a copy of another shape than the base model's."""
    module, _, rest = name.rpartition(".base_layer.")
    if rest != "weight" or module.rpartition(".")[2] not in ("embed_tokens", "lm_head"):
        return False
    vocab, hidden = expected.get(module, (None, None))
    if module.endswith("lm_head"):
        hidden, vocab = vocab, hidden
    if tuple(tensor.shape) != (vocab, hidden):
        raise ValueError(f"{path!r}: its {module} has {tensor.shape[0]} rows, the base "
                         f"model's {vocab}: adapters that add tokens are not supported")
    return True


def _pattern(pattern: dict, module: str, default: float) -> float:
    """PEFT's per-module override: the key that ends ``module``'s name, if any."""
    for key, value in pattern.items():
        if module == key or module.endswith("." + key):
            return value
    return default


def expected_modules(config: object) -> dict[str, tuple[int, int]]:
    """Every module an adapter may target in a base model of ``config`` (a Hugging Face
    config of the Llama, Mistral, Qwen2/3 or Gemma 3 families; an MoE model's experts
    are not offered): Hugging Face module name -> (in, out) features (the token
    embedding's: (vocabulary, hidden))."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    q = heads * head_dim
    inter = getattr(config, "intermediate_size", None)
    moe = any(getattr(config, k, None) for k in ("num_experts", "num_local_experts"))
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv),
              "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (q, hidden)}
    if inter and not moe:
        shapes.update({"mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
                       "mlp.down_proj": (inter, hidden)})
    vocab = config.vocab_size
    return {"model.embed_tokens": (vocab, hidden), "lm_head": (hidden, vocab),
            **{f"model.layers.{i}.{name}": shape
               for i in range(config.num_hidden_layers) for name, shape in shapes.items()}}
