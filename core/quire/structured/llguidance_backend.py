"""The llguidance grammar engine (https://github.com/guidance-ai/llguidance).

Chosen over xgrammar because its wheel depends on nothing (xgrammar's requires torch,
transformers and triton, and would pull its own torch next to our pinned build), it reads
every kind vLLM offers (JSON schema, regex, choice, Lark and GBNF grammars) with errors
that name the problem, and it builds a grammar's lexer lazily, so a new schema costs
milliseconds, not a compile step. Grammars are cached by their text.
"""

from __future__ import annotations

import functools
import json
import threading

import torch

from quire.structured.backend import GrammarBackend, Matcher
from quire.structured.params import StructuredOutputsParams

#: Compiled grammar texts kept, least recently used dropped first.
CACHE_SIZE = 1024
#: JSON whitespace allowed between two tokens of the syntax, unless the schema says
#: otherwise (``"x-guidance"``): room to indent, but a small model at temperature 1
#: otherwise fills ``max_tokens`` with blank lines, which any-whitespace JSON allows.
JSON_WHITESPACE = r"[\n\t ]{0,20}"


class _LLMatcher(Matcher):
    def __init__(self, matcher: object) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> None:
        self._m.consume_token(token)

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def num_valid(self, tokens: list[int]) -> int:
        return int(self._m.validate_tokens(tokens)) if tokens else 0

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)


class LLGuidanceBackend(GrammarBackend):
    """:param tokenizer: the engine's Hugging Face fast tokenizer.
    :param vocab_size: the width of the model's logits (may exceed the tokenizer's).
    :param eos_token_ids: what ends a sequence once the grammar is complete."""

    def __init__(self, tokenizer: object, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids) or None)
        self._lock = threading.Lock()  # check() runs on the front's tokenizer threads
        self._grammar = functools.lru_cache(maxsize=CACHE_SIZE)(self._compile)

    def _compile(self, kind: str, text: str) -> str:
        """The llguidance grammar for (kind, text); raises ValueError naming the error."""
        ll = self._ll
        try:
            if kind == "json_object":
                grammar = ll.grammar_from("json_schema",
                                          _bounded_whitespace('{"type": "object"}'))
            elif kind == "grammar":
                grammar = ll.grammar_from("grammar", text)
            elif kind == "json":
                grammar = ll.grammar_from("json_schema", _bounded_whitespace(text))
            else:
                grammar = ll.grammar_from(kind, text)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{kind}: {exc}") from None
        error = ll.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{kind}: {error.strip()}")
        return grammar

    def check(self, spec: StructuredOutputsParams) -> None:
        with self._lock:
            self._grammar(*spec.key())

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        with self._lock:
            grammar = self._grammar(*spec.key())
        m = self._ll.LLMatcher(self._tokenizer, grammar)
        if m.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: {m.get_error()}")
        return _LLMatcher(m)


def _bounded_whitespace(schema_text: str) -> str:
    """The schema with :data:`JSON_WHITESPACE` as its whitespace, unless it sets its own
    llguidance options."""
    schema = json.loads(schema_text)
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    return json.dumps(schema)
