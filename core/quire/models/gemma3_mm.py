"""Gemma 3 with images (Hugging Face's ``Gemma3ForConditionalGeneration``): a SigLIP
tower at its native size, a projector that average-pools the patch grid to
``mm_tokens_per_image`` tokens, norms them (Gemma's ``(1 + w)`` RMSNorm) and projects them
by a matrix, over our Gemma 3 text decoder.

An image's tokens attend to each other both ways inside the causal decoder, as
transformers' ``token_type_ids`` mask makes them (``bidirectional_images``: the runner
corrects their attention through ``ForwardContext.mm_blocks``, on sliding layers too).
The tower and projector live on the first pipeline stage only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.gemma3 import Gemma3ForCausalLM
from quire.models.image_text import ImageTextModel
from quire.models.layers.linear import whole_param
from quire.models.pipeline import PipelineStage
from quire.models.vision.loading import VisionWeights
from quire.models.vision.siglip import SiglipVisionTower
from quire.multimodal.processor import ImageFamily, split_first_dim
from quire.ops import OpSet

#: The front's side: ``<start_of_image>`` in prompts (the processor wraps it in blank
#: lines and the image's soft tokens), ``pixel_values`` batched by image, a fixed count.
IMAGE_FAMILY = ImageFamily("<start_of_image>", lambda c: int(c.image_token_index),
                           split_first_dim, lambda c, image: int(c.mm_tokens_per_image),
                           bidirectional=True)


class Gemma3Projector(nn.Module):
    """Patch grid -> ``mm_tokens_per_image`` text-width embeddings."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.patches = vision.image_size // vision.patch_size
        side = int(config.mm_tokens_per_image ** 0.5)
        if side * side != config.mm_tokens_per_image or self.patches % side:
            raise ValueError(f"mm_tokens_per_image={config.mm_tokens_per_image} must be a "
                             f"square whose side divides the {self.patches} patches a side")
        self.kernel = self.patches // side
        self.eps = vision.layer_norm_eps
        self.mm_soft_emb_norm = whole_param(vision.hidden_size)
        self.mm_input_projection_weight = whole_param(vision.hidden_size,
                                                 config.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, d = x.shape
        grid = x.transpose(1, 2).reshape(n, d, self.patches, self.patches)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        h = pooled.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (h * (1.0 + self.mm_soft_emb_norm.float())).to(x.dtype)
        return torch.matmul(normed, self.mm_input_projection_weight).to(x.dtype)


class Gemma3ForConditionalGeneration(ImageTextModel):
    """Gemma 3 over a flattened batch: the text decoder's forward with image embeddings
    in place of the image soft tokens; :meth:`embed_images` makes them.

    :raises ValueError: for a vision tower other than SigLIP's, naming the key.
    """

    #: Each image's tokens attend within the image both ways.
    bidirectional_images = True

    def __init__(self, config: Any, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        vision = config.vision_config
        if getattr(vision, "model_type", "") != "siglip_vision_model":
            raise ValueError(f"{type(self).__name__}: vision_config.model_type "
                             f"{getattr(vision, 'model_type', None)!r} is not supported; "
                             f"only 'siglip_vision_model'")
        self.config = config
        self.image_token_id: int = int(config.image_token_index)
        self.language_model = (Gemma3ForCausalLM(config.text_config, comm) if stage is None
                               else Gemma3ForCausalLM(config.text_config, comm, stage=stage))
        first = stage is None or stage.is_first
        self.vision_tower = SiglipVisionTower(vision, comm, bucketed=False) if first else None
        self.multi_modal_projector = Gemma3Projector(config) if first else None
        self._adopt(self.language_model)

    def embed_images(self, images: list[dict[str, torch.Tensor]],
                     ops: OpSet) -> list[torch.Tensor]:
        """Each image's ``mm_tokens_per_image`` embeddings [n, text hidden]; all images
        of a step run through the tower as one batch (one size: the tower's)."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        pixels = torch.cat([image["pixel_values"] for image in images]).to(dtype)
        return list(self.multi_modal_projector(self.vision_tower(pixels, ops)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head with no final soft cap: transformers' image-text class applies
        none, whatever ``final_logit_softcapping`` says (Gemma 3's released configs set
        none)."""
        lm = self.language_model
        assert lm.lm_head is not None, "only the last pipeline stage has the LM head"
        return lm.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face's names, as ``save_pretrained`` writes them
        (``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``),
        with or without ``vision_model.`` and the in-memory ``model.`` prefix."""
        text: list[tuple[str, torch.Tensor]] = []
        vision = VisionWeights(self)
        for name, tensor in weights:
            if name.startswith("model.") and not name.startswith("model.layers."):
                name = name.removeprefix("model.")
            if (inner := self.text_name(name)) is not None:
                text.append((inner, tensor))
            elif self.vision_tower is None:
                continue  # a later pipeline stage's rank
            elif name.startswith("multi_modal_projector."):
                vision.load(name, name.removesuffix(".weight") if name.endswith(
                    "mm_soft_emb_norm.weight") else name, None, tensor)
            elif name.startswith("vision_tower."):
                leaf, shard = SiglipVisionTower.checkpoint_name(
                    name.removeprefix("vision_tower."))
                vision.load(name, "vision_tower." + leaf, shard, tensor)
            else:
                raise vision.refusal(name)
        return vision.loaded | {"language_model." + n
                                for n in self.language_model.load_weights(text)}
