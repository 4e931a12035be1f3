"""The interface a grammar engine implements, and the bitmask step of the sampler.

A backend is built once per engine from its tokenizer. The front calls
:meth:`GrammarBackend.check` before a request is queued (a bad schema is the client's
400, never a failed step); the core starts one :class:`Matcher` per sequence and, each
step, asks the matchers of the rows that have one to fill their row of a token bitmask
(bit ``t`` of row ``r``: token ``t`` may come next), which masks the logits; rows without
a grammar pay nothing. A sampled token is then given to its matcher. Matchers keep their
state across preemption (a preempted sequence keeps its tokens and is only recomputed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from quire.structured.params import StructuredOutputsParams


class Matcher(ABC):
    """One sequence's place in its grammar."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, 32 tokens a word)."""

    @abstractmethod
    def accept(self, token: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""

    @abstractmethod
    def num_valid(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order from the current state, the grammar allows
        (speculative decoding's drafts); changes nothing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` :meth:`accept` calls."""


class GrammarBackend(ABC):
    """Compiles requests' grammars and starts matchers; caches by grammar text."""

    @abstractmethod
    def check(self, spec: StructuredOutputsParams) -> None:
        """:raises ValueError: naming why the grammar cannot be used."""

    @abstractmethod
    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        """A matcher at the grammar's start. :raises ValueError: as :meth:`check`."""


def make_grammar_backend(tokenizer: object, vocab_size: int,
                         eos_token_ids: list[int]) -> GrammarBackend:
    """The grammar engine (llguidance; another would implement :class:`GrammarBackend`)."""
    from quire.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in ``logits[rows]``, every token whose bit in ``bitmask`` (one row per
    entry of ``rows``) is 0. Tokens past the bitmask's width are never allowed."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)
    sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, sub)
