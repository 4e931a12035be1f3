"""Prompt-lookup (n-gram) drafting: propose the tokens that followed an earlier copy of the suffix.

For one sequence's tokens (prompt + output so far), the proposer takes the longest suffix
of length ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` that also occurs earlier,
and proposes up to ``k`` tokens that followed that earlier occurrence (vLLM's
``method: "ngram"``). An occurrence may overlap the suffix itself; it only has to start
before it, so that at least one token follows it.

When the longest suffix occurs several times we take the most recent occurrence, which
follows the text's latest pattern. vLLM takes the earliest one instead; the two differ
only in which continuation is drafted, never in whether one is.

The search is vectorised: every position holding the last token ends a candidate
occurrence, and the candidates are extended backwards one token at a time, so a step
costs one pass over the sequence plus ``prompt_lookup_max`` passes over the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

# how many of the latest candidates are tried alone before all of them are
_TAIL = 64


class NgramProposer:
    """Drafts tokens for decoding sequences by looking up their suffix in their own history.

    Stateless: each call reads the whole sequence it is given, so sequences may grow,
    shrink or be swapped between calls. The search itself is cheap; turning a long
    Python list into an array costs far more, so a caller that keeps each sequence's
    tokens in a numpy integer array should pass that array, which is read without a copy.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= "
                f"prompt_lookup_min ({prompt_lookup_min})")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int] | npt.NDArray[np.integer],
                max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens for one sequence.

        :param token_ids: the sequence's tokens, prompt then output; a numpy integer
            array is read without a copy, anything else is copied into an int32 array.
        :param max_tokens: a further cap, e.g. the room left before ``max_tokens`` or
            the model's length; ``None`` means ``num_speculative_tokens`` only.
        :returns: the drafts, fewer than ``k`` when the match lies near the end, and
            ``[]`` when no suffix in range recurs or ``max_tokens <= 0``.
        """
        k = self.num_speculative_tokens if max_tokens is None \
            else min(self.num_speculative_tokens, max_tokens)
        if k <= 0 or len(token_ids) <= self.prompt_lookup_min:
            return []
        tokens = token_ids if isinstance(token_ids, np.ndarray) \
            else np.fromiter(token_ids, np.int32, len(token_ids))
        end = self._match_end(tokens)
        if end < 0:
            return []
        return tokens[end + 1:end + 1 + k].tolist()

    def propose_batch(self, sequences: Sequence[Sequence[int] | npt.NDArray[np.integer]],
                      max_tokens: Sequence[int]) -> list[list[int]]:
        """:meth:`propose` for each of a step's sequences, with its own cap."""
        if len(sequences) != len(max_tokens):
            raise ValueError(f"got {len(sequences)} sequences but "
                             f"{len(max_tokens)} max_tokens")
        return [self.propose(seq, cap) for seq, cap in zip(sequences, max_tokens)]

    def _match_end(self, tokens: npt.NDArray[np.integer]) -> int:
        """Index of the last token of the chosen earlier occurrence, or -1 if none."""
        last = len(tokens) - 1
        # candidates: positions before the last one that hold the last token
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if ends.size > _TAIL:
            # repetitive text has many candidates, and the latest usually match in full
            n, end = self._extend(tokens, ends[-_TAIL:])
            if n == self.prompt_lookup_max:
                return end
        n, end = self._extend(tokens, ends)
        return end if n >= self.prompt_lookup_min else -1

    def _extend(self, tokens: npt.NDArray[np.integer],
                ends: npt.NDArray[np.intp]) -> tuple[int, int]:
        """Longest match (capped at the max) among candidate ends, and its latest end."""
        if ends.size == 0:
            return 0, -1
        last = len(tokens) - 1
        # after each step, ``ends`` holds the candidates matching ``n`` tokens
        n = 1
        while n < self.prompt_lookup_max:
            longer = ends[ends >= n]
            longer = longer[tokens[longer - n] == tokens[last - n]]
            if longer.size == 0:
                break
            ends, n = longer, n + 1
        return n, int(ends[-1])
