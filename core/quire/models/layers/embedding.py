"""The vocabulary, split by rows over the ranks: the token embedding and the LM head.

The vocabulary is padded up to a multiple of the world size, so every rank holds the
same number of rows: rank ``r`` owns token ids ``[r * n, (r + 1) * n)``. Padding rows
hold zeros and their logits are cut off before anything sees them.

- :class:`VocabParallelEmbedding` looks up the ids it owns, zeroes the others, and sums
  the ranks' partial rows with one ``all_reduce``.
- :class:`ParallelLMHead` computes the logits of its own rows and ``all_gather`` s them.
  It may share its weight with the embedding (``tie_word_embeddings``): both use the
  same split, so each rank's shard is the same tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quire.interfaces.communicator import Communicator
from quire.models.layers.linear import LinearKernel, apply_linear
from quire.ops.quantized import quantized_embedding


class _VocabShard(nn.Module):
    """The row split both vocabulary layers share, and the loader of their weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        ws = comm.world_size
        self.num_embeddings_per_rank = -(-num_embeddings // ws)  # ceil: pad, never drop
        #: First token id this rank owns; the end is clipped to the real vocabulary.
        self.vocab_start = comm.rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False
        )
        #: The LM head's matmul kernel (see ``LinearKernel``); unused by the embedding.
        self.kernel: LinearKernel | None = None
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's rows of the full ``[vocab, dim]`` tensor; zero the padding.

        :raises ValueError: on a shard id or a shape mismatch.
        """
        if shard_id is not None:
            raise ValueError(f"the vocabulary is not fused; got shard id {shard_id!r}")
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape mismatch: expected {expected}, got {tuple(loaded.shape)}")
        owned = max(self.vocab_end - self.vocab_start, 0)
        quant = getattr(self, "quant", None)
        if quant is not None:  # kept quantised: this rank's rows, no padding stored
            quant.store_rows(0, loaded, self.vocab_start, owned)
            return
        if not isinstance(loaded, torch.Tensor):  # quantised in the file, float here
            loaded = loaded.narrow_rows(self.vocab_start, owned).dequantize()
            param.data[:owned].copy_(loaded)
        else:
            param.data[:owned].copy_(loaded[self.vocab_start : self.vocab_start + owned])
        param.data[owned:].zero_()

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings} (rows {self.vocab_start}:{self.vocab_end} here), "
            f"dim={self.embedding_dim}"
        )


class VocabParallelEmbedding(_VocabShard):
    """Token id -> embedding row, with the rows split over ranks."""

    #: The dtype rows of a quantised table are given in (the model's; set on load).
    dtype: torch.dtype = torch.float32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """:param input_ids: int64 [T], each below ``num_embeddings``. :returns: [T, dim]."""
        if self.comm.world_size == 1:
            return self._rows(input_ids)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        # Ids owned elsewhere look up row 0 and are then zeroed, so the sum over ranks
        # leaves exactly the owner's row.
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        rows = self._rows(local_ids).masked_fill(~owned.unsqueeze(-1), 0)
        return self.comm.all_reduce(rows)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        quant = getattr(self, "quant", None)
        if quant is None:
            return F.embedding(ids, self.weight)
        (table,) = quant.ordered_parts()  # only the rows asked for are dequantised
        return quantized_embedding(ids, table, self.dtype)


class ParallelLMHead(_VocabShard):
    """Hidden state -> logits over the whole vocabulary (no bias, as in Llama/Qwen)."""

    #: What a platform may run its own way (``quire.ops.layer_spec``): ``F.linear``.
    op_site = "linear"
    #: (the embedding this head shares its weight with,) when tied: in a tuple, so that
    #: it is not registered as a second parent of that module
    _tied: tuple[VocabParallelEmbedding, ...] = ()

    @property
    def tied_to(self) -> VocabParallelEmbedding | None:
        """The embedding this head shares its weight with (quantised or not), or None."""
        return self._tied[0] if self._tied else None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share ``embedding``'s weight (``tie_word_embeddings``); nothing is loaded twice.

        :raises ValueError: when the two layers do not split the same vocabulary.
        """
        same = (
            embedding.num_embeddings == self.num_embeddings
            and embedding.embedding_dim == self.embedding_dim
            and embedding.comm is self.comm
        )
        if not same:
            raise ValueError(
                f"cannot tie the LM head ({self.extra_repr()}) to an embedding "
                f"({embedding.extra_repr()}) with another shape or group"
            )
        self.weight = embedding.weight
        self._tied = (embedding,)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, dim] -> [N, num_embeddings] logits in the weight's dtype."""
        logits = apply_linear(self.kernel, hidden, self.weight, None)
        if self.comm.world_size == 1:
            return logits
        logits = self.comm.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]  # drop the padding rows' logits
