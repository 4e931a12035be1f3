"""Reasoning parsers on recorded answers, and the chat shaper that streams thinking as
``reasoning_content`` apart from the answer (and tool calls read from the answer only)."""

from __future__ import annotations

import pytest
from quire.entrypoints.server.reasoning_parsers import DeepSeekR1Parser, ReasoningParser
from quire.entrypoints.server.responses import Shaper
from quire.entrypoints.server.tool_parsers import HermesParser
from quire.entrypoints.server.tools import parse_tools
from quire.outputs import CompletionOutput, RequestOutput

THOUGHT = "<think>\nThe user asks for France's capital.\n</think>\n\nParis."


@pytest.mark.parametrize("parser, text, split", [
    (ReasoningParser(), THOUGHT, ("The user asks for France's capital.\n", "Paris.")),
    (ReasoningParser(), "Paris.", (None, "Paris.")),  # thinking switched off
    (ReasoningParser(), "<think>cut while thinking", ("cut while thinking", "")),
    (DeepSeekR1Parser(), "hmm</think>Paris.", ("hmm", "Paris.")),
    (DeepSeekR1Parser(), "<think>hmm</think>Paris.", ("hmm", "Paris.")),
    (DeepSeekR1Parser(), "no end tag", ("no end tag", "")),
])
def test_recorded_answers_split(parser, text, split):
    assert parser.split(text) == split


def test_partial_tags_are_held_while_streaming():
    q = ReasoningParser()
    assert q.split("<thi", final=False) == (None, "")
    assert q.split("<think>abc</th", final=False) == ("abc", "")
    assert q.split("Par", final=False) == (None, "Par")


def _stream(shaper: Shaper, text: str, piece: int = 3) -> list[dict]:
    chunks = []
    for at in range(0, len(text), piece):
        end = at + piece >= len(text)
        out = RequestOutput("r", None, [1], [CompletionOutput(
            0, text[at:at + piece], [1], finish_reason="stop" if end else None)], end)
        chunks += [c["choices"][0] for c in shaper.chunks(out)]
    return chunks


def _shaper(**kw) -> Shaper:
    return Shaper(chat=True, model="m", request_id="r", top_logprobs=None,
                  decode=lambda ids: "", **kw)


def test_streamed_thinking_and_answer_equal_the_whole_message():
    whole = _shaper(reasoning=ReasoningParser()).whole(RequestOutput(
        "r", None, [1], [CompletionOutput(0, THOUGHT, [1], finish_reason="stop")], True))
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "The user asks for France's capital.\n"
    assert message["content"] == "Paris."
    chunks = _stream(_shaper(reasoning=ReasoningParser()), THOUGHT)
    thinking = "".join(c["delta"].get("reasoning_content", "") for c in chunks)
    answer = "".join(c["delta"].get("content", "") for c in chunks)
    assert thinking == message["reasoning_content"] and answer == message["content"]
    assert chunks[-1]["finish_reason"] == "stop"


def test_tool_calls_are_read_from_the_answer_after_the_thinking():
    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}]},
                        HermesParser())
    text = ('<think>I should call f.</think>\nOne moment. <tool_call>{"name": "f", '
            '"arguments": {"a": 1}}</tool_call>')
    kw = dict(reasoning=ReasoningParser(), tools=tools, tool_parser=HermesParser())
    whole = _shaper(**kw).whole(RequestOutput(
        "r", None, [1], [CompletionOutput(0, text, [1], finish_reason="stop")], True))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I should call f."
    assert choice["message"]["content"] == "One moment."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    chunks = _stream(_shaper(**kw), text, piece=5)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert [t["function"] for t in calls] == [call["function"]]
    assert "".join(c["delta"].get("content", "") for c in chunks).strip() == "One moment."
    assert "<tool_call>" not in "".join(c["delta"].get("reasoning_content", "")
                                        for c in chunks)


class _Vocab:
    """A tokenizer stand-in: each listed tag is one token, anything else two."""

    def __init__(self, single: dict[str, int]) -> None:
        self.single = single

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.single[text]] if text in self.single else [1, 2]


def test_thinking_markers_go_to_the_core_only_as_single_tokens():
    vocab = _Vocab({"<think>": 7, "</think>": 8})
    q, r = ReasoningParser().tokens(vocab), DeepSeekR1Parser().tokens(vocab)
    assert (q.start, q.end) == (7, 8) and (r.start, r.end) == (None, 8)
    assert ReasoningParser().tokens(_Vocab({"<think>": 7})) is None


def test_anthropic_thinking_block_streamed_and_whole():
    from quire.entrypoints.server.anthropic import MessageShaper

    def shaper() -> MessageShaper:
        return MessageShaper(model="m", request_id="r", input_tokens=1, max_tokens=50,
                             reasoning=ReasoningParser())

    whole = shaper().whole(RequestOutput(
        "r", None, [1], [CompletionOutput(0, THOUGHT, [1], finish_reason="stop")], True))
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "The user asks for France's capital.\n"
    assert whole["content"][1]["text"] == "Paris."
    s = shaper()
    events = s.start()
    for at in range(0, len(THOUGHT), 4):
        end = at + 4 >= len(THOUGHT)
        out = RequestOutput("r", None, [1], [CompletionOutput(
            0, THOUGHT[at:at + 4], [1], finish_reason="stop" if end else None)], end)
        events += s.deltas(out)
        if end:
            events += s.finish(out)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(e["delta"].get("thinking", "") for e in events
                       if e["type"] == "content_block_delta")
    text = "".join(e["delta"].get("text", "") for e in events
                   if e["type"] == "content_block_delta")
    assert (thinking, text) == (whole["content"][0]["thinking"], "Paris.")
    # each block is closed before the next opens
    opened = [e["index"] for e in events if e["type"] == "content_block_start"]
    closed = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert opened == closed == [0, 1]
