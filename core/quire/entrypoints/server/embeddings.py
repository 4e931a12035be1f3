"""``POST /v1/embeddings``: OpenAI's request and response shapes.

``input`` is a string, a list of strings, a list of token ids, or a list of token-id
lists; each becomes one engine request, tokenized with the model's special tokens (as
sentence-transformers does). ``encoding_format`` is ``float`` or ``base64`` (the vector's
little-endian float32 bytes, as OpenAI sends them). ``dimensions`` needs a model trained
to be cut short (Matryoshka), which no model here states, so it is refused, as vLLM does.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from quire.entrypoints.server.errors import bad_request
from quire.entrypoints.server.protocol import RequestBounds, check_text, get
from quire.outputs import EmbeddingRequestOutput

ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingRequest:
    """A checked ``/v1/embeddings`` body, its inputs tokenized."""

    #: (text or None, token ids) per input, in order.
    inputs: list[tuple[str | None, list[int]]]
    encoding_format: str


def parse_embedding(body: Mapping[str, Any], bounds: RequestBounds, *,
                    tokenizer: Any) -> EmbeddingRequest:
    """A ``/v1/embeddings`` body. :raises APIError: 400 naming the bad field."""
    fmt = get(body, "encoding_format", str, "float")
    if fmt not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                          f"got {fmt!r}", param="encoding_format")
    if get(body, "dimensions", int) is not None:
        raise bad_request("dimensions: this model does not support Matryoshka "
                          "representations; its vectors cannot be shortened",
                          param="dimensions")
    get(body, "user", str)
    inputs = _inputs(body.get("input"), bounds)
    return EmbeddingRequest([_encode(item, tokenizer) for item in inputs], fmt)


def _inputs(value: Any, bounds: RequestBounds) -> list[str | list[int]]:
    """The inputs, checked for type, count and size, not yet tokenized."""
    if value is None:
        raise bad_request("input is required", param="input")
    if isinstance(value, str) or _is_token_list(value):
        items = [_one(value, "input")]
    elif not isinstance(value, list) or not value:
        raise bad_request("input must be a string, a list of token ids, or a non-empty "
                          "list of either", param="input")
    elif len(value) > bounds.max_prompts:
        raise bad_request(f"at most {bounds.max_prompts} inputs per request, got "
                          f"{len(value)}", param="input")
    else:
        items = [_one(v, f"input[{i}]") for i, v in enumerate(value)]
    size = sum(len(v.encode("utf-8")) for v in items if isinstance(v, str))
    if size > bounds.max_prompt_bytes:
        raise bad_request(f"the input is {size} bytes of text, more than this server's "
                          f"limit of {bounds.max_prompt_bytes} (--max-prompt-bytes)",
                          param="input")
    return items


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one(value: Any, name: str) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise bad_request(f"{name} must not be empty", param="input")
        return check_text(value, name, "input")
    if _is_token_list(value):
        return list(value)
    raise bad_request(f"{name} must be a non-empty string or a non-empty list of token "
                      f"ids", param="input")


def _encode(item: str | list[int], tokenizer: Any) -> tuple[str | None, list[int]]:
    if isinstance(item, str):
        return item, list(tokenizer.encode(item))
    return None, item


def embedding_response(outputs: Sequence[EmbeddingRequestOutput], model: str,
                       encoding_format: str) -> dict[str, Any]:
    """OpenAI's list of embeddings, in input order, with the prompt tokens used."""
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(out.embedding, encoding_format)}
            for i, out in enumerate(outputs)]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
