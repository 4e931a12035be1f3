"""``RequestOutput`` -> OpenAI response objects (whole answers and streamed chunks)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from quire.entrypoints.server.reasoning_parsers import ReasoningParser
from quire.entrypoints.server.tool_parsers import ToolParser
from quire.entrypoints.server.tools import ToolRequest, openai_calls, split_answer
from quire.outputs import CompletionOutput, PositionLogprobs, RequestOutput


def usage(*outs: RequestOutput) -> dict[str, int]:
    """Token counts summed over the outputs of one API request (one per prompt)."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _ranked(pos: PositionLogprobs, chosen: int, k: int,
            decode: Any) -> tuple[tuple[str, float], list[tuple[str, float]]]:
    def text(tid: int) -> str:
        lp = pos[tid]
        return lp.decoded_token if lp.decoded_token is not None else decode([tid])

    top = sorted((t for t in pos if pos[t].rank is not None and pos[t].rank <= k),
                 key=lambda t: pos[t].rank or 0)
    return (text(chosen), pos[chosen].logprob), [(text(t), pos[t].logprob) for t in top]


def completion_logprobs(c: CompletionOutput, start: int, k: int, decode: Any,
                        offset: int) -> dict[str, Any]:
    """OpenAI's legacy shape for tokens ``start:`` of ``c``."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, pos in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        (tok, lp), top = _ranked(pos, tid, k, decode)
        tokens.append(tok)
        lps.append(lp)
        tops.append(dict(top))
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs(out: RequestOutput, k: int, decode: Any) -> dict[str, Any]:
    """The legacy shape for the prompt's tokens (``echo`` with ``logprobs``); nothing
    predicts the first token, so its entries are None."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    positions = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for tid, pos in zip(out.prompt_token_ids, positions):
        if pos is None:
            tok, lp, top = decode([tid]), None, None
        else:
            (tok, lp), ranked = _ranked(pos, tid, k, decode)
            top = dict(ranked)
        tokens.append(tok)
        lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def _joined(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(c: CompletionOutput, start: int, k: int, decode: Any) -> dict[str, Any]:
    """OpenAI's chat shape for tokens ``start:`` of ``c``."""
    content = []
    for tid, pos in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        (tok, lp), top = _ranked(pos, tid, k, decode)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in top]})
    return {"content": content}


