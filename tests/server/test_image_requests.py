"""Images over HTTP: OpenAI ``image_url`` parts and Anthropic ``image`` blocks on the tiny
LLaVA give what ``LLM.chat`` gives offline for the same messages and image (data, http
and file URLs; a template that walks parts and one that prints content whole); the
prefix cache keys on the image; every refusal is a 400 in the route's own shape naming
the part, and the server keeps serving. uvicorn in a thread; a local ``http.server``
serves the PNG and the redirects."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from quire import LLM, SamplingParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from quire.entrypoints.server.async_engine import AsyncEngine
from serve_process import metric_sum
from server_thread import Server

from tests.tiny_vlm import build_llava, image

MODEL = "llava"
N = 8
#: A template that prints content whole: images reach it as the placeholder text.
PLAIN = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")
PIC = image(40, 30, 1)
HITS = "quire:prefix_cache_hits_total"
#: A file that exists, outside any allowed media directory.
OUTSIDE = Path(__file__).resolve().as_uri()


def _png(img) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png(PIC)


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _bomb() -> bytes:
    """A PNG declaring 8000 x 6000 pixels (over the policy's 40 M) in a few bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    ihdr = struct.pack(">IIBBBBB", 8000, 6000, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(bytes(1024))) + chunk(b"IEND", b""))


def _ask(url: str, text: str = "What is in ") -> list[dict]:
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " now?"}]}]


# -- fixtures ----------------------------------------------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    """``/pic.png``; ``/slow.png``, held until ``release`` is set; redirects from this
    allowed host to loopback names that are not allowed: ``/to-localhost``
    (``localhost.``) and ``/to-ipv6`` (``[::1]``)."""

    entered = threading.Event()
    release = threading.Event()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        targets = {"/to-localhost": f"http://localhost.:{port}/pic.png",
                   "/to-ipv6": f"http://[::1]:{port}/pic.png"}
        if self.path == "/slow.png":
            _Handler.entered.set()
            _Handler.release.wait(10)
        if self.path in ("/pic.png", "/slow.png"):
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path in targets:
            self.send_response(302)
            self.send_header("Location", targets[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def host():
    """The image host's base URL on 127.0.0.1."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "tiny")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("media")
    (directory / "pic.png").write_bytes(PNG)
    return directory


def _serve(path, chat_template=None, **engine_kw):
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), device="cpu", dtype="float32",
                                                max_model_len=256, **engine_kw))
    aengine = AsyncEngine(engine)
    return Server(create_app(aengine, MODEL, chat_template=chat_template), aengine)


@pytest.fixture(scope="module")
def trusted(llava, media_dir):
    """127.0.0.1 allowed, file:// under the media directory, two images a prompt, small
    pages (so that prefix hits are counted finely)."""
    srv = _serve(llava, allowed_media_domains="127.0.0.1",
                 allowed_local_media_path=str(media_dir), limit_mm_per_prompt=2,
                 block_size=4)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def strict(llava):
    """The default media policy (public hosts only, no files) and the PLAIN template."""
    srv = _serve(llava, chat_template=PLAIN)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def text_only(tiny_checkpoint):
    srv = _serve(tiny_checkpoint("llama"), chat_template=PLAIN)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(llava):
    with LLM(str(llava), dtype="float32") as llm:
        yield llm


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def _anthropic(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0,
                               timeout=60)


def _offline(llm, messages, template=None, ignore_eos=True):
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=ignore_eos)
    return llm.chat(messages, params, chat_template=template)[0]


# -- answers equal the offline ones ------------------------------------------------------
@pytest.mark.parametrize("source", ["data", "http", "file"])
def test_openai_answer_equals_offline(trusted, offline, host, media_dir, source):
    url = {"data": _data_url(PNG), "http": host + "/pic.png",
           "file": (media_dir / "pic.png").as_uri()}[source]
    out = _openai(trusted).chat.completions.create(
        model=MODEL, messages=_ask(url), temperature=0, max_tokens=N,
        extra_body={"ignore_eos": True})
    want = _offline(offline, _ask(_data_url(PNG)))
    assert out.choices[0].message.content == want.outputs[0].text
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert out.usage.completion_tokens == N


