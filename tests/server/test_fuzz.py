"""Every route against hostile input, drawn by hypothesis: every field each route reads,
given wrong types, None, huge and tiny numbers (and numbers Python cannot write: 1e400,
NaN, 5000 digits), lone surrogates, deep nesting, long strings and lists; and raw bodies
that are not JSON objects at all.

The gRPC service (``quire.v1.Generation``, on the same engine and handlers) gets the same:
every Generate field drawn from its proto type's whole range (NaN and infinities, int64's
ends, long stop lists, any map), and raw bytes as the request of every method; each call
is OK or a refusal (``INVALID_ARGUMENT``, ``NOT_FOUND`` for a model name), never
``INTERNAL`` or ``UNKNOWN``, and the server answers the next call.

Per case: no 5xx; a 4xx in the route's own error shape (OpenAI's; Anthropic's on
/v1/messages); a streamed 200 ends properly (``data: [DONE]``, ``message_stop`` or an
error event); and the same connection then serves a normal request (a 413 may close
it). When the module is done the engine is idle: nothing running or waiting, no KV page.

One server for the module, generations of a few tokens, and a fixed draw
(``derandomize``), so the run is short and repeatable. The issue's known probes are
listed apart (``KNOWN_PROBES``), so each failure has a plain body to reproduce it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import Any
from urllib.parse import quote

import grpc
import httpx
import pytest
from grpc_client import bearer, pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from server_thread import serve_stepped, wait_idle
from tiny_models import VOCAB

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
MODEL = "tiny"
KEY = "secret"
HEADERS = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY,
           "Content-Type": "application/json"}
#: Seconds one case may take; the slowest valid case (256 sequences) needs a few.
CASE_TIMEOUT_S = 20.0
ANTHROPIC_ROUTES = ("/v1/messages",)
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    engine = LLMEngine(EngineConfig.from_kwargs(path, device="cpu", max_model_len=128))
    # the default limits (8 MiB bodies, 64 stop strings, 256 sequences), and a waiting
    # bound no single request reaches, so a 503 can only be a bug here
    apps = []

    def make_app(aengine):
        apps.append(create_app(aengine, MODEL, api_key=KEY, chat_template=CHAT_TEMPLATE))
        return apps[0]

    srv = serve_stepped(engine, make_app, max_waiting_requests=100_000)
    srv.app = apps[0]
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """One keep-alive connection for every case (a second one only if the first closes)."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=CASE_TIMEOUT_S,
                      limits=limits) as c:
        yield c


# -- JSON the standard encoder cannot write ------------------------------------------------
class Raw(str):
    """JSON text written verbatim: numbers beyond float and int, deep nesting."""


DROP = object()  # a drawn "value" that removes the field


def dumps(value: Any) -> bytes:
    """JSON of ``value``; :class:`Raw` verbatim, lone surrogates as ``\\udXXX`` escapes."""
    return _encode(value).encode("ascii")


def _encode(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{_encode(v)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_encode(v) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii escapes surrogates; NaN is written as NaN


def nested(depth: int, open_: str = "[", close: str = "]") -> Raw:
    return Raw(open_ * depth + close * depth)


# -- strategies ----------------------------------------------------------------------------
SURROGATES = ("\ud800", "\udfff", "\udc00\ud800", "a\ud83d")
HUGE_INTS = (10**30, -10**30, 2**63, 2**64, 2**70, -(2**63) - 1, 10**400)
EXTREME_FLOATS = (1e-300, -1e-300, 5e-324, 1e300, -1e300)
RAW_NUMBERS = ("1e400", "-1e400", "1e-400", "NaN", "Infinity", "-Infinity", "1" * 5000,
               "-0.0", "1E+308")
MAX_STOPS = [f"{i:04d}" + "q" * 1020 for i in range(64)]  # at the limits, never matched

valid_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
bad_text = st.builds(lambda a, s, b: a + s + b, st.text(max_size=4),
                     st.sampled_from(SURROGATES), st.text(max_size=4))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from(HUGE_INTS),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EXTREME_FLOATS),
    st.sampled_from(RAW_NUMBERS).map(Raw), st.text(max_size=16), bad_text)
