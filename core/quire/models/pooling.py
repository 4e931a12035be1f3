"""How an embedding model turns a prompt's hidden states into one vector, and which
checkpoints are embedding models.

A sentence-transformers directory says it in ``modules.json``: the transformer, then a
``Pooling`` module (``1_Pooling/config.json``: mean, CLS or last token) and optionally
``Normalize``. Without one, an encoder (BERT) pools its CLS row and a decoder served with
``task="embed"`` its last token (Qwen3-Embedding's way, vLLM's default), both normalised.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from quire.ops.pooling import POOLING_METHODS

#: Architectures that are encoders: embedding models only, computed in one step, no KV.
ENCODER_ARCHITECTURES = frozenset({"BertModel"})
#: ``task`` values (vLLM's names); ``auto`` settles on one of the others.
TASKS = ("auto", "generate", "embed")

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
#: sentence-transformers' pooling flags -> our method.
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolingConfig:
    """One vector per prompt: ``method`` (mean, cls, last) over its last hidden states,
    then scaled to unit L2 norm when ``normalize``."""

    method: str
    normalize: bool

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, "
                             f"got {self.method!r}")


def is_encoder(model_config: Any) -> bool:
    """Whether the checkpoint's architecture is an encoder (no generation possible)."""
    architectures = getattr(model_config, "architectures", None) or []
    return bool(architectures) and architectures[0] in ENCODER_ARCHITECTURES


def is_sentence_transformers(path: str) -> bool:
    """Whether ``path`` is a sentence-transformers directory (it has ``modules.json``)."""
    return os.path.isfile(os.path.join(path, "modules.json"))


def model_task(path: str, model_config: Any) -> str:
    """What ``task="auto"`` means for this checkpoint: ``embed`` for an encoder or a
    sentence-transformers directory, ``generate`` otherwise."""
    if is_encoder(model_config) or is_sentence_transformers(path):
        return "embed"
    return "generate"


def check_task(task: str, model_config: Any, world_size: int = 1) -> None:
    """:raises ValueError: when an encoder is asked to generate, or to run on more than
        one rank (it is not sharded)."""
    if not is_encoder(model_config):
        return
    name = model_config.architectures[0]
    if task == "generate":
        raise ValueError(f"{name} is an embedding model and cannot generate; serve it "
                         f"with task='embed' (--task embed)")
    if world_size > 1:
        raise ValueError(f"{name} runs on one rank; tensor_parallel_size x "
                         f"pipeline_parallel_size is {world_size}: use 1 (data "
                         f"parallelism replicates it)")


def context_length(path: str, model_len: int) -> int:
    """The context of a checkpoint: ``model_len``, or a sentence-transformers
    directory's ``max_seq_length`` (``sentence_bert_config.json``) when shorter, as vLLM
    reads it (the model was trained to pool no more tokens).

    :raises ValueError: for a ``max_seq_length`` that is not a positive integer.
    """
    file = os.path.join(path, "sentence_bert_config.json")
    if not os.path.isfile(file):
        return model_len
    value = _read_json(file).get("max_seq_length")
    if value is None:
        return model_len
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{file}: max_seq_length must be a positive integer, got {value!r}")
    return min(model_len, value)


def pooling_config(path: str, model_config: Any, method: str | None = None
                   ) -> PoolingConfig:
    """The pooling of an embedding model: ``method`` if given (normalised unless the
    sentence-transformers directory has no ``Normalize``), else the directory's, else
    CLS for an encoder and the last token for a decoder, normalised.

    :raises ValueError: for a sentence-transformers directory this engine cannot
        reproduce (a module other than Transformer, Pooling and Normalize, or a pooling
        mode other than mean, CLS or last token), naming it.
    """
    st = read_sentence_transformers(path) if is_sentence_transformers(path) else None
    if st is not None:
        return PoolingConfig(method or st.method, st.normalize)
    default = "cls" if is_encoder(model_config) else "last"
    return PoolingConfig(method or default, True)


def read_sentence_transformers(path: str) -> PoolingConfig:
    """The pooling a sentence-transformers directory's ``modules.json`` describes.

    :raises ValueError: naming a module or pooling mode that cannot be reproduced.
    """
    modules = _read_json(os.path.join(path, "modules.json"))
    if not isinstance(modules, list):
        raise ValueError(f"{path}/modules.json: expected a list of modules")
    method: str | None = None
    normalize = False
    for module in modules:
        kind = module.get("type")
        if kind == _ST_POOLING:
            method = _st_pooling_method(os.path.join(path, module.get("path", ""),
                                                     "config.json"))
        elif kind == _ST_NORMALIZE:
            normalize = True
        elif kind != _ST_TRANSFORMER:
            raise ValueError(f"{path}/modules.json: the module {kind!r} is not supported "
                             f"(only Transformer, Pooling and Normalize)")
    if method is None:
        raise ValueError(f"{path}/modules.json names no Pooling module")
    return PoolingConfig(method, normalize)


def _st_pooling_method(config_path: str) -> str:
    config = _read_json(config_path)
    on = [key for key, value in config.items()
          if key.startswith("pooling_mode_") and value is True]
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise ValueError(f"{config_path}: pooling modes {on or 'none'} are not supported; "
                         f"exactly one of {', '.join(sorted(_ST_MODES))} must be on")
    if config.get("include_prompt", True) is not True:
        raise ValueError(f"{config_path}: include_prompt=false is not supported")
    return _ST_MODES[on[0]]


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it: {exc}") from None