def test_placeholder_text_for_a_template_that_prints_content(strict, offline):
    """Two images, one in an earlier turn: the PLAIN template gets the placeholder."""
    messages = [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _data_url(PNG)}},
                    {"type": "text", "text": "first"}]},
                {"role": "assistant", "content": "ok"},
                *_ask(_data_url(_png(image(30, 50, 2))))[1:]]
    out = _openai(strict).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=N,
        extra_body={"ignore_eos": True})
    want = _offline(offline, messages, PLAIN)
    assert out.choices[0].message.content == want.outputs[0].text
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.parametrize("source", ["base64", "url"])
def test_anthropic_answer_equals_offline(trusted, offline, host, source):
    block = {"type": "image", "source": (
        {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
        if source == "base64" else {"type": "url", "url": host + "/pic.png"})}
    out = _anthropic(trusted).messages.create(
        model=MODEL, max_tokens=N, system="Be brief.", extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                               block, {"type": "text", "text": " now?"}]}])
    want = _offline(offline, _ask(_data_url(PNG)), ignore_eos=False)
    assert out.content[0].text == want.outputs[0].text
    assert out.usage.input_tokens == len(want.prompt_token_ids)


def test_streamed_answer_with_a_tool_offered(trusted):
    """Images and tools together: the named tool's call is made, streamed."""
    tool = {"type": "function", "function": {"name": "describe", "parameters": {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
        "required": ["kind"], "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False}}}}
    stream = _openai(trusted).chat.completions.create(
        model=MODEL, messages=_ask(_data_url(PNG)), max_tokens=60, stream=True,
        tools=[tool], tool_choice={"type": "function", "function": {"name": "describe"}})
    calls = [c for chunk in stream for choice in chunk.choices
             for c in choice.delta.tool_calls or []]
    assert calls and calls[0].function.name == "describe"
    assert "".join(c.function.arguments or "" for c in calls) in ('{"kind":"cat"}',
                                                                  '{"kind":"dog"}')


def test_a_slow_image_does_not_stall_the_event_loop(trusted, host):
    """The fetch runs on a tokenizer thread: other requests are answered meanwhile."""
    answer: list[httpx.Response] = []
    body = {"model": MODEL, "messages": _ask(host + "/slow.png"), "max_tokens": 2}
    asker = threading.Thread(target=lambda: answer.append(httpx.post(
        trusted.url + "/v1/chat/completions", json=body, timeout=60)))
    asker.start()
    try:
        assert _Handler.entered.wait(30)
        assert httpx.get(trusted.url + "/health", timeout=2).status_code == 200
        other = _openai(trusted).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            timeout=5)
        assert other.choices and not answer  # answered while the image is still held
    finally:
        _Handler.release.set()
        asker.join(60)
    assert answer[0].status_code == 200, answer[0].text


# -- the prefix cache --------------------------------------------------------------------
def test_prefix_cache_hits_the_same_image_only(trusted, offline):
    def hits() -> float:
        return metric_sum(httpx.get(trusted.url + "/metrics", timeout=10).text, HITS)

    def ask(png: bytes) -> tuple[float, int]:
        before = hits()
        out = _openai(trusted).chat.completions.create(
            model=MODEL, messages=_ask(_data_url(png), "Cached? "), temperature=0,
            max_tokens=2)
        return hits() - before, out.usage.prompt_tokens

    first, other = _png(image(50, 40, 11)), _png(image(50, 40, 12))
    ask(first)
    again, prompt_len = ask(first)
    changed, _ = ask(other)
    ids = httpx.post(trusted.url + "/tokenize", timeout=30,
                     json={"messages": _ask(_data_url(other), "Cached? ")}).json()["tokens"]
    before_image = ids.index(offline.engine.image_inputs().image_token_id)
    # every full page but the one with the last token (its logits are needed)
    assert again == (prompt_len - 1) // 4 * 4
    assert changed == before_image // 4 * 4 < again  # the text before the image only


# -- refusals ----------------------------------------------------------------------------
def _openai_refused(server, messages, param, fragment):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert fragment in error["message"], error


def _anthropic_refused(server, content, where, fragment):
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(where), body
    assert fragment in body["error"]["message"], body


def _block(url: str) -> dict:
    """Anthropic's block for an image URL: a data URL's payload as a base64 source."""
    if url.startswith("data:"):
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": url.partition(",")[2]}}
    return {"type": "image", "source": {"type": "url", "url": url}}


#: (server, URL or a function of the host's URL, what the message says)
REFUSED = [
    ("trusted", "data:image/png;base64,%%%not base64", "invalid base64"),
    ("trusted", _data_url(b"hello, not an image"), "not an image"),
    ("trusted", _data_url(PNG[:len(PNG) // 2]), "truncated"),
    ("trusted", _data_url(_bomb()), "decompression-bomb"),
    ("strict", lambda host: host + "/pic.png", "not a public address"),
    ("trusted", lambda host: host + "/to-localhost", "not among the allowed media domains"),
    ("trusted", lambda host: host + "/to-ipv6", "not among the allowed media domains"),
    ("strict", lambda host: OUTSIDE, "file:// URLs are refused"),
    ("trusted", lambda host: OUTSIDE, "outside the allowed local media path"),
]


@pytest.mark.parametrize("which,url,fragment", REFUSED,
                         ids=[r[2].split()[0] + f"-{i}" for i, r in enumerate(REFUSED)])
def test_image_refusals_are_400_naming_the_part(request, host, which, url, fragment):
    server = request.getfixturevalue(which)
    url = url(host) if callable(url) else url
    _openai_refused(server, _ask(url), "messages[1].content[1]", fragment)
    _anthropic_refused(server, [{"type": "text", "text": "see"}, _block(url)],
                       "messages[0].content[1]", fragment)


def test_too_many_images_are_refused_before_any_is_fetched(trusted, host):
    never = host + "/never-fetched.png"  # a 404: were it fetched, the message would say
    parts = [{"type": "image_url", "image_url": {"url": never}} for _ in range(3)]
    _openai_refused(trusted, [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                           *parts]}],
                    "messages[0].content[3]", "at most 2")
    _anthropic_refused(trusted, [_block(never)] * 3, "messages[0].content[2]", "at most 2")


def test_an_image_for_a_text_only_model(text_only):
    _openai_refused(text_only, _ask(_data_url(PNG)), "messages[1].content[1]", "text only")
    _anthropic_refused(text_only, [_block(_data_url(PNG))], "messages[0].content[0]",
                       "text only")


def test_part_shapes_stay_strict(trusted):
    user = [{"role": "user", "content": [{"type": "image_url", "image_url": "not-an-object"}]}]
    _openai_refused(trusted, user, "messages[0].content[0]", "image_url")
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    _openai_refused(trusted, audio, "messages", "messages[0].content[0] is not")
    _anthropic_refused(trusted, [{"type": "image", "source": {"type": "file"}}],
                       "messages[0].content[0]", "source")
    r = httpx.post(trusted.url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [_block(_data_url(PNG))]}]})
    assert r.status_code == 400 and "messages[1].content[0]" in r.text, r.text


def test_servers_keep_serving_after_refusals(trusted, strict, text_only):
    for server in (trusted, strict):
        out = _openai(server).chat.completions.create(
            model=MODEL, messages=_ask(_data_url(PNG)), max_tokens=2)
        assert out.choices[0].finish_reason in ("stop", "length")
    out = _openai(text_only).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")
