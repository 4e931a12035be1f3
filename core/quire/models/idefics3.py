"""Idefics3 and SmolVLM (Hugging Face's ``Idefics3ForConditionalGeneration``): a SigLIP
vision encoder, a connector (pixel shuffle, then one linear) and our Llama decoder.

Idefics3's processor cuts an image into tiles (a grid of crops plus a downscaled global
view) and writes one run of ``<image>`` tokens per tile. Each tile is encoded on its own
(transformers runs the tiles as one batch, each attending within itself), so here each
tile is one :class:`~quire.multimodal.inputs.MMItem`: the processor's outputs do not say
which tiles belong to which image (it drops its rows and columns), and a tile is exactly
the unit whose embeddings depend on its pixels alone. Tiles fill the placeholder runs in
the processor's order, as transformers' ``inputs_merger`` does. The vision part lives on
the first pipeline stage only.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.image_text import ImageTextModel
from quire.models.layers.linear import ColumnParallelLinear
from quire.models.llava import text_model_class
from quire.models.pipeline import PipelineStage
from quire.models.vision.loading import VisionWeights
from quire.models.vision.siglip import SiglipVisionTower
from quire.multimodal.processor import ImageFamily
from quire.ops import OpSet


def split_tiles(out: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """The processor's ``pixel_values`` [B, tiles, 3, H, W] -> one dict per real tile, in
    order; padding tiles (all zero, transformers' own test) are dropped. Equal tiles
    (blank margins, an image given twice) share one hash, so one encoding.

    :param n: the number of images; unused, as the items are tiles.
    :raises ValueError: for a tile with padded pixels (``pixel_attention_mask``)."""
    pixels = out["pixel_values"]
    pixels = pixels.reshape(-1, *pixels.shape[-3:])
    masks = out.get("pixel_attention_mask")
    masks = None if masks is None else masks.reshape(-1, *masks.shape[-2:])
    tiles: list[dict[str, torch.Tensor]] = []
    for i, tile in enumerate(pixels):
        if not bool((tile != 0).any()):
            continue
        if masks is not None and not bool(masks[i].all()):
            raise ValueError("an image tile with padded pixels: Idefics3 images must be "
                             "tiled without padding")
        tiles.append({"pixel_values": tile[None]})
    return tiles


def _num_embeds(config: Any, tile: dict[str, torch.Tensor]) -> int:
    """A tile's embeddings: its patches over the pixel shuffle's ``scale_factor`` squared.

    :raises ValueError: for a tile whose patch grid the shuffle cannot fold."""
    h, w = tile["pixel_values"].shape[-2:]
    side, scale = h // config.vision_config.patch_size, config.scale_factor
    if h != w or side % scale:
        raise ValueError(f"an image tile of {h}x{w} pixels: the pixel shuffle takes square "
                         f"tiles whose patch grid divides by scale_factor={scale}")
    return (side // scale) ** 2


#: The front's side: ``<image>`` in prompts, one item per tile of the processor's output.
IMAGE_FAMILY = ImageFamily("<image>", lambda c: int(c.image_token_id), split_tiles,
                           _num_embeds)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, S, D] -> [N, S / scale^2, D * scale^2]: each ``scale`` x ``scale`` block of
    the square patch grid folded into one row, in transformers' element order."""
    n, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), dim * scale * scale)


class Idefics3Connector(nn.Module):
    """Pixel shuffle, then ``modality_projection`` (no bias) to the text model's width;
    its output features split over the ranks and gathered."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale: int,
                 comm: Communicator) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = ColumnParallelLinear(
            vision_hidden * scale * scale, text_hidden, bias=False, comm=comm,
            gather_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(x, self.scale))


class Idefics3ForConditionalGeneration(ImageTextModel):
    """Idefics3 over a flattened batch: the text decoder's forward with tile embeddings
    in place of the ``<image>`` tokens; :meth:`embed_images` makes them.

    :raises ValueError: for a vision or text model it does not compute, naming it.
    """


    def __init__(self, config: Any, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = config
        vision = config.vision_config
        if getattr(vision, "model_type", "") != "idefics3_vision":
            raise ValueError(f"{type(self).__name__}: vision_config.model_type "
                             f"{getattr(vision, 'model_type', None)!r} is not supported; "
                             f"only 'idefics3_vision'")
        self.image_token_id: int = int(config.image_token_id)
        text = config.text_config
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if bool(getattr(text, "tie_word_embeddings", False)) != tied:
            # transformers ties the LM head by the top-level config, not the text one
            text = copy.deepcopy(text)
            text.tie_word_embeddings = tied
        lm_cls = text_model_class(text, type(self).__name__)
        self.language_model = (lm_cls(text, comm) if stage is None
                               else lm_cls(text, comm, stage=stage))
        first = stage is None or stage.is_first
        self.vision_model = SiglipVisionTower(vision, comm) if first else None
        self.connector = Idefics3Connector(vision.hidden_size, text.hidden_size,
                                           int(config.scale_factor), comm) if first else None
        self._adopt(self.language_model)

    # -- images ----------------------------------------------------------------------------
    def embed_images(self, images: list[dict[str, torch.Tensor]],
                     ops: OpSet) -> list[torch.Tensor]:
        """Each tile's embeddings [n, text hidden], one per placeholder token, in order.

        :param images: per tile its ``pixel_values`` [1, 3, H, W] (other keys are the
            front's: ignored); tiles of one size run through the tower as one batch.
        """
        assert self.vision_model is not None and self.connector is not None
        out: list[torch.Tensor | None] = [None] * len(images)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            groups.setdefault(tuple(image["pixel_values"].shape[1:]), []).append(i)
        dtype = self.connector.modality_projection.weight.dtype
        for members in groups.values():
            pixels = torch.cat([images[i]["pixel_values"] for i in members]).to(dtype)
            projected = self.connector(self.vision_model(pixels, ops))
            for row, i in enumerate(members):
                out[i] = projected[row]
        return [o for o in out if o is not None]

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face's names, as ``save_pretrained`` writes them and as the SmolVLM
        checkpoints have them (``model.text_model.*``, ``model.vision_model.*``,
        ``model.connector.*``, ``lm_head.*``), with or without the ``model.`` prefix."""
        text: list[tuple[str, torch.Tensor]] = []
        vision = VisionWeights(self)
        for name, tensor in weights:
            inner = name.removeprefix("model.")
            if inner.startswith("text_model."):
                text.append(("model." + inner.removeprefix("text_model."), tensor))
            elif name.startswith("lm_head."):
                text.append((name, tensor))
            elif inner.startswith(("vision_model.", "connector.")):
                if self.vision_model is None:
                    continue  # a later pipeline stage's rank
                vision.load(name, *self._vision_target(inner), tensor)
            else:
                raise vision.refusal(name)
        return vision.loaded | {"language_model." + n
                                for n in self.language_model.load_weights(text)}

    @staticmethod
    def _vision_target(name: str) -> tuple[str, str | None]:
        if name.startswith("connector."):
            return name.replace(".modality_projection.proj.", ".modality_projection."), None
        target, shard = SiglipVisionTower.checkpoint_name(name.removeprefix("vision_model."))
        return "vision_model." + target, shard