class Shaper:
    """Builds one request's answer (``chat`` or not), whole or as stream chunks.

    For streams (``DELTA`` outputs) it remembers how much text and how many tokens of each
    choice were sent.
    """

    def __init__(self, *, chat: bool, model: str, request_id: str, top_logprobs: int | None,
                 decode: Any, echo_prompt: str | None = None, index_base: int = 0,
                 created: int | None = None, tools: ToolRequest | None = None,
                 tool_parser: ToolParser | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        """:param index_base: added to each choice's index (the ``i * n`` of prompt ``i``
            when one completions request carries several prompts).
        :param echo_prompt: completions only: text put in front of each choice's text.
        :param tools: chat only: the request's tools; answers then carry ``tool_calls``
            (streamed: text before a call goes at once, the calls when the choice ends).
        :param tool_parser: reads ``tool_choice: "auto"`` calls from the model's format.
        :param reasoning: chat only: splits the thinking (``reasoning_content``) from the
            answer, which tool calls are then read from."""
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.reasoning = reasoning
        self.tool_parser = tool_parser
        self._text: dict[int, str] = {}  # split streams: each choice's text so far
        # ... and how much of its thinking and of its content went out
        self._shown: dict[int, tuple[int, int]] = {}
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time()) if created is None else created
        self.top_logprobs = top_logprobs
        self.decode = decode
        self.echo_prompt = echo_prompt
        self.index_base = index_base
        self._sent: dict[int, tuple[int, int, bool]] = {}  # index -> chars, tokens, done
        self.prompt_tokens: int | None = None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, out: RequestOutput, c: CompletionOutput, start: int, offset: int,
                  with_prompt: bool = False) -> Any:
        if self.top_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(c, start, self.top_logprobs, self.decode)
        generated = completion_logprobs(c, start, self.top_logprobs, self.decode, offset)
        if with_prompt and self.echo_prompt is not None:
            return _joined(prompt_logprobs(out, self.top_logprobs, self.decode), generated)
        return generated

    def choices(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The whole answer's choices for ``out`` (a finished output)."""
        choices = []
        for c in out.outputs:
            index = self.index_base + c.index
            if self.chat:
                thinking, content, calls = split_answer(c.text, True, self.tools,
                                                        self.tool_parser, self.reasoning)
                message: dict[str, Any] = {"role": "assistant", "content": content}
                reason = c.finish_reason
                if calls:
                    message["tool_calls"] = openai_calls(calls)
                    reason = "tool_calls" if reason == "stop" else reason
                if self.reasoning is not None:
                    message["reasoning_content"] = thinking
                choice = {"index": index, "message": message,
                          "logprobs": self._logprobs(out, c, 0, 0),
                          "finish_reason": reason, "stop_reason": c.stop_reason}
            else:
                prefix = self.echo_prompt or ""
                choice = {"index": index, "text": prefix + c.text,
                          "logprobs": self._logprobs(out, c, 0, len(prefix), True),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            choices.append(choice)
        return choices

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": self.choices(out), "usage": usage(out)}

    def chunks(self, out: RequestOutput) -> Iterator[dict[str, Any]]:
        """The chunks that carry ``out``, a ``DELTA`` output (what one step added)."""
        if self.prompt_tokens is None:
            self.prompt_tokens = len(out.prompt_token_ids)
        for c in out.outputs:
            chars, tokens, done = self._sent.get(c.index, (0, 0, False))
            if done:
                continue
            first = c.index not in self._sent
            delta_text = c.text
            if self.echo_prompt and first:
                delta_text = self.echo_prompt + delta_text
            self._sent[c.index] = (chars + len(c.text), tokens + len(c.token_ids),
                                   c.finish_reason is not None)
            # a token whose bytes end mid-character adds no text yet; it is sent anyway
            # when its logprobs are asked for, since no later chunk carries them
            wanted = self.top_logprobs is not None and bool(c.token_ids)
            if not delta_text and not c.finish_reason and not first and not wanted:
                continue
            offset = chars + len(self.echo_prompt or "")
            logprobs = self._logprobs(out, c, 0, offset, with_prompt=first)
            index = self.index_base + c.index
            if self.chat and (self.tools is not None or self.reasoning is not None):
                yield from self._split_chunks(c, index, delta_text, first, logprobs)
                continue
            if self.chat:
                delta: dict[str, Any] = {"content": delta_text}
                if first:
                    delta["role"] = "assistant"
                choice = {"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": c.finish_reason}
            else:
                choice = {"index": index, "text": delta_text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason}
            yield self.chunk([choice])

    def _split_chunks(self, c: CompletionOutput, index: int, delta_text: str, first: bool,
                      logprobs: Any) -> Iterator[dict[str, Any]]:
        """A chat stream whose text is split: thinking (``reasoning_content``) and answer,
        and in the answer text and tool calls. What is surely thinking or text goes out
        at once; what may still turn into a tag or a call is held, and goes out when the
        choice ends (as ``tool_calls`` deltas if it parses as calls, as text if not)."""
        text = self._text[c.index] = self._text.get(c.index, "") + delta_text
        final = c.finish_reason is not None
        thinking, parsed, calls = split_answer(text, final, self.tools, self.tool_parser,
                                               self.reasoning)
        content = parsed or ""
        sent_thinking, sent_content = self._shown.get(c.index, (0, 0))
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if thinking and len(thinking) > sent_thinking:
            delta["reasoning_content"] = thinking[sent_thinking:]
        if len(content) > sent_content:
            delta["content"] = content[sent_content:]
        if calls:
            delta["tool_calls"] = [{"index": i, **call}
                                   for i, call in enumerate(openai_calls(calls))]
        self._shown[c.index] = (max(sent_thinking, len(thinking or "")),
                                max(sent_content, len(content)))
        reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        if delta or logprobs is not None or final:
            yield self.chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                               "finish_reason": reason}])

    def usage(self) -> dict[str, int]:
        """Token counts of what was streamed (prompt counted once it was seen)."""
        prompt = self.prompt_tokens or 0
        completion = sum(tokens for _, tokens, _ in self._sent.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def chunk(self, choices: list[dict[str, Any]],
              usage_: dict[str, int] | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {**self._head(obj), "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body
