"""Tool calls in a model's own words: one parser per model family, picked with
``quire serve --tool-call-parser NAME``, for ``tool_choice: "auto"``.

A parser splits a finished answer into its text and its calls; ``marker`` is what begins
a call, so that a stream can send the text before it at once and hold back what follows.
A malformed call is never an exception: the whole text comes back as content.

============  ============================================  =============================
name          the model writes                              families
============  ============================================  =============================
``hermes``    ``<tool_call>{"name", "arguments"}</tool_call>``  Hermes, Qwen 2.5 / 3
``llama3_json``  ``{"name", "parameters"}`` (after an optional ``<|python_tag|>``; several
              separated by ``;``)                           Llama 3.1 / 3.2 / 3.3
``mistral``   ``[TOOL_CALLS][{"name", "arguments"}, ...]``   Mistral, Mixtral
============  ============================================  =============================
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    #: The arguments as JSON text (OpenAI's ``function.arguments``).
    arguments: str


class ToolParser(ABC):
    """Splits a model's answer into content and tool calls."""

    #: What begins a call in this format; a stream holds back text from here on.
    marker: str

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls); with no calls, or a malformed one, ``(text, [])``."""

    def content_before_call(self, text: str) -> str:
        """The text that surely is content: everything before the first marker, less a
        tail that might be the marker's beginning."""
        at = text.find(self.marker)
        if at >= 0:
            return text[:at]
        for keep in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-keep:]):
                return text[:-keep]
        return text


def _call(obj: Any, args_key: str) -> ToolCall:
    """A call from a decoded object; raises ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        json.loads(args)  # must be JSON text already
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser(ToolParser):
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.marker not in text:
            return text, []
        try:
            blocks = self._block.findall(text)
            if not blocks:
                raise ValueError("no closed call")
            calls = [_call(json.loads(b), "arguments") for b in blocks]
        except ValueError:
            return text, []
        return text[: text.index(self.marker)].strip(), calls


class Llama3JsonParser(ToolParser):
    marker = "{"  # a bare JSON object is the call; <|python_tag|> may precede it
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self._tag):
            body = body[len(self._tag):].strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, at = [], 0
        try:
            while at < len(body):
                obj, end = decoder.raw_decode(body, at)
                calls.append(_call(obj, "parameters"))
                at = end
                while at < len(body) and body[at] in " \n\t;":
                    at += 1
        except ValueError:
            return text, []
        return "", calls

    def content_before_call(self, text: str) -> str:
        # a call is the whole answer, so nothing is content until it is clearly prose
        stripped = text.lstrip()
        if not stripped or stripped[0] in "{<":
            return ""
        return text


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.marker)
        if at < 0:
            return text, []
        try:
            payload = json.loads(text[at + len(self.marker):].strip())
            items = payload if isinstance(payload, list) else [payload]
            calls = [_call(item, "arguments") for item in items]
            if not calls:
                raise ValueError("no call")
        except ValueError:
            return text, []
        return text[:at].strip(), calls


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
