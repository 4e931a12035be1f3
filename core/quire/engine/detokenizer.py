"""Incremental detokenization: the text of each new token, as it is sampled.

Decoding one token id at a time is wrong for both tokenizer families: byte-level BPE
splits a multi-byte character over several tokens (each alone decodes to U+FFFD), and
SentencePiece decides a token's leading space from its neighbour. So each sequence keeps
two offsets into its token ids: text is decoded from a window starting a few tokens back
(``prefix_offset``), and only what the newest tokens add beyond the already emitted part
(up to ``read_offset``) is returned. A window whose text ends in an incomplete character
emits nothing until the character is complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import transformers
from transformers import PreTrainedTokenizerBase

#: Prompt tokens decoded with the first output token, for its leading-space context.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class DetokenizerState:
    """Where one sequence's incremental decoding stands (offsets into all its tokens)."""

    prefix_offset: int
    read_offset: int


def backend_decode(tokenizer: PreTrainedTokenizerBase) -> Callable[..., str] | None:
    """The ``tokenizers`` library's own ``decode(ids, skip_special_tokens=...)`` when
    transformers' ``decode`` would only call it (a fast tokenizer whose ``decode`` and
    ``_decode`` are transformers' own, without clean-up), else None. Two decodes per token
    per sequence make the wrapper's ~6 us a call most of the detokenizer's time."""
    fast = getattr(transformers, "PreTrainedTokenizerFast", None)
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (fast is None or backend is None or cls.decode is not PreTrainedTokenizerBase.decode
            or getattr(cls, "_decode", None) is not fast._decode
            or tokenizer.clean_up_tokenization_spaces):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Turns token ids into text deltas; one instance per engine, state per sequence."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # the fast path takes no spaces_between_special_tokens: fast tokenizers ignore it
        self._backend_decode = backend_decode(tokenizer)

    def start(self, num_prompt_tokens: int) -> DetokenizerState:
        """State for a sequence whose output begins after ``num_prompt_tokens`` tokens."""
        return DetokenizerState(
            prefix_offset=max(0, num_prompt_tokens - _CONTEXT_TOKENS),
            read_offset=num_prompt_tokens,
        )

    def step(
        self,
        state: DetokenizerState,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """The text the newest tokens of ``token_ids`` (prompt + output) add; may be "".
        (The decode options may come positionally: the front calls this per token.)

        Advances ``state`` only when text was emitted, so held-back bytes are retried with
        the next token.
        """
        fast = self._backend_decode
        if fast is not None:  # per token per sequence: no helper call on this path
            start = state.prefix_offset
            prefix = fast(token_ids[start : state.read_offset],
                          skip_special_tokens=skip_special_tokens)
            full = fast(token_ids[start:], skip_special_tokens=skip_special_tokens)
        else:
            prefix, full = self._decode_window(state, token_ids, skip_special_tokens,
                                               spaces_between_special_tokens)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        if not full.startswith(prefix):
            # The window's start was re-tokenised differently (rare with SentencePiece's
            # space merging); take the common prefix so no emitted text is repeated.
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            delta = full[common:]
        else:
            delta = full[len(prefix) :]
        state.prefix_offset = state.read_offset
        state.read_offset = len(token_ids)
        return delta

    def _decode_window(self, state: DetokenizerState, token_ids: list[int],
                       skip_special_tokens: bool,
                       spaces_between_special_tokens: bool) -> tuple[str, str]:
        """Text of the window without, and with, the tokens not yet emitted."""
        start = state.prefix_offset
        fast = self._backend_decode
        if fast is not None:
            return (fast(token_ids[start : state.read_offset],
                         skip_special_tokens=skip_special_tokens),
                    fast(token_ids[start:], skip_special_tokens=skip_special_tokens))
        kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        return (self.tokenizer.decode(token_ids[start : state.read_offset], **kwargs),
                self.tokenizer.decode(token_ids[start:], **kwargs))

    def flush(
        self,
        state: DetokenizerState,
        token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """What is still held back when the sequence ends: bytes that never completed a
        character decode as U+FFFD, exactly as a one-shot decode of the ids would."""
        prefix, full = self._decode_window(state, token_ids, skip_special_tokens,
                                           spaces_between_special_tokens)
        state.prefix_offset = state.read_offset = len(token_ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""
