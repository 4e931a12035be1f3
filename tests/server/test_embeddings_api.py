"""``POST /v1/embeddings`` end to end on a tiny sentence-transformers BERT: the official
``openai`` client (which asks for base64) and raw HTTP (floats), token-id inputs, batches,
the 400s in OpenAI's shape; and the routes a model of the other task refuses."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.entrypoints.server.app import create_app
from serve_process import metric_sum
from server_thread import serve_stepped, wait_idle
from tiny_encoders import build_bert, hf_embeddings

MODEL = "tiny-bert"
TEXTS = ["The capital of France is Paris.", "Once upon a time", "paged attention"]


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert-server"), "mean", True)


@pytest.fixture(scope="module")
def server(bert_path):
    engine = LLMEngine(EngineConfig.from_kwargs(str(bert_path), device="cpu"))
    srv = serve_stepped(engine, lambda aengine: create_app(aengine, MODEL))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.tokenizer


def post(server, body, path="/v1/embeddings"):
    return httpx.post(server.url + path, json=body, timeout=30)


def _cos(got, ref):
    return F.cosine_similarity(torch.tensor(np.asarray(got, dtype=np.float32)), ref).min()


def test_float_batch_matches_transformers(server, bert_path, tokenizer):
    r = post(server, {"model": MODEL, "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    tokens = sum(len(i) for i in ids)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    ref = hf_embeddings(bert_path, ids, "mean", True)
    assert _cos([d["embedding"] for d in body["data"]], ref) > 0.99999
    wait_idle(server)


def test_base64_round_trip_equals_floats(server):
    floats = post(server, {"model": MODEL, "input": TEXTS[0]}).json()["data"][0]["embedding"]
    b64 = post(server, {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"})
    raw = base64.b64decode(b64.json()["data"][0]["embedding"])
    assert np.frombuffer(raw, dtype="<f4").tolist() == floats


def test_openai_client_and_token_id_inputs(server, tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    texts = client.embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire
    ids = [tokenizer.encode(t) for t in TEXTS]
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    one = client.embeddings.create(model=MODEL, input=ids[1])
    # the same vectors, up to the float rounding of how the requests were batched
    np.testing.assert_allclose([d.embedding for d in texts.data],
                               [d.embedding for d in by_ids.data], atol=1e-6)
    np.testing.assert_allclose(one.data[0].embedding, by_ids.data[1].embedding, atol=1e-6)
    assert texts.usage.prompt_tokens == sum(len(i) for i in ids)


@pytest.mark.parametrize("body,param,words", [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [[]]}, "input", "input[0]"),
    ({"input": [1, "a"]}, "input", "input[0]"),
    ({"input": 5}, "input", "must be a string"),
    ({}, "input", "input is required"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float, base64"),
    ({"input": "a", "dimensions": 8}, "dimensions", "Matryoshka"),
    ({"input": [5] * 129}, "input", "max_model_len=128"),
    ({"input": ["a", [10**6]]}, "input", "input[1]"),
])
def test_bad_input_is_a_400_naming_it(server, body, param, words):
    r = post(server, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
    wait_idle(server)  # nothing half-submitted is left behind


def test_generation_routes_refuse_an_embedding_model(server):
    for path, body in [("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]})]:
        r = post(server, {"model": MODEL, **body}, path)
        assert r.status_code == 400
        assert "does not support" in r.json()["error"]["message"]
    r = post(server, {"model": MODEL, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hi"}]}, "/v1/messages")
    assert r.status_code == 400 and r.json()["type"] == "error"  # Anthropic's shape


def test_generating_model_refuses_embeddings(tiny_checkpoint):
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_checkpoint("llama")), device="cpu",
                                                max_model_len=64))
    srv = serve_stepped(engine, lambda aengine: create_app(aengine, "tiny"))
    try:
        r = post(srv, {"model": "tiny", "input": "hi"})
        assert r.status_code == 400
        assert "does not support the Embeddings API" in r.json()["error"]["message"]
    finally:
        srv.stop()


def _metric(server, name):
    return metric_sum(httpx.get(server.url + "/metrics", timeout=10).text, name)


def test_metrics_count_embedding_requests(server, tokenizer):
    stop = 'quire:request_success_total{finished_reason="stop"}'
    before = _metric(server, stop), _metric(server, "quire:prompt_tokens_total")
    assert post(server, {"model": MODEL, "input": TEXTS[:2]}).status_code == 200
    tokens = sum(len(tokenizer.encode(t)) for t in TEXTS[:2])
    after = _metric(server, stop), _metric(server, "quire:prompt_tokens_total")
    assert after == (before[0] + 2, before[1] + tokens)
