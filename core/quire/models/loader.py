"""From a checkpoint path to a loaded model: config, weight stream, build and check.

A checkpoint is either a Hugging Face directory (``config.json`` plus ``*.safetensors``,
or ``pytorch_model*.bin`` as a fallback) or a single ``.gguf`` file
(:mod:`quire.models.gguf_file`). Weights are streamed one tensor at a time under
Hugging Face names, so the peak host memory is one tensor, not one checkpoint.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from quire.interfaces.communicator import Communicator
from quire.models.layers.embedding import VocabParallelEmbedding
from quire.models.layers.quantized import (
    install_quantized_kernels,
    prepare_quantized,
    quantized_formats,
)
from quire.models.gguf_file import iter_gguf_weights
from quire.models.gguf_hf_cache import cached_config, hf_dir_for_gguf
from quire.models.pipeline import PipelineStage
from quire.models.registry import ModelRegistry
from quire.ops import OpSet, reference_ops
from quire.plugins.spec import ModelSpec
from quire.quantization.methods import Quantization
from quire.quantization.tensor import QuantizedTensor

logger = logging.getLogger(__name__)


def is_gguf(path: str) -> bool:
    """Whether ``path`` names a GGUF file (by its extension)."""
    return path.lower().endswith(".gguf")


def load_model_config(path: str) -> PretrainedConfig:
    """The Hugging Face config of a checkpoint directory or ``.gguf`` file.

    :raises FileNotFoundError: when ``path`` is neither.
    """
    if is_gguf(path) and os.path.isfile(path):
        return cached_config(hf_dir_for_gguf(path))
    if os.path.isdir(path):
        return lift_text_config(_hf_config(path))
    raise FileNotFoundError(f"{path}: not a checkpoint directory or a .gguf file")


#: Model types transformers does not know whose config is a known family's with extra
#: keys, read as that family's (MiMo: Qwen2's and ``num_nextn_predict_layers``).
SIBLING_CONFIGS = {"mimo": "qwen2"}


def _hf_config(path: str) -> PretrainedConfig:
    """``AutoConfig`` of a checkpoint directory, or its sibling family's config class
    (:data:`SIBLING_CONFIGS`); the ``model_type`` stays the checkpoint's."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        model_type = None
    sibling = SIBLING_CONFIGS.get(model_type or "")
    if sibling is None:
        from transformers import AutoConfig  # here: GGUF starts never import its tables

        return AutoConfig.from_pretrained(path)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = CONFIG_MAPPING[sibling]
    # from_dict: from_pretrained would warn that the model types differ, as they do
    return family.from_dict(family.get_config_dict(path)[0])


