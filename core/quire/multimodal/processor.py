"""A prompt and its images -> token ids with each image's placeholder expanded, and one
:class:`~quire.multimodal.inputs.MMItem` per image, by the model's own processor
(transformers' ``AutoProcessor``: its image processor and its placeholder expansion,
never a re-implementation).

Prompts name images with the model's placeholder (``<image>`` for LLaVA), one per image
in order, as vLLM's do. Runs in the engine's front (the server's tokenizer threads).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quire.executor.array import Array
from quire.multimodal.inputs import MMItem, content_hash, runs_of

#: The default of ``limit_mm_per_prompt``: images one prompt may carry.
DEFAULT_IMAGE_LIMIT = 4


@dataclass(frozen=True)
class ImageFamily:
    """What differs between image-text families on the front's side."""

    #: The prompt text that stands for one image.
    placeholder: str
    #: The token id each embedding takes the place of.
    image_token_id: Callable[[Any], int]
    #: The processor's batched outputs -> one dict per image.
    split: Callable[[dict[str, torch.Tensor], int], list[dict[str, torch.Tensor]]]
    #: One image's inputs -> the number of embeddings (placeholder tokens) it has.
    num_embeds: Callable[[Any, dict[str, torch.Tensor]], int]
    #: Its image tokens attend to each other both ways (Gemma 3): the engine never cuts
    #: an image across steps.
    bidirectional: bool = False
    #: For a model with M-RoPE positions (Qwen2.5-VL): one image's inputs -> the (t, h, w)
    #: grid of its embeddings (``MMItem.grid``); None: the model's positions are plain.
    mrope_grid: Callable[[Any, dict[str, torch.Tensor]], tuple[int, int, int]] | None = None
    #: The model's path -> its processor, where ``AutoProcessor`` cannot build it here;
    #: None: ``AutoProcessor``.
    make_processor: Callable[[str], Any] | None = None


def split_first_dim(out: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Per image: each processor output's row ``i`` (outputs batched by image)."""
    return [{key: value[i:i + 1] for key, value in out.items()} for i in range(n)]


#: ``config.model_type`` -> the module whose ``IMAGE_FAMILY`` describes it (imported on
#: use: the model code's module, which knows its own processor's outputs).
FAMILIES: dict[str, str] = {
    "llava": "quire.models.llava",
    "idefics3": "quire.models.idefics3",
    "llava_next": "quire.models.llava_next",
    "qwen2_5_vl": "quire.models.qwen2_5_vl",
    "gemma3": "quire.models.gemma3_mm",
}


def image_family(config: Any) -> ImageFamily | None:
    """The family of an image-text model's config, None for a text model."""
    if not takes_images(config):
        return None
    return importlib.import_module(FAMILIES[config.model_type]).IMAGE_FAMILY


#: Processor outputs that are the text's, not an image's.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def takes_images(config: Any) -> bool:
    """Whether a model config is an image-text model Quire serves (a text-only Gemma 3
    built from a GGUF file may share the model type, never a vision config)."""
    return getattr(config, "model_type", None) in FAMILIES \
        and getattr(config, "vision_config", None) is not None


class ImageInputs:
    """One model's image preprocessing. Thread-safe (its processor is called under a
    lock: transformers' processors keep state in their tokenizer).

    :param limit: images one prompt may carry (``limit_mm_per_prompt``).
    :raises ValueError: for a model that takes no images.
    """

    def __init__(self, model_path: str, config: Any, limit: int = DEFAULT_IMAGE_LIMIT
                 ) -> None:
        from transformers import AutoProcessor

        family = image_family(config)
        if family is None:
            raise ValueError(f"this model ({getattr(config, 'model_type', None)}) takes no "
                             f"images")
        self.family = family
        self.config = config
        self.limit = limit
        self.placeholder = family.placeholder
        self.image_token_id = family.image_token_id(config)
        self.hf = (family.make_processor(model_path) if family.make_processor is not None
                   else AutoProcessor.from_pretrained(model_path))
        self._lock = threading.Lock()

    def process(self, prompt: str, images: Sequence[Any], add_special_tokens: bool = True
                ) -> tuple[list[int], list[MMItem]]:
        """Token ids of ``prompt`` with each placeholder expanded, and its images.

        :param images: PIL images, in the order of their placeholders.
        :param add_special_tokens: as the tokenizer takes it (False for a rendered chat
            template, which placed them itself).
        :raises ValueError: when the prompt names another number of images than given,
            more than the limit, or the processor's expansion does not match.
        """
        named = prompt.count(self.placeholder)
        if len(images) > self.limit:
            raise ValueError(f"{len(images)} images in one prompt; at most {self.limit} "
                             f"(limit_mm_per_prompt)")
        if named != len(images):
            raise ValueError(f"the prompt names {named} image(s) with "
                             f"{self.placeholder!r} but {len(images)} were given; put "
                             f"one {self.placeholder!r} where each image goes")
        if not images:
            with self._lock:
                return list(self.hf.tokenizer(
                    prompt, add_special_tokens=add_special_tokens)["input_ids"]), []
        with self._lock:
            out = self.hf(text=prompt, images=list(images), return_tensors="pt",
                          add_special_tokens=add_special_tokens)
        ids = [int(t) for t in out["input_ids"][0]]
        pixels = {k: v for k, v in out.items()
                  if k not in _TEXT_KEYS and isinstance(v, torch.Tensor)}
        per_image = self.family.split(pixels, len(images))
        counts = [self.family.num_embeds(self.config, image) for image in per_image]
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != sum(counts):
            raise ValueError(f"the processor put {len(positions)} image tokens in the "
                             f"prompt, but its {len(images)} image(s) have {sum(counts)} "
                             f"embeddings")
        grid = self.family.mrope_grid
        items, at = [], 0
        for image, count in zip(per_image, counts):
            items.append(MMItem(content_hash(image), runs_of(positions[at:at + count]),
                                {k: Array.of(v) for k, v in image.items()},
                                grid(self.config, image) if grid is not None else ()))
            at += count
        return ids, items
