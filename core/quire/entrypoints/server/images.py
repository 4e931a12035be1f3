"""Images in chat requests: OpenAI's ``image_url`` parts and Anthropic's ``image`` blocks.

Their shape is checked with the rest of the body; the images are loaded, decoded and
preprocessed with the prompt, all on a tokenizer thread, so a large image never stalls
the event loop. Every refusal is a 400 naming the part (``messages[i].content[j]``):
a text-only model, more images than ``limit_mm_per_prompt``, and whatever the
:class:`~quire.multimodal.media.MediaPolicy` or the decoder refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from quire.entrypoints.server.errors import APIError, bad_request
from quire.multimodal.chat import image_parts, walks_parts
from quire.multimodal.inputs import MMItem
from quire.multimodal.media import MediaPolicy, load_image, load_image_base64
from quire.multimodal.processor import ImageInputs

#: Part types that carry an image, after :func:`openai_part` and :func:`anthropic_block`
#: (each checked part keeps its place in the request as ``where``: Anthropic's turns are
#: merged and reordered before the template sees them).
_IMAGE_TYPES = ("image_url", "image")


@dataclass(frozen=True)
class ImageSupport:
    """What the chat routes need to take images; one per model served."""

    #: The model's image preprocessing; raises ``ValueError`` for a text-only model.
    inputs: Callable[[], ImageInputs]
    #: Where images may come from and how large they may be (from the engine's options;
    #: raises ``ValueError`` for options that cannot make one).
    policy: Callable[[], MediaPolicy]


def openai_part(part: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An ``{"type": "image_url", "image_url": {"url": ...}}`` part, checked for shape
    (``detail`` is allowed and ignored). :raises APIError: 400 naming ``where``."""
    spec = part.get("image_url")
    if not (isinstance(spec, Mapping) and isinstance(spec.get("url"), str)):
        raise bad_request(f"{where} must be {{\"type\": \"image_url\", \"image_url\": "
                          f"{{\"url\": ...}}}}", param=where)
    return {"type": "image_url", "image_url": {"url": spec["url"]}, "where": where}


def anthropic_block(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An ``image`` block whose source is ``{"type": "base64", "media_type", "data"}`` or
    ``{"type": "url", "url"}``, checked for shape. :raises APIError: 400 naming ``where``."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return {"type": "image", "source": {"type": "base64", "data": source["data"],
                                            "media_type": source["media_type"]},
                "where": where}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image", "source": {"type": "url", "url": source["url"]},
                "where": where}
    raise bad_request(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", "
                      f"\"data\"}} or {{\"type\": \"url\", \"url\"}}", param=where)


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether checked messages hold an image part."""
    return any(isinstance(m.get("content"), list)
               and any(p.get("type") in _IMAGE_TYPES for p in m["content"])
               for m in messages)


def image_prompt(messages: list[dict[str, Any]], template: str | None,
                 render: Callable[[list[dict[str, Any]]], str],
                 support: ImageSupport | None) -> tuple[str, list[int], list[MMItem]]:
    """The prompt of ``messages`` that hold images: its text, token ids with each
    image's placeholder expanded, and the images. Blocking (it fetches and decodes).

    :param template: the chat template in force: image parts reach it as
        ``{"type": "image"}`` when it walks parts, else as the placeholder text.
    :param render: the parts made ready -> the prompt text.
    :raises APIError: 400 naming the part (or ``messages``) that cannot be used.
    """
    places = _image_places(messages)
    if support is None:
        raise bad_request(f"{places[0]}: this server takes no images", param=places[0])
    try:
        inputs = support.inputs()
    except ValueError as exc:  # a text-only model
        raise bad_request(f"{places[0]}: {exc}", param=places[0]) from None
    if len(places) > inputs.limit:  # before anything is fetched
        over = places[inputs.limit]
        raise bad_request(f"{over}: {len(places)} images in one request; at most "
                          f"{inputs.limit} (--limit-mm-per-prompt)", param=over)
    try:
        policy = support.policy()
    except ValueError as exc:  # the server's options, not the request
        raise APIError(500, f"this server's media options are invalid: {exc}",
                       type="server_error") from None
    ready, images = image_parts(messages, inputs.placeholder, walks_parts(template),
                                lambda part, _: _load(part, policy))
    text = render(ready)
    try:
        ids, mm = inputs.process(text, images, add_special_tokens=False)
    except ValueError as exc:  # e.g. the text names the placeholder itself
        raise bad_request(str(exc), param="messages") from None
    return text, ids, mm


def _image_places(messages: list[dict[str, Any]]) -> list[str]:
    """Where each image part was in the request, in prompt order."""
    return [p["where"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") in _IMAGE_TYPES]


def _load(part: Mapping[str, Any], policy: MediaPolicy) -> Any:
    """One checked part's image. :raises APIError: 400 naming the part."""
    where = part["where"]
    try:
        if part["type"] == "image_url":
            return load_image(part["image_url"]["url"], where, policy)
        source = part["source"]
        if source["type"] == "base64":
            return load_image_base64(source["data"], source["media_type"], where, policy)
        return load_image(source["url"], where, policy)
    except ValueError as exc:  # MediaError's message starts with where
        message = str(exc) if str(exc).startswith(where) else f"{where}: {exc}"
        raise APIError(400, message, param=where) from None
