"""What one image of a prompt is to the engine: its processor outputs, a content hash,
and where its placeholder tokens are.

The front expands each image's placeholder into as many tokens as the image has
embeddings (the model's processor decides how many); the core schedules those tokens
like any other, encodes the image when a step first needs one of them, and names the
pages that hold them by the image's hash as well as their token ids, so the same
tokens with another image never hit the prefix cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import msgspec
import torch

from quire.executor.array import Array


class MMItem(msgspec.Struct, array_like=True, frozen=True):
    """One image of one prompt."""

    #: Content hash of the processed image (its tensors' bytes, shapes and dtypes): equal
    #: images share encoder work and prefix-cache pages, different ones never do.
    hash: int
    #: (offset, length) of each run of this image's placeholder tokens in the prompt, in
    #: order; its embeddings fill them in that order.
    runs: list[tuple[int, int]]
    #: The processor's outputs for this image alone (``pixel_values`` and the like).
    data: dict[str, Array]
    #: The (t, h, w) grid its embeddings fill, in order, for a model whose positions
    #: follow it (M-RoPE: :mod:`quire.multimodal.mrope`); empty for other models.
    grid: tuple[int, ...] = ()

    @property
    def num_embeds(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def offset(self) -> int:
        """The prompt position of its first placeholder token."""
        return self.runs[0][0]

    @property
    def end(self) -> int:
        """One past the prompt position of its last placeholder token."""
        return self.runs[-1][0] + self.runs[-1][1]

    def touches(self, start: int, end: int) -> bool:
        """Whether positions ``start .. end`` hold any of its placeholder tokens."""
        return self.offset < end and self.end > start and any(
            offset < end and offset + length > start for offset, length in self.runs)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {key: value.tensor() for key, value in self.data.items()}


class MMSpan(msgspec.Struct, array_like=True, frozen=True):
    """Rows of one step's item that take an image's embeddings: rows ``row ..
    row + count`` of the item's tokens get embeddings ``first .. first + count``."""

    hash: int
    row: int
    count: int
    first: int
    #: Which of its sequence's images this is (the index in the prompt's items: the
    #: same image may occur twice, and each occurrence is used on its own).
    item: int = 0
    #: It reaches the occurrence's last placeholder token: the sequence is done with it.
    last: bool = False


def content_hash(data: Mapping[str, torch.Tensor]) -> int:
    """A 64-bit hash of tensors by name, shape, dtype and bytes (stable across
    processes, unlike ``hash``)."""
    digest = hashlib.blake2b(digest_size=8)
    for key in sorted(data):
        tensor = data[key].detach().to("cpu").contiguous()
        digest.update(f"{key}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel()
                      else b"")
    return int.from_bytes(digest.digest(), "little") >> 1  # non-negative, fits int64


def runs_of(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Ascending positions as (offset, length) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def spans_in(items: Iterable[MMItem], start: int, end: int) -> list[MMSpan]:
    """The placeholder rows of positions ``start .. end`` (a step's share of one
    sequence), rows counted from ``start``; a span reaching its image's last
    placeholder token is marked ``last``."""
    spans = []
    for index, item in enumerate(items):
        if item.end <= start or item.offset >= end:
            continue
        first = 0
        for offset, length in item.runs:
            lo, hi = max(offset, start), min(offset + length, end)
            if lo < hi:
                spans.append(MMSpan(item.hash, lo - start, hi - lo, first + lo - offset,
                                    index, hi == item.end))
            first += length
    return spans


def page_keys(items: Iterable[MMItem], start: int, end: int) -> tuple[int, ...]:
    """The hashes of the images with placeholder tokens among positions ``start ..
    end`` (one page): what a page's prefix-cache name adds to its token ids."""
    return tuple(item.hash for item in items if item.offset < end and item.end > start)


def check_images(request_id: str, items: list[MMItem], num_prompt_tokens: int,
                 takes_images: bool) -> None:
    """Refuse images the engine cannot place: for a text-only model, or placeholder runs
    outside the prompt or out of order.

    :raises ValueError: naming the request."""
    if not takes_images:
        raise ValueError(f"request {request_id} has {len(items)} image(s), but this model "
                         "takes text only")
    last = 0
    for item in items:
        if not item.runs:
            raise ValueError(f"request {request_id}: an image without placeholder tokens")
        for offset, length in item.runs:
            if offset < last or length <= 0 or offset + length > num_prompt_tokens:
                raise ValueError(f"request {request_id}: image placeholder run "
                                 f"({offset}, {length}) is outside the prompt's "
                                 f"{num_prompt_tokens} tokens or out of order")
            last = offset + length
