"""The sampler: picks each sequence's next token from its logits.

This release is greedy only; the full sampler (temperature, top-k/p, min-p, penalties,
seeds, logprobs) replaces the body of :meth:`Sampler.sample` without changing its caller.
"""

from __future__ import annotations

import torch

from quire.sequence import Sequence


class Sampler:
    """Vectorised over the batch: one argmax for all sequences."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """:param logits: float32 [N, vocab], row i for ``seqs[i]``.
        :returns: one token id per sequence."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(seqs)} sequences")
        return logits.argmax(dim=-1).tolist()
