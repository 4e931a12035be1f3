"""Qwen2.5-VL (Hugging Face's ``Qwen2_5_VLForConditionalGeneration``): its vision tower
(:mod:`quire.models.vision.qwen2_5_vl`) and our Qwen2 decoder with M-RoPE positions.

An image becomes one embedding per ``merge x merge`` block of its patches, one per
``<|image_pad|>`` token of the prompt (the processor expands one per block), which the
engine puts in place of those tokens' embeddings (``ForwardContext.mm_embeds``). Every
token has three rotary positions (time, height, width): the engine lays them out from
each image's grid (:mod:`quire.multimodal.mrope`) and the runner hands them over as
``ForwardContext.mrope_positions``; ``mrope_section`` splits the frequencies among them
(:class:`~quire.models.layers.rotary.MRotaryEmbedding`). Video is not supported.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers import Qwen2_5_VLProcessor
from transformers.processing_utils import ProcessorMixin

from quire.interfaces.communicator import Communicator
from quire.models.context import ForwardContext
from quire.models.image_text import ImageTextModel
from quire.models.layers.rotary import MRotaryEmbedding, rope_parameters
from quire.models.llama import Qwen2ForCausalLM
from quire.models.pipeline import PipelineStage
from quire.models.vision.qwen2_5_vl import Qwen25VisionTower
from quire.multimodal.processor import ImageFamily
from quire.ops import OpSet

#: transformers' ``mrope_section`` when a config names none.
_DEFAULT_MROPE_SECTION = [16, 24, 24]


def _grid_of(image: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in image["image_grid_thw"].reshape(-1).tolist())
    return t, h, w


def _split(out: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Per image: its rows of ``pixel_values`` (one per patch, the images' patches one
    after the other) and its ``image_grid_thw`` row."""
    grids = out["image_grid_thw"]
    if len(grids) != n:
        raise ValueError(f"the processor gave {len(grids)} image grids for {n} images")
    pixels = out["pixel_values"].split(grids.prod(-1).tolist())
    return [{"pixel_values": p, "image_grid_thw": grids[i:i + 1]}
            for i, p in enumerate(pixels)]


def _merged_grid(config: Any, image: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """The (t, h, w) grid of one image's embeddings: its patch grid over the merge."""
    t, h, w = _grid_of(image)
    merge = config.vision_config.spatial_merge_size
    return t, h // merge, w // merge


def _num_embeds(config: Any, image: dict[str, torch.Tensor]) -> int:
    t, h, w = _merged_grid(config, image)
    return t * h * w


def _torchvision_imports() -> bool:
    """Whether torchvision imports beside this torch (a CPU torch's often does not)."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # missing, or built for another torch
        return False
    return True


class ImageOnlyProcessor(Qwen2_5_VLProcessor):
    """transformers' Qwen2.5-VL processor without its video processor (which needs
    torchvision): images and text only."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                 chat_template: str | None = None) -> None:
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = None
        ProcessorMixin.__init__(self, image_processor, tokenizer,
                                chat_template=chat_template)


def make_processor(model_path: str) -> Any:
    """The checkpoint's processor: ``AutoProcessor``'s, or where torchvision does not
    import, :class:`ImageOnlyProcessor` over its image processor and tokenizer."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if _torchvision_imports():
        return AutoProcessor.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return ImageOnlyProcessor(AutoImageProcessor.from_pretrained(model_path), tokenizer,
                              chat_template=getattr(tokenizer, "chat_template", None))


#: The front's side: ``<|vision_start|><|image_pad|><|vision_end|>`` in prompts, the
#: patches and grid per image, one embedding per merged block, laid out on the grid.
IMAGE_FAMILY = ImageFamily("<|vision_start|><|image_pad|><|vision_end|>",
                           lambda c: int(c.image_token_id), _split, _num_embeds,
                           mrope_grid=_merged_grid, make_processor=make_processor)


class Qwen2_5_VLForConditionalGeneration(ImageTextModel):
    """Qwen2.5-VL over a flattened batch: the Qwen2 decoder's forward at M-RoPE positions,
    with image embeddings in place of the ``<|image_pad|>`` tokens; :meth:`embed_images`
    makes them. The tower lives on the first pipeline stage only.

    :raises ValueError: for a tower or ``mrope_section`` it does not compute, naming the
        config key.
    """

    #: The runner gives it (time, height, width) positions (``ctx.mrope_positions``).
    uses_mrope = True

    def __init__(self, config: Any, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = config
        text = copy.copy(config.text_config)  # the tie is the top level's (transformers v5)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.language_model = (Qwen2ForCausalLM(text, comm) if stage is None
                               else Qwen2ForCausalLM(text, comm, stage=stage))
        decoder = self.language_model.model
        sections = rope_parameters(text).get("mrope_section") or _DEFAULT_MROPE_SECTION
        decoder.rotary_emb = MRotaryEmbedding(decoder.rotary_emb, list(sections))
        first = stage is None or stage.is_first
        self.visual = Qwen25VisionTower(config.vision_config, comm) if first else None
        self.merge = config.vision_config.spatial_merge_size
        self._adopt(self.language_model)

    # -- images ----------------------------------------------------------------------------
    def embed_images(self, images: list[dict[str, torch.Tensor]],
                     ops: OpSet) -> list[torch.Tensor]:
        """Each image's embeddings [t*h*w / merge^2, text hidden], one per placeholder
        token, in order; all images run through the tower as one batch.

        :param images: per image its processor outputs (``pixel_values`` [patches, dim],
            ``image_grid_thw`` [1, 3]).
        """
        assert self.visual is not None
        grids = [_grid_of(image) for image in images]
        pixels = torch.cat([image["pixel_values"] for image in images])
        embeds = self.visual(pixels, grids, ops)
        return list(embeds.split([t * h * w // self.merge ** 2 for t, h, w in grids]))

    # -- the text model --------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """:param positions: int64 [T], used when ``ctx.mrope_positions`` is None (three
            equal positions: a decode graph's capture and replay)."""
        if ctx.mrope_positions is not None:
            positions = ctx.mrope_positions
        return self.language_model(input_ids, positions, ctx, intermediate)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face's names, as the Qwen checkpoints have them (``visual.*``,
        ``model.layers.*``, ``lm_head.*``) or as transformers v5 names them in memory
        (``model.visual.*``, ``model.language_model.*``)."""
        vision: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(("visual.", "model.visual.")):
                    if self.visual is not None:  # else a later pipeline stage's rank
                        vision.append((name.split("visual.", 1)[1], tensor))
                elif name.startswith("model.language_model."):
                    yield "model." + name.removeprefix("model.language_model."), tensor
                else:
                    yield name, tensor

        loaded = {"language_model." + n for n in self.language_model.load_weights(text())}
        if self.visual is not None:
            loaded |= {"visual." + n for n in self.visual.load_weights(vision)}
        return loaded
