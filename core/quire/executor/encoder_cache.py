"""The workers' image embeddings: computed once per image, kept while sequences still
need them, and placed into each step's rows (an image-text model's runner).

The rule is the engine's mirror (``quire.engine.encoder_cache``): an item that carries
an image in ``mm_encode`` makes an entry; a span makes its occurrence (sequence, item
index) a user; a span marked ``last`` ends that use at the step's end, and a sequence's
release (after the step that announces it) ends all of its; an entry without users is
dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from quire.executor.messages import StepItem
from quire.models.image_blocks import ImageBlocks
from quire.ops import OpSet


class ImageEmbeddings:
    """One runner's image-embedding entries, by image hash; their users are occurrences
    (sequence id, item index), as the engine counts them."""

    def __init__(self) -> None:
        self._entries: dict[int, torch.Tensor] = {}
        self._users: dict[int, set[tuple[int, int]]] = {}
        self._held_by: dict[int, set[tuple[int, int]]] = {}  # seq_id -> (hash, index)

    def __len__(self) -> int:
        return len(self._entries)

    def step(self, items: list[StepItem], model: Any, ops: OpSet,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Encode the step's new images (one ``model.embed_images`` call for them all)
        and gather each span's embeddings: (rows of the flattened batch, [M, hidden]),
        or None when no row of the step is an image's. Occurrences the step finishes
        are let go at its end."""
        fresh = {image.hash: image for item in items for image in item.mm_encode}
        if fresh:
            inputs = [{k: v.to(device) for k, v in image.tensors().items()}
                      for image in fresh.values()]
            self._entries.update(zip(fresh, model.embed_images(inputs, ops)))
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        done: list[tuple[int, int, int]] = []
        offset = 0
        for item in items:
            for span in item.mm_spans:
                entry = self._entries.get(span.hash)
                if entry is None:
                    raise RuntimeError(f"sequence {item.seq_id}: image {span.hash:x} is "
                                       "neither held nor sent with the step")
                self._users.setdefault(span.hash, set()).add((item.seq_id, span.item))
                self._held_by.setdefault(item.seq_id, set()).add((span.hash, span.item))
                rows.append(torch.arange(offset + span.row, offset + span.row + span.count))
                values.append(entry[span.first:span.first + span.count])
                if span.last:
                    done.append((span.hash, item.seq_id, span.item))
            offset += len(item.token_ids)
        for h, seq_id, index in done:
            self._drop(h, seq_id, index)
        for h in fresh:  # encoded for no occurrence still under way
            if not self._users.get(h):
                self._entries.pop(h, None)
        if not rows:
            return None
        return torch.cat(rows).to(device), torch.cat(values)

    def release(self, seq_ids: Iterable[int]) -> None:
        """The sequences released with the step use none of their images any more."""
        for seq_id in seq_ids:
            for h, index in list(self._held_by.get(seq_id, ())):
                self._drop(h, seq_id, index)

    def _drop(self, image_hash: int, seq_id: int, index: int) -> None:
        users = self._users.get(image_hash)
        if users is not None:
            users.discard((seq_id, index))
            if not users:
                del self._users[image_hash]
                self._entries.pop(image_hash, None)
        held = self._held_by.get(seq_id)
        if held is not None:
            held.discard((image_hash, index))
            if not held:
                del self._held_by[seq_id]


def image_blocks(items: list[StepItem], backend: Any, batch: Any) -> ImageBlocks | None:
    """The step's image rows as bidirectional blocks (each span runs to its image run's
    end: the engine never cuts such an image), or None when the step has none."""
    rows, seqs, positions, ends = [], [], [], []
    offset = 0
    for i, item in enumerate(items):
        for span in item.mm_spans:
            end = item.start + span.row + span.count - 1
            for k in range(span.count):
                rows.append(offset + span.row + k)
                seqs.append(i)
                positions.append(item.start + span.row + k)
                ends.append(end)
        offset += len(item.token_ids)
    return ImageBlocks(backend, batch, rows, seqs, positions, ends) if rows else None