junk = st.one_of(
    scalars, st.sampled_from(["", [], {}]),
    st.lists(scalars, max_size=5), st.dictionaries(st.text(max_size=5), scalars, max_size=3),
    st.sampled_from([nested(1000), nested(100_000), nested(1000, '{"a":', "}")]),
    st.sampled_from(["x" * 100_000, list(range(20_000)), [[1]] * 1000]),
)
# Nearly valid: the right structure, with now and then a leaf no tokenizer or sampler takes.
leaf_text = st.one_of(valid_text, valid_text, valid_text, bad_text)
leaf_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1),
                    st.sampled_from([-1, VOCAB, 2**31, 2**63, 2**64, 2**70, 10**400]))
leaf_ids = st.lists(leaf_id, min_size=1, max_size=16)
flag = st.booleans()
small_tokens = st.integers(1, 4)
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": leaf_text}),
                     min_size=1, max_size=2)
chat_message = st.fixed_dictionaries({
    "role": st.one_of(st.sampled_from(["system", "user", "assistant"]), bad_text),
    "content": st.one_of(leaf_text, text_parts)})
anthropic_content = st.one_of(leaf_text, text_parts)
anthropic_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant"]), "content": anthropic_content})

SAMPLING = {
    "model": st.just(MODEL),
    "max_tokens": small_tokens,
    "max_completion_tokens": small_tokens,
    "n": st.one_of(st.integers(1, 4), st.just(128)),
    "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.just(1e-300)),
    "top_k": st.integers(-1, VOCAB + 5),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 3),
    "seed": st.integers(-1, 2**63 - 1),
    "stop": st.one_of(leaf_text, st.lists(leaf_text, max_size=4), st.just(MAX_STOPS)),
    "stop_token_ids": st.lists(leaf_id, max_size=4),
    "logit_bias": st.dictionaries(leaf_id.map(str), st.one_of(st.floats(-100, 100), scalars),
                                  max_size=3),
    "stream": flag,
    "stream_options": st.fixed_dictionaries({"include_usage": flag}),
    "ignore_eos": flag,
    "min_tokens": st.integers(0, 4),
    "skip_special_tokens": flag,
    "include_stop_str_in_output": flag,
    "user": valid_text,
    "allowed_token_ids": st.lists(leaf_id, max_size=4),
    "bad_words": st.lists(leaf_text, max_size=3),
    "use_beam_search": flag,
    "best_of": st.integers(1, 4),
    "length_penalty": st.floats(-2, 2),
    "early_stopping": st.one_of(flag, st.just("never")),
}
#: Per POST route: a body that works, and each field the route reads with valid values.
ROUTES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "/v1/completions": ({"model": MODEL, "prompt": "Once upon", "max_tokens": 2}, {
        **SAMPLING,
        "prompt": st.one_of(leaf_text, leaf_ids, st.lists(st.one_of(leaf_text, leaf_ids),
                                                          min_size=1, max_size=4),
                            st.just(["hi"] * 256)),
        "logprobs": st.integers(0, 5), "echo": flag}),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}, {
        **SAMPLING,
        "messages": st.lists(chat_message, min_size=1, max_size=3),
        "logprobs": flag, "top_logprobs": st.integers(0, 5)}),
    "/v1/messages": ({"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}, {
        "model": st.just(MODEL), "max_tokens": small_tokens,
        "messages": st.lists(anthropic_message, min_size=1, max_size=3),
        "system": anthropic_content, "temperature": st.floats(0, 1),
        "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(0, VOCAB + 5),
        "stop_sequences": st.lists(leaf_text, max_size=4), "stream": flag,
        "metadata": st.fixed_dictionaries({"user_id": valid_text})}),
    "/tokenize": ({"prompt": "Paris"}, {
        "model": st.just(MODEL), "prompt": leaf_text,
        "messages": st.lists(chat_message, min_size=1, max_size=3),
        "add_special_tokens": flag}),
    "/detokenize": ({"tokens": [5, 6]}, {"model": st.just(MODEL), "tokens": leaf_ids}),
}


@st.composite
def bodies(draw: Any, route: str) -> dict[str, Any]:
    """The route's working body with up to six fields replaced (valid, junk or gone)."""
    base, fields = ROUTES[route]
    body = dict(base)
    names = draw(st.lists(st.sampled_from([*sorted(fields), "unknown_field"]), unique=True,
                          max_size=6))
    for name in names:
        valid = fields.get(name, junk)
        value = draw(st.one_of(valid, junk, st.just(DROP)))
        if value is DROP:
            body.pop(name, None)
        else:
            body[name] = value
    return body


