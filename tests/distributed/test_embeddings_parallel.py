"""Embeddings across process boundaries: a decoder's pooled vectors from tensor-parallel
worker processes (``StepOutput.pooled``), and a BERT's from data-parallel engine core
processes (``SeqUpdate.embedding``), each against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quire import LLM
from tiny_encoders import build_bert, hf_embeddings

PROMPTS = [[5, 17, 33, 8, 90], [101, 7], [44], list(range(3, 40))]


def _min_cosine(outs, ref) -> float:
    return float(F.cosine_similarity(torch.tensor([o.embedding for o in outs]), ref).min())


@pytest.mark.slow  # starts worker processes
def test_decoder_embeddings_from_tensor_parallel_workers(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    with LLM(str(path), device="cpu", task="embed", tensor_parallel_size=2) as llm:
        outs = llm.embed(PROMPTS)
    assert _min_cosine(outs, hf_embeddings(path, PROMPTS, "last", True)) > 0.99999


@pytest.mark.slow  # starts engine core processes
def test_bert_embeddings_from_data_parallel_cores(tmp_path):
    path = build_bert(tmp_path, "mean", True)
    with LLM(str(path), device="cpu", data_parallel_size=2) as llm:
        outs = llm.embed(PROMPTS)
    assert _min_cosine(outs, hf_embeddings(path, PROMPTS, "mean", True)) > 0.99999
    with pytest.raises(ValueError, match="runs on one rank"):
        LLM(str(path), device="cpu", tensor_parallel_size=2)
