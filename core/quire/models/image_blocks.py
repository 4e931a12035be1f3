"""Bidirectional attention within each image, inside a causal decoder (Gemma 3's image
tokens see every token of their own image, as transformers' ``token_type_ids`` mask
does): a correction any attention backend computes through its public ``attend``.

After a layer's causal attention has written the step's K/V, each image row is attended
again as a one-row pseudo-sequence whose length runs to its image's last token, over the
same pages: exactly the causal keys plus the image's later ones. A sliding window keeps
keys after ``position - window``; a pseudo-sequence ending at the image's end needs the
window ``window + (end - position)`` for that, so rows whose window reaches position 0
share one call without a window and the others (a long prompt before the image) take
one call each. The engine never cuts an image of such a model across steps, so all of
its keys are in the pages when its rows are attended.
"""

from __future__ import annotations

from typing import Any

import torch

from quire.interfaces.attention import AttentionBackend, AttentionBatch


class ImageBlocks:
    """One step's image rows and their pseudo-sequences' metadata (built on first use
    per window, shared by every layer of the step)."""

    def __init__(self, backend: AttentionBackend, batch: AttentionBatch, rows: list[int],
                 seqs: list[int], positions: list[int], ends: list[int]) -> None:
        """:param rows: the image rows of the flattened batch; ``seqs``: each row's
        sequence index in ``batch``; ``positions``/``ends``: each row's position and its
        image's last position."""
        self.backend = backend
        self.batch = batch
        self.rows = torch.tensor(rows, dtype=torch.int64, device=batch.slot_mapping.device)
        self._seqs, self._positions, self._ends = seqs, positions, ends
        self._metadata: dict[tuple[int, ...], Any] = {}

    def _pseudo(self, members: tuple[int, ...]) -> Any:
        """Metadata of the given rows (indices into ``rows``) as one-row sequences."""
        if members not in self._metadata:
            batch, device = self.batch, self.batch.slot_mapping.device
            index = torch.tensor(members, dtype=torch.int64, device=device)
            seqs = torch.tensor([self._seqs[m] for m in members], device=device)
            lens = [self._ends[m] + 1 for m in members]
            pseudo = AttentionBatch(
                slot_mapping=batch.slot_mapping[self.rows[index]],
                query_start_loc=torch.arange(len(members) + 1, device=device),
                seq_lens=torch.tensor(lens, dtype=batch.seq_lens.dtype, device=device),
                block_tables=batch.block_tables[seqs],
                block_size=batch.block_size, max_query_len=1, max_seq_len=max(lens),
                query_lens=(1,) * len(members))
            self._metadata[members] = self.backend.build_metadata(pseudo)
        return self._metadata[members]

    def correct(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, *,
                scale: float, sliding_window: int | None,
                logits_soft_cap: float | None) -> torch.Tensor:
        """``out`` (a layer's causal attention [T, Hq, D]) with its image rows
        attended again over their whole image; ``query`` as rotated for that layer."""
        groups: list[tuple[tuple[int, ...], int | None]] = []
        if sliding_window is None:
            groups.append((tuple(range(len(self._positions))), None))
        else:
            near = tuple(m for m, p in enumerate(self._positions) if p < sliding_window)
            if near:
                groups.append((near, None))
            groups += [((m,), sliding_window + self._ends[m] - p)
                       for m, p in enumerate(self._positions) if p >= sliding_window]
        out = out.clone()
        for members, window in groups:
            rows = self.rows[list(members)]
            out[rows] = self.backend.attend(query[rows], kv_cache, self._pseudo(members),
                                            scale=scale, sliding_window=window,
                                            logits_soft_cap=logits_soft_cap)
        return out