RAW_BODIES = [
    b"", b"{", b"{not json", b"\xff\xfe{}", b'{"model": "tiny"', b"null", b"[1, 2, 3]",
    b'"a string"', b"42", b"NaN", b"1" * 5000, b"\xef\xbb\xbf{}",
    '{"prompt": "hi"}'.encode("utf-16"), b'{"a": 1, "a": 2}', b"{}" * 1000,
    b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    b"[" * 100_000, b'{"prompt": "\\ud800", "messages": "\\udfff", "tokens": "\\ud800"}',
]
raw_bodies = st.one_of(st.sampled_from(RAW_BODIES), st.binary(max_size=64),
                       st.text(max_size=64).map(lambda t: t.encode("utf-8")))


# -- checks --------------------------------------------------------------------------------
def check_error_shape(route: str, status: int, payload: Any) -> None:
    if route in ANTHROPIC_ROUTES:
        assert payload.get("type") == "error", payload
        err = payload["error"]
        assert isinstance(err.get("type"), str) and isinstance(err.get("message"), str), err
    else:
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err


def check_stream_end(route: str, lines: list[str]) -> None:
    """A stream ends with its protocol's last event, or with an error event."""
    events = [line for line in lines if line.startswith(("data:", "event:"))]
    assert events, "an empty stream"
    if route in ANTHROPIC_ROUTES:
        names = [line[len("event:"):].strip() for line in events if line.startswith("event:")]
        assert names and names[-1] in ("message_stop", "error"), names[-3:]
        return
    assert events[-1] == "data: [DONE]", events[-3:]
    for line in events[:-1]:
        json.loads(line[len("data:"):])  # every other event is one JSON object


def send(client: httpx.Client, method: str, route: str, content: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, int]:
    """One case, checked; returns (status, the client port it went over)."""
    deadline = time.monotonic() + CASE_TIMEOUT_S
    path = route.split("?", 1)[0]
    with client.stream(method, route, content=content, headers=headers) as r:
        port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
        kind = r.headers.get("content-type", "")
        lines: list[str] = []
        if kind.startswith("text/event-stream"):
            for line in r.iter_lines():
                lines.append(line)
                assert time.monotonic() < deadline, f"{path}: the stream did not end"
        else:
            r.read()
        shown = r.text[:500] if not lines else lines[-3:]
        summary = f"{method} {route} {(content or b'')[:300]!r}: {r.status_code} {shown}"
        assert r.status_code < 500, summary
        if 400 <= r.status_code < 500:
            assert kind.startswith("application/json"), summary
            check_error_shape(path, r.status_code, r.json())
        elif lines:
            check_stream_end(path, lines)
        elif kind.startswith("application/json"):
            r.json()
        return r.status_code, port


