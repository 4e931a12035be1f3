"""Chat messages with image parts, made ready for a chat template.

OpenAI's ``image_url`` parts (and, offline, vLLM's ``image_pil``) become either
``{"type": "image"}`` parts, for templates that walk a message's parts (Hugging Face's
image-text templates print the model's placeholder for them), or the placeholder text
itself inside a string, for templates that print ``message['content']`` whole. The
images are returned in prompt order, loaded by the caller's function.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: A template that reads a part's ``type`` walks the parts (vLLM calls this "openai").
_WALKS_PARTS = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b""")


def walks_parts(template: str | None) -> bool:
    """Whether a chat template renders list content part by part."""
    return bool(template) and _WALKS_PARTS.search(template) is not None


def image_parts(messages: Sequence[Mapping[str, Any]], placeholder: str, as_parts: bool,
                load: Callable[[Mapping[str, Any], str], Any]
                ) -> tuple[list[dict[str, Any]], list[Any]]:
    """``messages`` with their image parts replaced, and the images in order.

    :param as_parts: give image parts as ``{"type": "image"}`` (else placeholder text).
    :param load: (a part, where it is: ``messages[i].content[j]``) -> the image; it
        raises for a part it cannot load.
    """
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if _is_image(part):
                images.append(load(part, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"} if as_parts
                             else {"type": "text", "text": placeholder})
            else:
                parts.append(dict(part))
        if as_parts:
            out.append({**message, "content": parts})
        else:
            out.append({**message, "content": "\n".join(p.get("text", "") for p in parts)})
    return out, images


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in ("image_url", "image_pil",
                                                              "image")
