"""What a request asks its output to follow (vLLM's ``StructuredOutputsParams``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The kinds, in the order they are looked for; exactly one is given.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of:

    * ``json``: a JSON schema (a dict, or its JSON text); the output is JSON that
      validates against it.
    * ``regex``: the output matches this regular expression (Rust ``regex`` syntax, as
      llguidance reads it: no look-around, no back-references).
    * ``choice``: the output is one of these strings.
    * ``grammar``: a context-free grammar, in GBNF (llama.cpp's) or Lark syntax.
    * ``json_object``: True: the output is any JSON object.

    Checked on creation (shape only: whether a schema, regex or grammar compiles is
    decided by the engine, which refuses the request naming the problem).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object"
                                      else self.json_object is not False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of "
                             f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        kind = given[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") \
                        from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an "
                                 f"object), got {type(parsed).__name__}")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        elif kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            self.choice = list(self.choice)
        elif self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) is not None if k != "json_object"
                                         else self.json_object))

    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else \
                json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(self.choice)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text