def still_serves(client: httpx.Client, status: int, port: int) -> None:
    """A normal request succeeds, over the same connection unless the case got a 413."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    again = r.extensions["network_stream"].get_extra_info("client_addr")[1]
    assert status == 413 or again == port, f"the connection was closed after a {status}"


def case(client: httpx.Client, route: str, content: bytes, method: str = "POST",
         headers: dict[str, str] | None = None) -> None:
    """Send, then check that the connection still serves, then report the send's
    failure if any: a broken connection must not be blamed on the next case."""
    try:
        status, port = send(client, method, route, content, headers)
    except AssertionError:
        with contextlib.suppress(httpx.TransportError):  # the real failure is the first
            client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                 "max_tokens": 1})
        raise
    still_serves(client, status, port)


# -- the fuzz ------------------------------------------------------------------------------
@settings(FUZZ, max_examples=45)
@given(body=bodies("/v1/completions"))
def test_fuzz_completions(client, body):
    case(client, "/v1/completions", dumps(body))


@settings(FUZZ, max_examples=40)
@given(body=bodies("/v1/chat/completions"))
def test_fuzz_chat(client, body):
    case(client, "/v1/chat/completions", dumps(body))


@settings(FUZZ, max_examples=40)
@given(body=bodies("/v1/messages"))
def test_fuzz_messages(client, body):
    case(client, "/v1/messages", dumps(body))


@settings(FUZZ, max_examples=20)
@given(route=st.sampled_from(["/tokenize", "/detokenize"]), data=st.data())
def test_fuzz_tokenizer_routes(client, route, data):
    case(client, route, dumps(data.draw(bodies(route))))


@settings(FUZZ, max_examples=30)
@given(route=st.sampled_from(sorted(ROUTES)), content=raw_bodies)
def test_fuzz_raw_bodies(client, route, content):
    case(client, route, content)


@settings(FUZZ, max_examples=25)
@given(route=st.sampled_from(["/v1/models", "/health", "/version", "/metrics",
                              "/no/such/route", "/v1/completions"]),
       method=st.sampled_from(["GET", "GET", "POST", "DELETE"]),
       query=st.text(max_size=20), content=st.one_of(st.none(), raw_bodies),
       auth=st.one_of(st.just(f"Bearer {KEY}"), st.text(
           st.characters(min_codepoint=33, max_codepoint=126), max_size=20)))
def test_fuzz_other_routes_and_methods(client, route, method, query, content, auth):
    headers = {"Authorization": auth, "Content-Type": "application/json"}
    case(client, f"{route}?{quote(query)}", content, method, headers)


# -- the probes, one plain body each -------------------------------------------------
KNOWN_PROBES = [
    ("/v1/messages", (b'{"model": "tiny", "max_tokens": 2, "messages": '
                      b'[{"role": "user", "content": "\\ud800"}]}')),
    ("/v1/messages", (b'{"model": "tiny", "max_tokens": 2, "system": "\\udfff", '
                      b'"messages": [{"role": "user", "content": "hi"}]}')),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", (b'{"model": "tiny", "max_tokens": 2, '
                              b'"messages": [{"role": "\\ud800", "content": "hi"}]}')),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}'),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    ("/v1/messages", b"[" * 100_000 + b"]" * 100_000),
    ("/v1/completions", (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, '
                         b'"repetition_penalty": 1' + b"0" * 400 + b"}")),
    ("/v1/completions", (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, '
                         b'"temperature": 1e400}')),
    ("/v1/completions", (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, '
                         b'"seed": 1' + b"0" * 30 + b"}")),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1' + b"0" * 30 + b"]}"),
    ("/detokenize", b'{"tokens": [1180591620717411303424]}'),  # 2**70
    ("/detokenize", b'{"tokens": [100000]}'),
    ("/v1/completions", (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, '
                         b'"top_p": 1e-300}')),
    ("/v1/completions", dumps({"model": MODEL, "prompt": ["hi"] * 256, "n": 128,
                               "max_tokens": 2})),
    ("/v1/completions", dumps({"model": MODEL, "prompt": "hi", "n": 16, "max_tokens": 2,
                               "stop": ["x"] * 100_000})),
    ("/v1/completions", dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2,
                               "stop": ["q" * 2000]})),
    ("/v1/completions", dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2,
                               "stop": MAX_STOPS + ["one more"]})),
    ("/v1/completions", dumps({"model": MODEL, "prompt": "hi " * 400_000, "max_tokens": 2})),
    ("/v1/messages", dumps({"model": MODEL, "max_tokens": 2, "stop_sequences": ["x"] * 100_000,
                            "messages": [{"role": "user", "content": "hi"}]})),
    ("/v1/completions", b'{"model": "tiny", "prompt": "' + b"a" * (9 * 2**20) + b'"}'),
]


@pytest.mark.parametrize("route,content", KNOWN_PROBES,
                         ids=[f"{i}{r}" for i, (r, _) in enumerate(KNOWN_PROBES)])
def test_known_probe(client, route, content):
    case(client, route, content)


HI = [{"role": "user", "content": "hi"}]
BIG_TEXT = "hi " * 400_000  # 1.2 MB: over the default prompt limit of 1 MiB
#: Per route, a body over one default limit, and the flag the answer must name.
OVER_LIMITS = [
    ("/v1/completions", {"prompt": ["hi"] * 16, "n": 17}, "--max-sequences-per-request"),
    ("/v1/completions", {"prompt": ["hi"] * 256, "n": 128}, "--max-sequences-per-request"),
    ("/v1/completions", {"prompt": "hi", "stop": MAX_STOPS + ["x"]}, "--max-stop-strings"),
    ("/v1/completions", {"prompt": "hi", "n": 16, "stop": ["x"] * 100_000},
     "--max-stop-strings"),
    ("/v1/completions", {"prompt": "hi", "stop": ["q" * 1025]}, "--max-stop-string-chars"),
    ("/v1/completions", {"prompt": BIG_TEXT}, "--max-prompt-bytes"),
    ("/v1/completions", {"prompt": [BIG_TEXT[:600_000]] * 2}, "--max-prompt-bytes"),
    ("/v1/chat/completions", {"messages": HI, "stop": ["x"] * 65}, "--max-stop-strings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG_TEXT}]},
     "--max-prompt-bytes"),
    ("/v1/messages", {"messages": HI, "stop_sequences": ["x"] * 100_000},
     "--max-stop-strings"),
    ("/v1/messages", {"messages": HI, "stop_sequences": ["q" * 1025]},
     "--max-stop-string-chars"),
    ("/v1/messages", {"messages": HI, "system": BIG_TEXT}, "--max-prompt-bytes"),
    ("/tokenize", {"prompt": BIG_TEXT}, "--max-prompt-bytes"),
]


@pytest.mark.parametrize("route,extra,flag_name", OVER_LIMITS,
                         ids=[f"{i}{r}{f}" for i, (r, _, f) in enumerate(OVER_LIMITS)])
def test_over_a_limit_is_a_400_naming_it(client, route, extra, flag_name):
    start = time.monotonic()
    r = client.post(route, json={"model": MODEL, "max_tokens": 2, **extra})
    took = time.monotonic() - start
    assert r.status_code == 400, (r.status_code, f"{took:.1f}s", r.text[:300])
    check_error_shape(route, 400, r.json())
    assert flag_name in r.json()["error"]["message"], r.json()
    assert took < 2.0, f"refused only after {took:.1f}s"


def test_at_the_limits_is_served(client):
    r = client.post("/v1/completions", json={"model": MODEL, "max_tokens": 1,
                                             "prompt": ["hi"] * 16, "n": 16,
                                             "stop": MAX_STOPS})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == 256


def test_a_body_over_8_mib_is_413(client):
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * (8 * 2**20) + b'"}')
    assert r.status_code == 413, r.text[:300]
    assert "--max-body-bytes" in r.json()["error"]["message"], r.json()


def test_health_is_fast_during_heavy_requests(server, client):
    """/health answers within 100 ms while a 256-sequence generation, a prompt of about
    1 MiB and a deeply nested body are being handled."""
    heavy = [dumps({"model": MODEL, "prompt": ["hi"] * 16, "n": 16, "max_tokens": 30,
                    "ignore_eos": True}),
             dumps({"model": MODEL, "prompt": "hi " * 300_000, "max_tokens": 1}),
             b"[" * 100_000 + b"]" * 100_000]
    for content in heavy:
        done = threading.Event()

        def post(content: bytes = content, done: threading.Event = done) -> None:
            try:
                httpx.post(server.url + "/v1/completions", content=content,
                           headers=HEADERS, timeout=CASE_TIMEOUT_S)
            finally:
                done.set()

        worker = threading.Thread(target=post, daemon=True)
        worker.start()
        slowest = 0.0
        with httpx.Client(base_url=server.url, timeout=10) as probe:
            probe.get("/health")  # connect outside the timing
            while not done.is_set():
                start = time.perf_counter()
                assert probe.get("/health").status_code == 200
                slowest = max(slowest, time.perf_counter() - start)
                time.sleep(0.01)
        worker.join(timeout=CASE_TIMEOUT_S)
        assert slowest < 0.100, f"/health took {slowest * 1000:.0f} ms during {content[:60]!r}"


# -- gRPC ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpc_channel(server):
    """The same models over gRPC: a ``GrpcServer`` on the server's event loop."""
    from quire.entrypoints.grpc.server import GrpcOptions, GrpcServer

    grpc_server = GrpcServer(server.app.state.router, GrpcOptions("127.0.0.1", 0), KEY)
    loop = server.engine.loop
    port = asyncio.run_coroutine_threadsafe(grpc_server.start(), loop).result(30)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
    asyncio.run_coroutine_threadsafe(grpc_server.stop(1), loop).result(30)


INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
DOUBLES = st.floats(allow_nan=True, allow_infinity=True)
proto_text = st.text(st.characters(codec="utf-8"), max_size=24)  # proto strings are UTF-8
proto_id = st.one_of(leaf_id.filter(lambda t: -2**63 <= t < 2**63), INT64)
GENERATE = {
    "model": st.one_of(st.just(MODEL), proto_text),
    "text": proto_text,
    "token_ids": st.lists(proto_id, max_size=16).map(lambda ids: pb2.TokenIds(ids=ids)),
    "n": st.one_of(st.integers(1, 4), st.just(128), INT32),
    "max_tokens": st.one_of(small_tokens, INT32),
    **{name: st.one_of(SAMPLING[name], DOUBLES) for name in (
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty")},
    "top_k": st.one_of(SAMPLING["top_k"], INT64),
    "seed": INT64,
    "min_tokens": st.one_of(SAMPLING["min_tokens"], INT64),
    "ignore_eos": flag, "include_stop_str_in_output": flag, "skip_special_tokens": flag,
    "stop": st.one_of(st.lists(proto_text, max_size=4), st.just(MAX_STOPS),
                      st.lists(proto_text, min_size=65, max_size=70)),
    "stop_token_ids": st.lists(proto_id, max_size=4),
    "logit_bias": st.dictionaries(proto_id, st.one_of(st.floats(-100, 100), DOUBLES),
                                  max_size=3),
    "logprobs": st.one_of(st.integers(0, 5), INT32),
    "allowed_token_ids": st.lists(proto_id, max_size=4),
    "bad_words": st.lists(proto_text, max_size=3),
    "use_beam_search": flag,
    "best_of": st.one_of(st.integers(1, 4), INT32),
    "length_penalty": st.one_of(st.floats(-2, 2), DOUBLES),
    "early_stopping": st.one_of(st.sampled_from(["true", "false", "never"]), proto_text),
    "structured_outputs": st.fixed_dictionaries({}, optional={
        "json": st.one_of(proto_text, st.just('{"type": "object"}')), "regex": proto_text,
        "choice": st.lists(proto_text, max_size=3), "grammar": proto_text,
        "json_object": flag}).map(lambda kw: pb2.StructuredOutputs(**kw)),
}
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
METHODS = {"Generate": True, "Embed": False, "Tokenize": False, "Detokenize": False,
           "ListModels": False}  # name: streams its answer


@st.composite
def generate_requests(draw: Any) -> Any:
    """A working GenerateRequest with up to six fields replaced or dropped."""
    fields: dict[str, Any] = {"model": MODEL, "text": "Once upon", "max_tokens": 2}
    for name in draw(st.lists(st.sampled_from(sorted(GENERATE)), unique=True, max_size=6)):
        if draw(st.booleans()):
            fields[name] = draw(GENERATE[name])
        else:
            fields.pop(name, None)
    if "token_ids" in fields:  # one member of the prompt oneof
        fields.pop("text", None)
    return pb2.GenerateRequest(**fields)


def grpc_case(ch: grpc.Channel, method: str, request: bytes) -> None:
    """One call of ``method`` with the encoded ``request``: OK or a refusal, in time;
    then the server still answers."""
    path = f"/quire.v1.Generation/{method}"
    call = ch.unary_stream(path) if METHODS[method] else ch.unary_unary(path)
    try:
        answer = call(request, metadata=bearer(KEY), timeout=CASE_TIMEOUT_S)
        if METHODS[method]:
            list(answer)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    assert code in GRPC_OK, f"{method} {request[:300]!r}: {code} {details}"
    assert ch.unary_unary("/quire.v1.Generation/ListModels")(
        b"", metadata=bearer(KEY), timeout=CASE_TIMEOUT_S)


@settings(FUZZ, max_examples=60)
@given(request=generate_requests())
def test_fuzz_grpc_generate(grpc_channel, request):
    grpc_case(grpc_channel, "Generate", request.SerializeToString())


@settings(FUZZ, max_examples=40)
@given(method=st.sampled_from(sorted(METHODS)),
       raw=st.one_of(st.binary(max_size=64), st.sampled_from([
           b"\x12\x03\xff\xfe\xfd",  # text: not UTF-8
           b"\x1a\x05\x0a\x03\x80\x80\x80",  # token ids: a varint cut short
           b"\x08" * 64, b"\xff" * 64, b"\x0a\x7f" + b"a" * 10])))
def test_fuzz_grpc_raw_requests(grpc_channel, method, raw):
    grpc_case(grpc_channel, method, raw)


def test_zz_engine_idle_after_everything(server, client):
    """Last in the module: nothing running or waiting, no KV page held."""
    stats = wait_idle(server, timeout=20.0)
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
