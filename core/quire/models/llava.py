"""LLaVA-1.5 (Hugging Face's ``LlavaForConditionalGeneration``): a CLIP vision tower, a
two-layer MLP projector, and one of our text decoders (Llama, Mistral, Qwen2, ...).

An image becomes the projected hidden states of one tower layer (the class token
dropped under the ``default`` feature strategy), one embedding per ``<image>`` token of
the prompt, in order; the engine puts them in place of those tokens' embeddings
(``ForwardContext.mm_embeds``), so the decoder, its KV pages, tensor and pipeline
parallelism and the cpu fast path are the text model's own. The tower and projector
live on the first pipeline stage only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.image_text import ImageTextModel
from quire.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from quire.models.pipeline import PipelineStage
from quire.models.vision.clip import CLIPVisionTower, activation
from quire.models.vision.loading import VisionWeights
from quire.multimodal.processor import ImageFamily, split_first_dim
from quire.ops import OpSet


def text_model_class(text_config: Any, where: str) -> type[nn.Module]:
    """Our decoder class for an image-text model's ``text_config``.

    :raises ValueError: naming ``where`` and the text model type, when we have none."""
    from quire.models.registry import CORE_MODELS, MODEL_TYPES

    model_type = getattr(text_config, "model_type", "")
    name = MODEL_TYPES.get(model_type)
    if name is None or name == "BertModel":
        raise ValueError(f"{where}: the text model type {model_type!r} is not supported; "
                         f"supported: {', '.join(sorted(set(MODEL_TYPES) - {'bert'}))}")
    return CORE_MODELS[name].load()


def _num_embeds(config: Any, image: dict[str, torch.Tensor]) -> int:
    vision = config.vision_config
    n = (vision.image_size // vision.patch_size) ** 2
    return n + (1 if config.vision_feature_select_strategy == "full" else 0)


#: The front's side: ``<image>`` in prompts, the processor's ``pixel_values`` batched by
#: image, a fixed number of embeddings per image.
IMAGE_FAMILY = ImageFamily("<image>", lambda c: int(c.image_token_index), split_first_dim,
                           _num_embeds)


class LlavaProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: vision features to the text model's width."""

    def __init__(self, in_size: int, out_size: int, act: str, bias: bool,
                 comm: Communicator) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(in_size, out_size, bias=bias, comm=comm)
        self.act = activation(act, "projector_hidden_act")
        self.linear_2 = RowParallelLinear(out_size, out_size, bias=bias, comm=comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(ImageTextModel):
    """LLaVA over a flattened batch: the text decoder's forward with image embeddings in
    place of the ``<image>`` tokens; :meth:`embed_images` makes them.

    :raises ValueError: for a vision tower, feature strategy or text model it does not
        compute, naming the config key.
    """


    def __init__(self, config: Any, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = config
        vision = config.vision_config
        if getattr(vision, "model_type", "") != "clip_vision_model":
            raise ValueError(f"{type(self).__name__}: vision_config.model_type "
                             f"{getattr(vision, 'model_type', None)!r} is not supported; "
                             f"only 'clip_vision_model'")
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={self.strategy!r} is not "
                             f"supported; only 'default' or 'full'")
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.image_token_id: int = int(config.image_token_index)
        lm_cls = text_model_class(config.text_config, type(self).__name__)
        self.language_model = (lm_cls(config.text_config, comm) if stage is None
                               else lm_cls(config.text_config, comm, stage=stage))
        first = stage is None or stage.is_first
        self.vision_tower = CLIPVisionTower(vision, comm, layers) if first else None
        self.multi_modal_projector = LlavaProjector(
            vision.hidden_size * len(layers), config.text_config.hidden_size,
            config.projector_hidden_act, bool(getattr(config, "multimodal_projector_bias",
                                                      True)), comm) if first else None
        self._adopt(self.language_model)

    # -- images ----------------------------------------------------------------------------
    def embed_images(self, images: list[dict[str, torch.Tensor]],
                     ops: OpSet) -> list[torch.Tensor]:
        """Each image's embeddings [n, text hidden], one per placeholder token, in order.

        :param images: per image its processor outputs (``pixel_values`` [1, 3, H, W]);
            images of one size run through the tower as one batch.
        """
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        out: list[torch.Tensor | None] = [None] * len(images)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            groups.setdefault(tuple(image["pixel_values"].shape[1:]), []).append(i)
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        for members in groups.values():
            pixels = torch.cat([images[i]["pixel_values"] for i in members]).to(dtype)
            features = self.vision_tower(pixels, ops)
            if self.strategy == "default":
                features = features[:, 1:]
            projected = self.multi_modal_projector(features)
            for row, i in enumerate(members):
                out[i] = projected[row]
        return [o for o in out if o is not None]

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face's names, as ``save_pretrained`` writes them and as the llava-hf
        checkpoints have them (``language_model.model.*``, ``vision_tower.vision_model.*``)
        or as transformers names them in memory (``model.language_model.*``)."""
        text: list[tuple[str, torch.Tensor]] = []
        vision = VisionWeights(self)
        for name, tensor in weights:
            if name.startswith("model.") and not name.startswith("model.layers."):
                name = name.removeprefix("model.")
            if (inner := self.text_name(name)) is not None:
                text.append((inner, tensor))
            elif name.startswith(("vision_tower.", "multi_modal_projector.")):
                if self.vision_tower is None:
                    continue  # a later pipeline stage's rank
                target, shard = self._vision_target(name)
                if target is not None:
                    vision.load(name, target, shard, tensor)
            else:
                raise vision.refusal(name)
        return vision.loaded | {"language_model." + n
                                for n in self.language_model.load_weights(text)}

    def _vision_target(self, name: str) -> tuple[str | None, str | None]:
        if name.startswith("multi_modal_projector."):
            return name, None
        mapped = CLIPVisionTower.checkpoint_name(name.removeprefix("vision_tower."))
        if mapped is None:
            return None, None
        target, shard = mapped
        assert self.vision_tower is not None
        layer = self.vision_tower.layer_of(target)
        if layer is not None and layer >= len(self.vision_tower.layers):
            return None, None  # past the deepest feature layer: never computed
        return "vision_tower." + target, shard
