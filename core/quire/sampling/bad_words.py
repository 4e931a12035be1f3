"""``bad_words``: the words a request's output must not contain, as vLLM bans them.

The front turns each word into token sequences (:func:`bad_words_token_ids`): the word as
written and, where the tokenizer makes a different first token of it, after a space, so
that it is banned at the start of the text and in the middle of it. Each step the sampler
bans a sequence's last token wherever the output already ends with the rest of it
(:func:`ban_bad_words`); a one-token word is banned everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell ``words`` (vLLM's ``update_from_tokenizer``): each
    word without a leading space, and with one when that gives another first token and the
    same number of tokens (a tokenizer that marks word starts spells it differently)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return tuple(dict.fromkeys(out))


def ban_bad_words(logits: torch.Tensor, rows: Sequence[tuple[int, Any]]) -> None:
    """Set to ``-inf``, in place, each row's tokens that would complete one of its bad
    words after its output so far.

    :param rows: ``(row, owner)`` pairs; ``owner`` has ``params.bad_words_token_ids`` and
        ``output_token_ids``."""
    at_rows: list[int] = []
    at_cols: list[int] = []
    for row, owner in rows:
        out = owner.output_token_ids
        for word in owner.params.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix > len(out):
                continue
            if prefix == 0 or list(word[:prefix]) == out[len(out) - prefix:]:
                at_rows.append(row)
                at_cols.append(word[-1])
    if at_rows:
        logits[torch.tensor(at_rows, device=logits.device),
               torch.tensor(at_cols, device=logits.device)] = float("-inf")
