"""Incremental detokenization: the text of each new token, as it is sampled.

Decoding one token id at a time is wrong for both tokenizer families: byte-level BPE
splits a multi-byte character over several tokens (each alone decodes to U+FFFD), and
SentencePiece decides a token's leading space from its neighbour. So each sequence keeps
two offsets into its token ids: text is decoded from a window starting a few tokens back
(``prefix_offset``), and only what the newest tokens add beyond the already emitted part
(up to ``read_offset``) is returned. A window whose text ends in an incomplete character
emits nothing until the character is complete.

With a fast tokenizer, ``tokenizers``' ``DecodeStream`` follows the same window, so a
token usually costs one call into the library instead of two decodes; where its rule
could differ from ours, the two decodes take over for that sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    #: The ``tokenizers.decoders.DecodeStream`` that follows the same offsets (fast path).
    stream: Any = None
    #: How many tokens the stream has seen: 0 before it starts, -1 once given up.
    fed: int = 0
    stream_skip: bool = True


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


def _decode_stream() -> type | None:
    """``tokenizers``' ``DecodeStream`` when it can start from a window of ids (0.21+)."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=True)
    except (ImportError, TypeError):
        return None
    return DecodeStream


class IncrementalDetokenizer:
    """Turns token ids into text deltas; one instance per engine, state per sequence."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # the fast path takes no spaces_between_special_tokens: fast tokenizers ignore it
        self._backend_decode = backend_decode(tokenizer)
        self._stream_type = _decode_stream() if self._backend_decode is not None else None
        self._backend = getattr(tokenizer, "_tokenizer", None)

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
        if fast is not None and state.fed >= 0:
            text = self._stream_step(state, token_ids, skip_special_tokens)
            if text:
                return text
        if fast is not None:  # per token per sequence: no helper call on this path
            start = state.prefix_offset
            prefix = fast(token_ids[start : state.read_offset],
                          skip_special_tokens=skip_special_tokens)
            full = fast(token_ids[start:], skip_special_tokens=skip_special_tokens)
        else:
            prefix, full = self._decode_window(state, token_ids, skip_special_tokens,
                                               spaces_between_special_tokens)
        if state.stream is not None and not prefix:
            # the stream would take the held-back tokens into an empty prefix: ours differ
            state.stream, state.fed = None, -1
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
        if state.stream is not None:  # the stream did not emit this: it is behind now
            state.stream, state.fed = None, -1
        state.prefix_offset = state.read_offset
        state.read_offset = len(token_ids)
        return delta

    def _stream_step(self, state: DetokenizerState, token_ids: list[int],
                     skip_special_tokens: bool) -> str | None:
        """The newest token's text by one ``DecodeStream.step`` (one call instead of two
        decodes), or None when the two decodes must decide.

        The stream keeps our window (from ``prefix_offset``) and its decoded prefix,
        which our step would decode again, so where it emits, its text is ours and the
        offsets move as ours do. Where its rule may differ from ours it is given up for
        the sequence (``fed = -1``): a window whose start re-tokenised (it raises, we
        take the common prefix); a prompt window that ends in an incomplete character
        (it starts from an empty prefix, we from that text); a step that emitted nothing,
        after which ours decides and :meth:`step` gives it up when ours emits or the
        prefix is empty (it would then re-read the prefix over the held-back tokens);
        a call that skipped tokens or changed the options.
        """
        n, stream = len(token_ids), state.stream
        if stream is None:
            if state.fed != 0 or self._stream_type is None or n != state.read_offset + 1:
                state.fed = -1
                return None
            window = token_ids[state.prefix_offset : state.read_offset]
            if self._backend_decode(window, skip_special_tokens=skip_special_tokens
                                    ).endswith(_REPLACEMENT):
                state.fed = -1
                return None
            stream = state.stream = self._stream_type(
                ids=window, skip_special_tokens=skip_special_tokens)
            state.fed, state.stream_skip = n - 1, skip_special_tokens
        if n != state.fed + 1 or skip_special_tokens != state.stream_skip:
            state.stream, state.fed = None, -1
            return None
        state.fed = n
        try:
            text = stream.step(self._backend, token_ids[-1])
        except Exception:  # InvalidPrefix (the window re-tokenised): ours takes over
            state.stream, state.fed = None, -1
            return None
        if text is None:
            return None
        state.prefix_offset = state.read_offset
        state.read_offset = n
        return text

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
        state.stream, state.fed = None, -1
        return full[len(prefix) :] if full.startswith(prefix) else ""
