"""Tokenizer loading, from a Hugging Face directory or from a GGUF file's vocabulary."""

from __future__ import annotations

import json
import os

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from quire.heap import release_freed_heap


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer at ``path``: a checkpoint directory or a ``.gguf`` file.

    :raises ValueError: when no tokenizer can be built from it.
    """
    tokenizer = _load(path)
    # its parse (the JSON as Python objects, many times the file's size) is freed by
    # now: give it back before the weights load, or it adds to their peak
    release_freed_heap()
    return tokenizer


def _load(path: str) -> PreTrainedTokenizerBase:
    try:
        if path.endswith(".gguf"):
            from quire.models.gguf_hf_cache import NO_TOKENIZER, cached_tokenizer, hf_dir_for_gguf

            converted = hf_dir_for_gguf(path)
            if (converted / NO_TOKENIZER).exists():
                reason = (converted / NO_TOKENIZER).read_text().strip()
                raise ValueError(f"the GGUF file has no usable tokenizer ({reason}); "
                                 "pass tokenizer=<a tokenizer directory>")
            return cached_tokenizer(converted)
        from transformers import AutoTokenizer  # here: GGUF starts never import its tables

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, model_path: str
) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's, the model config's, and
    ``generation_config.json``'s (instruct models often list several there)."""
    ids: set[int] = set()
    _add_ids(ids, tokenizer.eos_token_id)
    _add_ids(ids, getattr(config, "eos_token_id", None))
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            _add_ids(ids, json.load(f).get("eos_token_id"))
    return frozenset(ids)


def _add_ids(ids: set[int], value: int | list[int] | None) -> None:
    if value is None:
        return
    if isinstance(value, int):
        ids.add(value)
    else:
        ids.update(int(v) for v in value)
