"""LLaVA-NeXT (Hugging Face's ``LlavaNextForConditionalGeneration``): LLaVA's CLIP tower,
projector and text decoder, over images cut into tiles at any resolution.

The processor resizes an image onto the best grid of ``image_grid_pinpoints`` and cuts
it into tower-sized tiles, after one tile of the whole image (the base). An image's
embeddings, as transformers' ``pack_image_features`` lays them out ("spatial_unpad"):
the base tile's features, then the grid's features arranged as one picture, the rows
and columns that are only the resize's padding cut off (``unpad_image``), each row
ending in the learned ``image_newline``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.layers.linear import default_weight_loader
from quire.models.llava import LlavaForConditionalGeneration
from quire.models.pipeline import PipelineStage
from quire.multimodal.processor import ImageFamily
from quire.ops import OpSet


def best_resolution(size: tuple[int, int], pinpoints: Sequence[Sequence[int]]
                    ) -> tuple[int, int]:
    """The (height, width) of ``pinpoints`` an image of ``size`` (height, width) is
    resized onto: the most of its pixels kept, then the fewest wasted (transformers'
    ``select_best_resolution``)."""
    height, width = size
    best, most, least = (0, 0), 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most or (kept == most and wasted < least):
            best, most, least = (h, w), kept, wasted
    return best


def tile_grid(config: Any, size: tuple[int, int]) -> tuple[int, int]:
    """(rows, columns) of tower-sized tiles an image of ``size`` (height, width) is cut
    into, besides its base tile."""
    height, width = best_resolution(size, config.image_grid_pinpoints)
    tile = config.vision_config.image_size
    return height // tile, width // tile


def kept_region(size: tuple[int, int], height: int, width: int) -> tuple[slice, slice]:
    """The rows and columns of a ``height`` x ``width`` feature grid that show an image
    of ``size`` (height, width) rather than the padding around it (``unpad_image``)."""
    image_height, image_width = size
    if image_width / image_height > width / height:
        kept = int(round(image_height * (width / image_width), 7))
        pad = (height - kept) // 2
        return slice(pad, height - pad), slice(0, width)
    kept = int(round(image_width * (height / image_height), 7))
    pad = (width - kept) // 2
    return slice(0, height), slice(pad, width - pad)


def check_config(config: Any) -> None:
    """:raises ValueError: for a config whose images cannot be laid out as tiles, naming
    the key."""
    if config.vision_feature_select_strategy != "default":
        raise ValueError(f"vision_feature_select_strategy="
                         f"{config.vision_feature_select_strategy!r} is not supported by "
                         f"LLaVA-NeXT: 'full' keeps CLIP's class token, which the tile "
                         f"grid has no place for (transformers cannot run it either); "
                         f"only 'default'")
    tile = config.vision_config.image_size
    if not config.image_grid_pinpoints or any(
            h % tile or w % tile for h, w in config.image_grid_pinpoints):
        raise ValueError(f"image_grid_pinpoints {config.image_grid_pinpoints} must be "
                         f"multiples of the vision tower's image_size {tile}")


class _Layout:
    """Where one image's embeddings come from: its tiles and its grid's kept region."""

    def __init__(self, config: Any, image_sizes: torch.Tensor) -> None:
        height, width = (int(v) for v in image_sizes.reshape(-1).tolist())
        self.side = config.vision_config.image_size // config.vision_config.patch_size
        self.rows, self.cols = tile_grid(config, (height, width))
        self.kept = kept_region((height, width), self.rows * self.side,
                                self.cols * self.side)

    @property
    def num_tiles(self) -> int:
        return self.rows * self.cols + 1

    @property
    def num_embeds(self) -> int:
        rows, cols = (len(range(self.rows * self.side)[self.kept[0]]),
                      len(range(self.cols * self.side)[self.kept[1]]))
        return self.side * self.side + rows * (cols + 1)


def _split(out: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Per image: its ``image_sizes`` and its ``pixel_values`` tiles, less the all-zero
    tiles that pad the batch to its largest image (the model pads them back), so equal
    images hash equal whatever images share their prompt."""
    images = []
    for i in range(n):
        tiles = out["pixel_values"][i]
        real = len(tiles)
        while real > 1 and not tiles[real - 1].any():
            real -= 1
        images.append({"pixel_values": tiles[None, :real],
                       "image_sizes": out["image_sizes"][i:i + 1]})
    return images


def _num_embeds(config: Any, image: dict[str, torch.Tensor]) -> int:
    check_config(config)
    return _Layout(config, image["image_sizes"]).num_embeds


#: The front's side: ``<image>`` in prompts, tiles and the image size per image, as many
#: embeddings as ``LlavaNextProcessor`` expands the placeholder to.
IMAGE_FAMILY = ImageFamily("<image>", lambda c: int(c.image_token_index), _split,
                           _num_embeds)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT over a flattened batch: LLaVA's model with tiled images.

    :raises ValueError: as LLaVA's, and for a config :func:`check_config` refuses.
    """

    def __init__(self, config: Any, comm: Communicator,
                 stage: PipelineStage | None = None) -> None:
        check_config(config)
        super().__init__(config, comm, stage)
        self.image_newline: nn.Parameter | None = None
        if self.vision_tower is not None:
            self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size),
                                              requires_grad=False)
            self.image_newline.weight_loader = default_weight_loader

    def embed_images(self, images: list[dict[str, torch.Tensor]],
                     ops: OpSet) -> list[torch.Tensor]:
        """Each image's embeddings [n, text hidden], one per placeholder token, in order.

        :param images: per image its processor outputs: ``pixel_values`` [1, tiles, 3,
            H, W] (trailing all-zero tiles may be missing) and ``image_sizes`` [1, 2];
            the tiles of all images run through the tower as one batch.
        """
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        layouts = [_Layout(self.config, image["image_sizes"]) for image in images]
        pixels = torch.cat([_tiles(image["pixel_values"][0], layout.num_tiles)
                            for image, layout in zip(images, layouts)])
        features = self.vision_tower(pixels, ops)[:, 1:]  # the class token dropped
        projected = self.multi_modal_projector(features)
        per_image = projected.split([layout.num_tiles for layout in layouts])
        return [self._pack(tiles, layout) for tiles, layout in zip(per_image, layouts)]

    def _pack(self, features: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """One image's tile features [tiles, side * side, D] -> its embeddings [n, D]:
        the base tile's, then the grid's kept region row by row, each row closed by
        ``image_newline``."""
        assert self.image_newline is not None
        side, rows, cols = layout.side, layout.rows, layout.cols
        grid = (features[1:].view(rows, cols, side, side, -1).permute(0, 2, 1, 3, 4)
                .reshape(rows * side, cols * side, -1)[layout.kept])
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, -1)
        return torch.cat([features[0], torch.cat([grid, newline], dim=1).flatten(0, 1)])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """LLaVA's names, and ``image_newline`` (``model.image_newline`` in memory)."""
        loaded: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.removeprefix("model.") != "image_newline":
                    yield name, tensor
                elif self.image_newline is not None:  # else a later pipeline stage's
                    self.image_newline.weight_loader(self.image_newline, tensor)
                    loaded.add("image_newline")

        return super().load_weights(others()) | loaded


def _tiles(pixels: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` tiles [count, 3, H, W]: ``pixels`` with the all-zero tiles that
    :func:`_split` left off put back, or cut to ``count``."""
    if len(pixels) >= count:
        return pixels[:count]
    return torch.cat([pixels, pixels.new_zeros(count - len(pixels), *pixels.shape[1:])])
