"""Anthropic's Messages API (``POST /v1/messages``) end to end: uvicorn in a thread, the
tiny model, the official ``anthropic`` client. Every wait is bounded."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.limits import ServerLimits
from server_thread import serve_stepped, wait_idle

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
MODEL = "tiny"
KEY = "secret"
HI = [{"role": "user", "content": "Once upon a time"}]
# The current SDK has no sampling arguments (newer Claude models fix them); the body
# field still works, and greedy decoding makes answers repeatable.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    engine = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", max_model_len=128))
    srv = serve_stepped(engine, lambda aengine: create_app(
        aengine, MODEL, api_key=KEY, limits=ServerLimits(max_body_bytes=20_000),
        chat_template=CHAT_TEMPLATE),
        max_waiting_requests=8)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=30, max_retries=0)


def post(server, body=None, headers=None, **kw):
    headers = {"x-api-key": KEY} if headers is None else headers
    if body is not None:
        kw["json"] = body
    return httpx.post(server.url + "/v1/messages", headers=headers, timeout=30, **kw)


def count_tokens(server, messages):
    """The chat-template prompt length, from the OpenAI-style /tokenize route."""
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def sse_events(lines):
    """(event name, data) pairs of an SSE body, checking each event's name is its type."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name
            out.append((name, data))
            name = None
    return out


def assert_error(exc_info, status, kind):
    err = exc_info.value
    assert err.status_code == status
    assert set(err.body) == {"type", "error"} and err.body["type"] == "error"
    assert err.body["error"]["type"] == kind and err.body["error"]["message"]
    return err.body["error"]["message"]


# -- answers -----------------------------------------------------------------------------
def test_whole_message_shape_and_usage(server, client):
    msg = client.messages.create(model=MODEL, max_tokens=6, messages=HI, extra_body=GREEDY,
                                 metadata={"user_id": "u1"})
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.stop_sequence is None
    assert msg.usage.input_tokens == count_tokens(server, HI)
    assert 1 <= msg.usage.output_tokens <= 6


