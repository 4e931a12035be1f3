"""A request body -> a JSON object whose every string is valid Unicode, or a 400.

JSON allows what no tokenizer can take (lone surrogates such as ``"\\ud800"``) and nesting
deeper than Python's parser recurses; both are refused here, once, for every route, with
the path of the offending value (``messages[0].role``), so no route meets them later.
"""

from __future__ import annotations

import json
from typing import Any

from quire.entrypoints.server.errors import bad_request


def parse_json(raw: bytes) -> dict[str, Any]:
    """``raw`` parsed; blocking (run it off the event loop for large bodies).

    :raises APIError: 400 for invalid JSON, a body that is not an object, nesting beyond
        the parser's depth, or a string (key or value) that is not valid Unicode.
    """
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request("the body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    bad = invalid_text_path(body)
    if bad is not None:
        raise bad_request(f"{bad} is not valid Unicode text (it holds a lone surrogate)",
                          param=bad.split("[", 1)[0].split(".", 1)[0] or None)
    return body


def invalid_text_path(value: Any) -> str | None:
    """The path of the first string in ``value`` (a parsed JSON value) that UTF-8 cannot
    encode, or None. Iterative, so any depth the parser accepted is walked."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _is_valid(item):
                return path or "the body"
        elif isinstance(item, dict):
            for key, child in item.items():
                name = f"{path}.{key}" if path else str(key)
                if not _is_valid(key):
                    return (path + ".<key>") if path else "a key"
                stack.append((name, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


def _is_valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
