"""``quire serve --grpc-port`` end to end with a real grpcio client: one server for the
module (tiny Llama, its engine core in its own process, an API key, gRPC over TLS beside
plain HTTP). The oracle is the same server's HTTP API, the tokenizer, and the engine's
own figures on ``/metrics`` (KV pages back, requests aborted)."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from grpc_client import bearer, channel, pb2, pb2_grpc, self_signed, status
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from serve_process import ServeProcess, greedy_reference
from transformers import AutoTokenizer

MODEL = "tiny"
KEY = "grpc-secret"
AUTH = bearer(KEY)
HTTP_AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The capital of France", "Once upon a time", "1, 2, 3,", "hello"]


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tiny_checkpoint, cert):
    srv = ServeProcess("--model", str(tiny_checkpoint("llama")), "--served-model-name", MODEL,
                       "--max-model-len", "256", "--api-key", KEY, "--grpc-port", "0",
                       "--grpc-tls-cert", str(cert[0]), "--grpc-tls-key", str(cert[1]))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def stub(server, cert):
    with channel(server.grpc_address, cert[0]) as ch:
        yield pb2_grpc.GenerationStub(ch)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint("llama")))


def generate(stub, **fields):
    """The whole answer of one Generate call: text and token ids per sample, the
    finish reasons, the usage, and the number of messages."""
    text: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    messages = list(stub.Generate(pb2.GenerateRequest(model=MODEL, **fields), metadata=AUTH))
    for m in messages:
        for c in m.choices:
            text[c.index] = text.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(c.token_ids)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return text, ids, reasons, messages[-1].usage, len(messages)


def http_stream(server, **body):
    """HTTP's streamed text and finish reason per choice, for the same request."""
    text: dict[int, str] = {}
    reasons: dict[int, str] = {}
    with httpx.stream("POST", server.url + "/v1/completions", headers=HTTP_AUTH, timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                i = choice["index"]
                text[i] = text.get(i, "") + choice["text"]
                if choice.get("finish_reason"):
                    reasons[i] = choice["finish_reason"]
    return text, reasons


def aborted(server) -> float:
    return server.metric('quire:request_success_total{finished_reason="abort"}')


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_text_equals_http(server, stub, tokenizer, prompt):
    text, ids, reasons, usage, messages = generate(
        stub, text=prompt, max_tokens=24, temperature=0, ignore_eos=True)
    want, want_reasons = http_stream(server, prompt=prompt, max_tokens=24, temperature=0,
                                     ignore_eos=True)
    assert text == want and reasons == want_reasons == {0: "length"}
    assert len(ids[0]) == 24 and messages >= 2  # streamed, not one answer at the end
    prompt_tokens = len(tokenizer.encode(prompt))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (prompt_tokens, 24, prompt_tokens + 24)


def test_token_id_prompt_n_and_seed_equal_http(server, stub, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    fields = {"n": 3, "max_tokens": 12, "temperature": 0.8, "seed": 0, "ignore_eos": True}
    text, _, reasons, usage, _ = generate(stub, token_ids=pb2.TokenIds(ids=ids), **fields)
    want, _ = http_stream(server, prompt=ids, **fields)
    assert text == want and sorted(reasons) == [0, 1, 2]
    assert usage.completion_tokens == 36
    # seed 0 is a seed, not "unset": the same call again samples the same tokens
    assert generate(stub, token_ids=pb2.TokenIds(ids=ids), **fields)[0] == text


def test_allowed_tokens_bad_words_and_beam_search_equal_http(server, stub, tokenizer):
    only, ids, _, _, _ = generate(stub, text=PROMPTS[0], max_tokens=4, temperature=0,
                                  ignore_eos=True, allowed_token_ids=[42, 43])
    assert set(ids[0]) <= {42, 43}
    assert only == http_stream(server, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                               ignore_eos=True, allowed_token_ids=[42, 43])[0]
    free = generate(stub, text=PROMPTS[0], max_tokens=6, temperature=0, ignore_eos=True)[0]
    word = free[0].split()[0]
    banned = generate(stub, text=PROMPTS[0], max_tokens=6, temperature=0, ignore_eos=True,
                      bad_words=[word])[0]
    assert banned != free
    assert banned == http_stream(server, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                 ignore_eos=True, bad_words=[word])[0]
    beams = {"n": 2, "best_of": 3, "use_beam_search": True, "max_tokens": 5,
             "temperature": 0, "length_penalty": 0.5}
    text, _, reasons, usage, messages = generate(stub, text=PROMPTS[1], ignore_eos=True,
                                                 early_stopping="never", **beams)
    want, _ = http_stream(server, prompt=PROMPTS[1], ignore_eos=True, early_stopping="never",
                          **beams)
    assert text == want and sorted(reasons) == [0, 1] and messages == 1
    assert usage.completion_tokens == 10


def test_logprobs_equal_http(server, stub):
    _text, ids, _, _, _ = generate(stub, text=PROMPTS[1], max_tokens=4, temperature=0,
                                  logprobs=2)
    calls = list(stub.Generate(pb2.GenerateRequest(model=MODEL, text=PROMPTS[1],
                                                   max_tokens=4, temperature=0, logprobs=2),
                               metadata=AUTH))
    got = [lp for m in calls for c in m.choices for lp in c.logprobs]
    r = httpx.post(server.url + "/v1/completions", headers=HTTP_AUTH, timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
        "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert [lp.token for lp in got] == r["tokens"]
    assert [lp.logprob for lp in got] == pytest.approx(r["token_logprobs"])
    assert [{t.token: t.logprob for t in lp.top} for lp in got] == \
        [pytest.approx(top) for top in r["top_logprobs"]]
    assert [lp.token_id for lp in got] == ids[0]


def test_cancel_mid_stream_frees_every_page(server, stub):
    before = aborted(server)
    call = stub.Generate(pb2.GenerateRequest(model=MODEL, text=PROMPTS[0], n=32,
                                             max_tokens=240, ignore_eos=True), metadata=AUTH)
    first = next(call)
    assert first.choices and not first.choices[0].finish_reason
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    server.wait_idle()  # no KV page held, nothing running or waiting
    assert aborted(server) == before + 1


def test_repeated_cancels_leave_the_server_up(server, stub):
    """Each cancel ends its call before the access log reads it (reading a cancelled
    call's peer crashed the server, at once or within a few cancels)."""
    for _ in range(10):
        call = stub.Generate(pb2.GenerateRequest(model=MODEL, text=PROMPTS[0], n=32,
                                                 max_tokens=240, ignore_eos=True),
                             metadata=AUTH)
        next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
    server.wait_idle()
    assert server.proc.poll() is None
    assert generate(stub, text=PROMPTS[0], max_tokens=2)[3].completion_tokens == 2


def test_deadline_exceeded_aborts_the_request(server, stub):
    before = aborted(server)
    # 128 samples of 240 tokens: about 4x the deadline's time on an idle host (the tiny
    # model makes 32 x 240 tokens in 0.4 s), the first message within it
    call = stub.Generate(pb2.GenerateRequest(model=MODEL, text=PROMPTS[0], n=128,
                                             max_tokens=240, ignore_eos=True),
                         metadata=AUTH, timeout=0.3)
    assert next(call).choices  # it runs in the engine
    code, _, _ = status(lambda: call)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_idle()
    assert aborted(server) == before + 1  # one request, its 128 samples stopped


@pytest.mark.parametrize("metadata", [(), bearer("wrong"), (("authorization", KEY),)],
                         ids=["missing", "wrong", "not-bearer"])
def test_a_call_without_the_key_is_unauthenticated(stub, metadata):
    for call in (lambda: stub.Generate(pb2.GenerateRequest(text="hi"), metadata=metadata),
                 lambda: stub.Tokenize(pb2.TokenizeRequest(prompt="hi"), metadata=metadata),
                 lambda: stub.ListModels(pb2.ListModelsRequest(), metadata=metadata)):
        code, details, _ = status(call)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "API key" in details


def test_plain_text_is_refused_on_the_tls_port(server):
    with channel(server.grpc_address) as ch:
        code, _, _ = status(lambda: pb2_grpc.GenerationStub(ch).ListModels(
            pb2.ListModelsRequest(), metadata=AUTH, timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_health_and_reflection(server, cert):
    with channel(server.grpc_address, cert[0]) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "quire.v1.Generation"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(ch)
        services = db.get_services()
        assert "quire.v1.Generation" in services and "grpc.health.v1.Health" in services
        generate_rpc = db.FindFileContainingSymbol("quire.v1.Generation")
        assert generate_rpc.package == "quire.v1"


def test_unknown_model_is_not_found(stub):
    code, details, meta = status(lambda: stub.Generate(
        pb2.GenerateRequest(model="nope", text="hi"), metadata=AUTH))
    assert code == grpc.StatusCode.NOT_FOUND and "'tiny'" in details
    assert meta["quire-error-param"] == "model"


#: (fields of a GenerateRequest, the field the error must name): each refused as HTTP
#: refuses it, by the same checks.
BAD_FIELDS = [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": ["y" * 1025]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {5: 500.0}}, "logit_bias"),
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"best_of": 0}, "best_of"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0,
      "early_stopping": "sometimes"}, "early_stopping"),
    ({"structured_outputs": pb2.StructuredOutputs(json="{not json")},
     "structured_outputs"),
    ({"structured_outputs": pb2.StructuredOutputs(regex="a", grammar="b")},
     "structured_outputs"),
    ({"structured_outputs": pb2.StructuredOutputs(regex="(unclosed")},
     "structured_outputs"),
]


@pytest.mark.parametrize(("fields", "name"), BAD_FIELDS,
                         ids=[f"{name}-{i}" for i, (_, name) in enumerate(BAD_FIELDS)])
def test_a_bad_field_is_invalid_argument_naming_it(stub, server, fields, name):
    code, details, meta = status(lambda: stub.Generate(
        pb2.GenerateRequest(model=MODEL, text="hi", **{"max_tokens": 2, **fields}),
        metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert name in details and meta["quire-error-param"] == name
    if name in ("temperature", "top_p", "n", "max_tokens", "stop"):  # as HTTP says it
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}
        if isinstance(body.get("temperature"), float) and body["temperature"] != \
                body["temperature"]:
            return  # JSON has no NaN
        r = httpx.post(server.url + "/v1/completions", json=body, headers=HTTP_AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == name


@pytest.mark.parametrize(("prompt", "why"), [
    ({}, "required"), ({"text": ""}, "empty"),
    ({"token_ids": pb2.TokenIds(ids=[10**6])}, "vocabulary"),
    ({"token_ids": pb2.TokenIds(ids=[1] * 300)}, "max_model_len")])
def test_a_bad_prompt_is_invalid_argument_naming_it(stub, prompt, why):
    code, details, meta = status(lambda: stub.Generate(
        pb2.GenerateRequest(model=MODEL, max_tokens=2, **prompt), metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in details, details
    assert meta["quire-error-param"] == "prompt"


def test_64_concurrent_streams_all_complete(server, cert):
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + i % 5) for i in range(64)]
    want = greedy_reference(server.url, set(jobs), MODEL, headers=HTTP_AUTH)

    async def run() -> list[str]:
        async with channel(server.grpc_address, cert[0], aio=True) as ch:
            aio_stub = pb2_grpc.GenerationStub(ch)

            async def one(prompt: str, max_tokens: int) -> str:
                text = ""
                async for m in aio_stub.Generate(pb2.GenerateRequest(
                        model=MODEL, text=prompt, max_tokens=max_tokens, temperature=0,
                        ignore_eos=True), metadata=AUTH, timeout=120):
                    text += "".join(c.text for c in m.choices)
                return text

            return await asyncio.gather(*(one(*job) for job in jobs))

    assert asyncio.run(run()) == [want[job] for job in jobs]
    server.wait_idle()


def test_tokenize_detokenize_round_trip(stub, tokenizer):
    for text in PROMPTS:
        got = stub.Tokenize(pb2.TokenizeRequest(model=MODEL, prompt=text), metadata=AUTH)
        assert list(got.token_ids) == tokenizer.encode(text) and got.max_model_len == 256
        plain = stub.Tokenize(pb2.TokenizeRequest(prompt=text, add_special_tokens=False),
                              metadata=AUTH)
        assert list(plain.token_ids) == tokenizer.encode(text, add_special_tokens=False)
        back = stub.Detokenize(pb2.DetokenizeRequest(tokens=plain.token_ids), metadata=AUTH)
        assert back.text == tokenizer.decode(plain.token_ids)
    code, _, meta = status(lambda: stub.Detokenize(pb2.DetokenizeRequest(tokens=[-1]),
                                                   metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and meta["quire-error-param"] == "tokens"


def test_list_models(stub, tiny_checkpoint):
    [model] = stub.ListModels(pb2.ListModelsRequest(), metadata=AUTH).models
    assert (model.id, model.root, model.parent, model.max_model_len, model.task) == \
        (MODEL, str(tiny_checkpoint("llama")), "", 256, "generate")


def test_embed_on_a_generating_model_is_invalid_argument(stub):
    code, details, _ = status(lambda: stub.Embed(pb2.EmbedRequest(
        input=[pb2.EmbedInput(text="hi")]), metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "embed" in details


def test_each_call_writes_an_access_line(server, stub):
    _, _, _, usage, _ = generate(stub, text="hello", max_tokens=3)
    status(lambda: stub.Generate(pb2.GenerateRequest(model=MODEL, text="hi", top_p=2.0),
                                 metadata=AUTH))
    stub.Tokenize(pb2.TokenizeRequest(prompt="hi"), metadata=AUTH)
    time.sleep(0.5)  # the log is read from the server's stderr by a thread
    lines = [line for line in list(server.log) if '"gRPC ' in line]
    assert any('"gRPC Generate" OK' in line and
               f"prompt_tokens={usage.prompt_tokens} completion_tokens=3" in line
               for line in lines), lines[-5:]
    assert any('"gRPC Generate" INVALID_ARGUMENT id=-' in line for line in lines)
    assert any('"gRPC Tokenize" OK' in line for line in lines)