def test_streamed_text_equals_whole_text(client):
    args = {"model": MODEL, "max_tokens": 10, "messages": HI, "extra_body": GREEDY}
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    # stream=True hands back the raw events
    kinds = [e.type for e in client.messages.create(**args, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_wire_events_in_anthropic_order(server):
    body = {"model": MODEL, "max_tokens": 5, "messages": HI, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30,
                      headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == count_tokens(server, HI)
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    end = events[-2][1]
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 1 <= end["usage"]["output_tokens"] <= 5


def test_max_tokens_stop_reason(client):
    msg = client.messages.create(model=MODEL, max_tokens=1, messages=HI, extra_body=GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 1


def test_stop_sequence_whole_and_streamed(client):
    args = {"model": MODEL, "max_tokens": 12, "messages": HI, "extra_body": GREEDY}
    free = client.messages.create(**args).content[0].text
    assert len(free) >= 4, f"the tiny model stopped too soon to test: {free!r}"
    stop = free[len(free) // 2:len(free) // 2 + 2]
    msg = client.messages.create(**args, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == free[:free.find(stop)]
    with client.messages.stream(**args, stop_sequences=[stop]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_system_prompt_and_text_blocks(server, client):
    system = "You are terse."
    msg = client.messages.create(
        model=MODEL, max_tokens=2, extra_body=GREEDY,
        system=[{"type": "text", "text": system}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Once upon "},
                                                {"type": "text", "text": "a time"}]}])
    with_system = [{"role": "system", "content": system}, *HI]
    assert msg.usage.input_tokens == count_tokens(server, with_system)
    assert msg.usage.input_tokens > count_tokens(server, HI)


def test_consecutive_turns_of_one_role_are_merged(server, client):
    msg = client.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Once upon"}, {"role": "user", "content": "a time"}])
    merged = [{"role": "user", "content": "Once upon\n\na time"}]
    assert msg.usage.input_tokens == count_tokens(server, merged)


def test_assistant_prefill_is_continued(server, client):
    prefill = "The end"
    msg = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY,
                                 messages=[*HI, {"role": "assistant", "content": prefill}])
    # the prompt is the rendered conversation so far, then the prefill, as raw text
    prompt = "<s>user: Once upon a time\nassistant:" + prefill
    r = httpx.post(server.url + "/tokenize", timeout=30,
                   json={"prompt": prompt, "add_special_tokens": False},
                   headers={"Authorization": f"Bearer {KEY}"})
    ids = r.json()["tokens"]
    assert msg.usage.input_tokens == len(ids)
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert msg.content[0].text == r.json()["choices"][0]["text"]


def test_disconnect_mid_stream_frees_pages(server):
    body = {"model": MODEL, "max_tokens": 100, "messages": HI, "stream": True, **GREEDY}
    # After the held step, the greedy answer has a dozen tokens to go: >= 3 s at 0.3 s a
    # step. Pages back within 1.5 s of letting go can only be the abort.
    server.step_delay[0] = 0.3
    server.steps_since_hold[0] = 0
    server.hold.set()  # one step (the prompt and first token) runs, then the engine waits
    try:
        with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30,
                          headers={"x-api-key": KEY}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: dropping a half-read iterator closes the socket
            assert next(lines) == "event: message_start"
            deadline = time.monotonic() + 10
            # read directly: the engine thread is held and cannot answer stats()
            while server.block_manager.num_used_blocks == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.01)
        server.hold.clear()  # the client is gone; let the engine see it
        wait_idle(server, timeout=1.5)
    finally:
        server.hold.clear()
        server.step_delay[0] = 0.0


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("body,field", [
    ({"messages": HI}, "max_tokens"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens"),
    ({"messages": HI, "max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5}, "messages"),
    ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 5}, "role"),
    ({"messages": [{"role": "user", "content": 5}], "max_tokens": 5}, "content"),
    ({"messages": HI, "max_tokens": 5, "system": [{"type": "image"}]}, "system[0]"),
    ({"messages": HI, "max_tokens": 5, "temperature": 1.5}, "temperature"),
    ({"messages": HI, "max_tokens": 5, "top_p": 0}, "top_p"),
    ({"messages": HI, "max_tokens": 5, "stop_sequences": [""]}, "stop_sequences"),
])
def test_bad_fields_are_400_naming_the_field(server, body, field):
    r = post(server, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and field in err["message"]


def test_client_exceptions_match_statuses(client, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "user", "content": [image]}])
    assert "messages[0].content[0]" in assert_error(exc, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "tool", "content": "hi"}])
    assert "messages[0]" in assert_error(exc, 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="claude-nope", max_tokens=5, messages=HI)
    assert "claude-nope" in assert_error(exc, 404, "not_found_error")
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", timeout=30,
                                max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=HI)
    assert_error(exc, 401, "authentication_error")


def test_raw_errors_and_server_keeps_answering(server, client):
    r = post(server, content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]
    r = post(server, content=b"x" * 30_000)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = post(server, {"model": MODEL, "max_tokens": 5, "messages": HI}, headers={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = post(server, {"model": MODEL, "max_tokens": 1, "messages": HI},
             headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text  # a Bearer token works too
    r = post(server, {"model": MODEL, "max_tokens": 5,
                      "messages": [{"role": "user", "content": "x " * 200}]})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    # the OpenAI routes keep their own error shape
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    ok = client.messages.create(model=MODEL, max_tokens=2, messages=HI)
    assert ok.stop_reason in ("end_turn", "max_tokens")
    wait_idle(server)


def test_overload_is_503_with_retry_after(server, client):
    engine = server.engine
    saved = engine.max_waiting_requests
    engine.max_waiting_requests = 0  # every request is over the bound
    try:
        with pytest.raises(anthropic.InternalServerError) as exc:
            client.messages.create(model=MODEL, max_tokens=1, messages=HI)
    finally:
        engine.max_waiting_requests = saved
    assert_error(exc, 503, "overloaded_error")
    assert exc.value.response.headers["retry-after"]
