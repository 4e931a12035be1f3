"""``ServerLimits``: what one client may ask of ``quire serve``, checked on creation.

Every limit is a ``quire serve`` flag of the same name (``max_stop_strings`` is
``--max-stop-strings``; seconds drop their ``_s``: ``--header-timeout``). A request over a
limit is refused with HTTP 400 (413 for the body) whose message names the limit and its
flag, before any expensive work is done for it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``max_prompt_bytes`` when not given: this many bytes per token of the context. A
#: prompt longer than that could only fit the context at over 32 bytes per token, which no
#: tokenizer's text averages; so nothing that could be served is refused.
PROMPT_BYTES_PER_TOKEN = 32
#: ... and never less than this.
MIN_DEFAULT_PROMPT_BYTES = 2**20


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-connection bounds of the HTTP server."""

    #: Largest request body (413 beyond it).
    max_body_bytes: int = 8 * 2**20
    #: Largest prompt text, in UTF-8 bytes, before tokenization (all prompts and
    #: messages of one request together); None: derived from the context length.
    max_prompt_bytes: int | None = None
    #: Most stop strings per request.
    max_stop_strings: int = 64
    #: Longest stop string, in characters (streams hold back that many characters).
    max_stop_string_chars: int = 1024
    #: Most sequences per request: prompts times ``n``.
    max_sequences_per_request: int = 256
    #: Most outputs a stream may have queued unread; beyond it the client is
    #: disconnected and its request aborted.
    max_stream_backlog: int = 1024
    #: Seconds a client may take to send a request's headers.
    header_timeout_s: float = 30.0
    #: Seconds a client may take to send a request's body, once its headers are in.
    body_timeout_s: float = 60.0
    #: Seconds a stream may wait for the client to take one event before it is cut.
    stream_send_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_stop_strings", "max_stop_string_chars",
                     "max_sequences_per_request", "max_stream_backlog"):
            _positive_int(name, getattr(self, name))
        if self.max_prompt_bytes is not None:
            _positive_int("max_prompt_bytes", self.max_prompt_bytes)
        for name in ("header_timeout_s", "body_timeout_s", "stream_send_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")

    def prompt_bytes(self, max_model_len: int) -> int:
        """The prompt byte limit in force for a model of ``max_model_len`` tokens."""
        if self.max_prompt_bytes is not None:
            return self.max_prompt_bytes
        return max(MIN_DEFAULT_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * max_model_len)


def flag(name: str) -> str:
    """The ``quire serve`` flag of limit ``name`` (``header_timeout_s``: ``--header-timeout``)."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
