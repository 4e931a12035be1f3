"""A reasoning model's thinking, kept apart from its answer: ``quire serve
--reasoning-parser NAME`` puts it in ``message.reasoning_content`` (streamed as
``delta.reasoning_content``).

========================  ===============================================================
name                      the model writes
========================  ===============================================================
``qwen3``                 ``<think>...</think>`` first, then the answer; an answer with no
                          ``<think>`` (thinking switched off) is all content
``deepseek_r1``           the thinking from the start (its template opened ``<think>``)
                          up to ``</think>``, then the answer
========================  ===============================================================

Streams ask :meth:`ReasoningParser.split` of the text so far, with ``final=False``: the
tail that may still turn into a tag is held back.
"""

from __future__ import annotations

from typing import Any

from quire.engine.messages import ThinkingTokens

START, END = "<think>", "</think>"


def _hold(text: str, tag: str) -> str:
    """``text`` less a tail that could be the beginning of ``tag``."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return text[:-keep]
    return text


class ReasoningParser:
    """Qwen3's rule: thinking only inside a leading ``<think>`` block."""

    #: True when the thinking starts with the answer, its opening tag in the prompt.
    opened_by_template = False

    def tokens(self, tokenizer: Any) -> ThinkingTokens | None:
        """The markers as the core takes them (a grammar then holds only the answer), or
        None when the tokenizer does not have each as one token."""
        ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
        if any(len(i) != 1 for i in ids):
            return None
        return ThinkingTokens(end=ids[1][0],
                              start=None if self.opened_by_template else ids[0][0])

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of ``text``; reasoning is None when there is none."""
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
        elif not self.opened_by_template:
            if not final and START.startswith(body):  # "<thi": wait and see
                return None, ""
            return None, text
        # Leading newlines are dropped from both parts, nothing else: a stream's parts
        # then only ever grow, and end as the whole answer's.
        end = body.find(END)
        if end < 0:  # still thinking (or cut while thinking, as vLLM reads it)
            thinking = (body if final else _hold(body, END)).lstrip("\n")
            return (thinking or None) if final else thinking, ""
        return body[:end].lstrip("\n") or None, body[end + len(END):].lstrip("\n")


class DeepSeekR1Parser(ReasoningParser):
    opened_by_template = True


PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ReasoningParser,
    "deepseek_r1": DeepSeekR1Parser,
}