def lift_text_config(config: PretrainedConfig) -> PretrainedConfig:
    """An image-text model's config, answering for its language model too: the text
    config's keys that the top level lacks (``vocab_size``, ``num_hidden_layers``,
    ``max_position_embeddings``, ...) are copied up, so the engine reads any model's
    config one way. The model class reads ``text_config`` and ``vision_config``."""
    text = getattr(config, "text_config", None)
    if text is None or getattr(config, "vision_config", None) is None:
        return config
    for key, value in text.to_dict().items():
        if key not in ("architectures", "model_type") and not hasattr(config, key):
            setattr(config, key, value)
    return config


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The floating dtype a checkpoint's config says its weights are stored in (its
    ``dtype``, formerly ``torch_dtype``), or None when it says none (GGUF files: their
    blocks are dequantised to the engine's dtype)."""
    value = getattr(config, "dtype", None) or config.to_dict().get("torch_dtype")
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def checkpoint_quantization(config: PretrainedConfig) -> str | None:
    """The method a checkpoint says it was quantised with (its ``quantization_config``'s
    ``quant_method``: ``gptq``, ``awq``, ``fp8`` ...), or None for a float checkpoint."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    method = found.get("quant_method") if isinstance(found, dict) else getattr(
        found, "quant_method", None)
    return str(method or "unnamed")


def iter_weights(path: str, keep_blocks: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield ``(Hugging Face name, tensor)`` for every weight, on the host.

    In a directory: the files of ``model.safetensors.index.json`` if present, else every
    ``*.safetensors`` (except Mistral's ``consolidated*`` duplicates, which use other
    names); without safetensors, ``pytorch_model*.bin`` (loaded ``weights_only``).

    :param keep_blocks: a GGUF file's 2-D weights come as their blocks
        (:func:`~quire.models.gguf_file.iter_gguf_weights`).
    :raises FileNotFoundError: when the directory holds no weight files.
    :raises ValueError: for a weight file that resolves outside the directory.
    """
    if is_gguf(path):
        yield from iter_gguf_weights(path, keep_blocks=keep_blocks)
        return
    files = _safetensors_files(path)
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    files = _bin_files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model*.bin weights")
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


def load_model(
    path: str,
    comm: Communicator,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    config: PretrainedConfig | None = None,
    extra_models: Iterable[ModelSpec | tuple[ModelSpec, str]] = (),
    stage: PipelineStage | None = None,
    quantization: Quantization | None = None,
    ops: OpSet | None = None,
) -> tuple[nn.Module, PretrainedConfig]:
    """Build the model a checkpoint needs, on ``device`` in ``dtype``, and load it.

    :param comm: the tensor-parallel group; each rank loads only its shards.
    :param config: the checkpoint's config when the caller has read it already
        (reading a GGUF file's metadata takes seconds).
    :param extra_models: plugin model specs (see :class:`ModelRegistry`).
    :param stage: the pipeline stage this rank holds (its layers only), or None.
    :param quantization: how weights are kept (:mod:`quire.quantization.methods`); the
        layers it quantises never hold a float copy of their weight. None: ``none``.
    :param ops: whose ``quantized_linear`` runs the quantised layers (the platform's op
        set); None: the reference.
    :returns: (the model in eval mode, its config).
    :raises ValueError: for an unsupported architecture, a tensor that fits no
        parameter, or a parameter the checkpoint did not provide (all named; a
        ``tie_word_embeddings`` LM head is the embedding and needs nothing).
    """
    config = config if config is not None else load_model_config(path)
    model_cls = ModelRegistry(extra_models).resolve(config)
    # Built on the host with torch.empty: that reserves address space but touches no
    # page, so moving it to the device costs device memory only, in the final dtype.
    if stage is None:
        model = model_cls(config, comm)
    elif getattr(model_cls, "supports_pipeline", False):
        model = model_cls(config, comm, stage=stage)
    else:
        raise ValueError(f"{model_cls.__name__} cannot be split into pipeline stages; "
                         f"use pipeline_parallel_size=1")
    quantization = quantization or Quantization("none")
    if prepare_quantized(model, quantization, device):
        _to_device_except_meta(model, device, dtype)
    else:
        model.to(device=device, dtype=dtype)
    keep_blocks = quantization.method == "gguf"
    loaded = model.load_weights(iter_weights(path, keep_blocks=keep_blocks))
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    if missing:
        shown = ", ".join(missing[:8])
        if len(missing) > 8:
            shown += f", ... ({len(missing)} in all)"
        raise ValueError(f"{path}: the checkpoint does not provide {shown}")
    if quantization.enabled:
        install_quantized_kernels(model, ops or reference_ops())
        for module in model.modules():
            if isinstance(module, VocabParallelEmbedding):
                module.dtype = dtype
        counts = ", ".join(f"{n} {fmt}" for fmt, n in sorted(quantized_formats(model).items()))
        logger.info("quantization %s: %s", quantization.method, counts or "no layer")
    return model.eval(), config


def _to_device_except_meta(model: nn.Module, device: torch.device | str,
                           dtype: torch.dtype) -> None:
    """``model.to(device, dtype)`` for every parameter but the ``meta`` ones (the
    quantised layers' placeholders, which hold nothing to move)."""
    held = [(module, name, param) for module in model.modules()
            for name, param in module._parameters.items()
            if param is not None and param.is_meta]
    for module, name, _ in held:
        module._parameters[name] = None
    model.to(device=device, dtype=dtype)
    for module, name, param in held:
        module._parameters[name] = param


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        return _indexed_files(path, index)
    names = _globbed_names(path, "*.safetensors")
    return _inside(path, [n for n in names if not n.startswith("consolidated")])


def _bin_files(path: str) -> list[str]:
    index = os.path.join(path, "pytorch_model.bin.index.json")
    if os.path.isfile(index):
        return _indexed_files(path, index)
    return _inside(path, _globbed_names(path, "pytorch_model*.bin"))


def _indexed_files(path: str, index: str) -> list[str]:
    """The weight files an index json's ``weight_map`` names, checked by :func:`_inside`."""
    with open(index) as f:
        names = sorted(set(json.load(f)["weight_map"].values()))
    return _inside(path, names)


def _globbed_names(path: str, pattern: str) -> list[str]:
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, pattern)))


def _inside(path: str, names: Iterable[str]) -> list[str]:
    """``path/name`` for each of ``names``, each checked to name a file inside ``path``.

    A checkpoint may be untrusted: its index may name ``../x`` or ``/x``. The check is on
    the names, not on where links lead: a weight file linked to another disk (or the
    Hugging Face cache's ``blobs``) is the owner's arrangement, not the checkpoint's.

    :raises ValueError: naming the file and the directory, for a name that leaves it.
    """
    files = []
    for name in names:
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts:
            raise ValueError(f"{path}: the weight file name {name!r} points outside the "
                             f"checkpoint directory")
        files.append(os.path.join(path, name))
    return files
