"""gRPC's Embed on an embedding model (a tiny sentence-transformers BERT served with
``--task embed``): it equals the same server's ``/v1/embeddings``; the generating calls
are refused as HTTP refuses them. (Several models in one server: test_grpc_layouts.py;
an embedding model beside a generating one cannot be served yet: its core divides by its
KV page size, 0.)"""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_client import channel, pb2, pb2_grpc, status
from serve_process import ServeProcess
from tiny_encoders import build_bert

TEXTS = ["The capital of France is Paris.", "Once upon a time", "paged attention"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    bert = build_bert(tmp_path_factory.mktemp("grpc-bert"), "mean", True)
    srv = ServeProcess("--model", str(bert), "--served-model-name", "bert", "--task",
                       "embed", "--grpc-port", "0")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def stub(server):
    with channel(server.grpc_address) as ch:
        yield pb2_grpc.GenerationStub(ch)


def test_embed_equals_http(server, stub):
    got = stub.Embed(pb2.EmbedRequest(model="bert",
                                      input=[pb2.EmbedInput(text=t) for t in TEXTS]))
    want = httpx.post(server.url + "/v1/embeddings", timeout=30,
                      json={"model": "bert", "input": TEXTS}).json()
    assert [e.index for e in got.embeddings] == [0, 1, 2] and got.model == "bert"
    for e, d in zip(got.embeddings, want["data"]):
        assert list(e.values) == pytest.approx(d["embedding"], abs=1e-6)
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]


def test_embed_token_ids_equal_texts(stub):
    ids = stub.Tokenize(pb2.TokenizeRequest(model="bert", prompt=TEXTS[0])).token_ids
    by_ids = stub.Embed(pb2.EmbedRequest(model="bert", input=[
        pb2.EmbedInput(token_ids=pb2.TokenIds(ids=ids))]))
    by_text = stub.Embed(pb2.EmbedRequest(model="bert", input=[pb2.EmbedInput(text=TEXTS[0])]))
    assert list(by_ids.embeddings[0].values) == pytest.approx(
        list(by_text.embeddings[0].values), abs=1e-6)


@pytest.mark.parametrize(("inputs", "param"), [
    ([], "input"),
    ([pb2.EmbedInput(text="")], "input"),
    ([pb2.EmbedInput(token_ids=pb2.TokenIds(ids=[10**6]))], "input"),
])
def test_a_bad_embed_input_is_invalid_argument(stub, inputs, param):
    code, details, meta = status(lambda: stub.Embed(pb2.EmbedRequest(model="bert",
                                                                     input=inputs)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "input" in details, details
    assert meta["quire-error-param"] == param


def test_generate_on_an_embedding_model_is_invalid_argument(stub):
    code, details, _ = status(lambda: stub.Generate(pb2.GenerateRequest(text="hello")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "embedding model" in details


def test_list_models(stub):
    [model] = stub.ListModels(pb2.ListModelsRequest()).models
    assert (model.id, model.task) == ("bert", "embed")
