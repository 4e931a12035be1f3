"""Embedding models through ``LLM.embed``: tiny random BERTs (every pooling, with and
without normalisation) and a tiny decoder with last-token pooling, against transformers;
the pooling ops, the sentence-transformers config reader, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from quire import LLM
from quire.config import EngineConfig
from quire.models.pooling import check_task, pooling_config, read_sentence_transformers
from quire.ops.pooling import bidirectional_attention, pool
from tiny_encoders import build_bert, hf_embeddings
from transformers import AutoConfig

PROMPTS = [[5, 17, 33, 8, 90], [101, 7], [44], list(range(3, 60)), [200, 201, 202, 203]]


def _cosines(got: list[list[float]], ref: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(got), ref)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """``bert_dir(pooling, normalize)``: a tiny sentence-transformers BERT, built once."""
    built = {}

    def get(pooling, normalize=True):
        key = (pooling, normalize)
        if key not in built:
            path = tmp_path_factory.mktemp(f"bert-{pooling}-{normalize}")
            built[key] = build_bert(path, pooling, normalize)
        return built[key]

    return get


# -- ops -------------------------------------------------------------------------------
def test_pool_methods_match_per_sequence_reductions():
    torch.manual_seed(0)
    lens = [3, 1, 5]
    hidden = torch.randn(sum(lens), 8)
    loc = torch.tensor([0, 3, 4, 9])
    parts = hidden.split(lens)
    torch.testing.assert_close(pool(hidden, loc, "mean", False),
                               torch.stack([p.mean(0) for p in parts]))
    torch.testing.assert_close(pool(hidden, loc, "cls", False),
                               torch.stack([p[0] for p in parts]))
    last = pool(hidden, loc, "last", True)
    torch.testing.assert_close(last, F.normalize(torch.stack([p[-1] for p in parts]), dim=-1))
    with pytest.raises(ValueError, match="pooling method must be one of"):
        pool(hidden, loc, "max", False)


def test_bidirectional_attention_stays_within_each_sequence():
    torch.manual_seed(0)
    lens = [4, 2, 6]
    q, k, v = (torch.randn(sum(lens), 2, 8) for _ in range(3))
    out = bidirectional_attention(q, k, v, torch.tensor([0, 4, 6, 12]), lens, scale=0.3)
    start = 0
    for n in lens:
        s = slice(start, start + n)
        scores = torch.einsum("qhd,khd->hqk", q[s], k[s]) * 0.3
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s])
        torch.testing.assert_close(out[s], want)
        start += n


# -- configuration ---------------------------------------------------------------------
def test_sentence_transformers_config_is_read(bert_dir, tmp_path):
    assert read_sentence_transformers(str(bert_dir("mean"))).method == "mean"
    assert read_sentence_transformers(str(bert_dir("cls", False))).normalize is False
    config = AutoConfig.from_pretrained(bert_dir("mean"))
    assert pooling_config(str(bert_dir("mean")), config, "last").method == "last"
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="Dense.*not supported"):
        read_sentence_transformers(str(tmp_path))
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_sentence_transformers(str(tmp_path))


def test_task_and_pooling_are_checked():
    with pytest.raises(ValueError, match="task must be one of"):
        EngineConfig("m", task="classify")
    with pytest.raises(ValueError, match="pooling must be one of"):
        EngineConfig("m", pooling="max")
    with pytest.raises(ValueError, match="task='generate'"):
        EngineConfig("m", task="generate", pooling="mean")
    bert = AutoConfig.for_model("bert", architectures=["BertModel"])
    with pytest.raises(ValueError, match="cannot generate"):
        check_task("generate", bert)
    with pytest.raises(ValueError, match="runs on one rank"):
        check_task("embed", bert, world_size=2)


# -- BERT against transformers ---------------------------------------------------------
@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False),
                                               ("last", True)])
def test_bert_embeddings_match_transformers(bert_dir, pooling, normalize):
    path = bert_dir(pooling, normalize)
    ref = hf_embeddings(path, PROMPTS, pooling, normalize)
    with LLM(str(path), device="cpu") as llm:
        assert llm.engine.task == "embed"  # auto: a sentence-transformers directory
        batch = llm.embed(PROMPTS)
        alone = [llm.embed([p])[0] for p in PROMPTS]
        assert llm.engine.core.block_manager.num_used_blocks == 0  # freed at once
    assert [o.prompt_token_ids for o in batch] == PROMPTS
    assert batch[0].outputs.embedding == batch[0].embedding  # vLLM's spelling
    got = torch.tensor([o.embedding for o in batch])
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    assert _cosines([o.embedding for o in alone], ref).min() > 0.99999


def test_bare_bert_pools_cls_normalised_and_text_prompts_work(tmp_path):
    path = build_bert(tmp_path, pooling=None)
    with LLM(str(path), device="cpu") as llm:
        tokenizer = llm.get_tokenizer()
        out = llm.embed(["The capital of France", "Once upon a time"])
        override = LLM(str(path), device="cpu", pooling="mean").embed(
            "The capital of France")
    ids = [tokenizer.encode(t) for t in ["The capital of France", "Once upon a time"]]
    assert _cosines([o.embedding for o in out], hf_embeddings(path, ids, "cls", True)).min() \
        > 0.99999
    assert _cosines([override[0].embedding],
                    hf_embeddings(path, ids[:1], "mean", True)).min() > 0.99999


def test_embedding_model_refuses_generation_and_long_prompts(bert_dir):
    from quire import SamplingParams

    with LLM(str(bert_dir("mean")), device="cpu") as llm:
        with pytest.raises(ValueError, match="serves embeddings"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="max_model_len=128"):
            llm.embed([[5] * 129])
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.embed([{"prompt_token_ids": []}])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.embed([[10**6]])
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(str(bert_dir("mean")), device="cpu", task="generate")


# -- a decoder as an embedding model ---------------------------------------------------
def test_decoder_last_token_embeddings_match_transformers(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    ref = hf_embeddings(path, PROMPTS, "last", True)
    with LLM(str(path), device="cpu", task="embed") as llm:
        got = llm.embed(PROMPTS)
        core = llm.engine.core
        assert core.block_manager.num_used_blocks == 0
        assert core.stats().prefix_hits == 0
    assert _cosines([o.embedding for o in got], ref).min() > 0.99999
    with LLM(str(path), device="cpu") as llm, pytest.raises(ValueError, match="task='embed'"):
        llm.embed(PROMPTS)


def test_sentence_transformers_max_seq_length_is_the_context(tmp_path):
    path = build_bert(tmp_path, "mean", True)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    with LLM(str(path), device="cpu") as llm:
        assert llm.engine.config.max_model_len == 16
        assert len(llm.embed([[5] * 16])[0].embedding) == 64
        with pytest.raises(ValueError, match="max_model_len=16"):
            llm.embed([[5] * 17])


def test_bert_weights_with_prefix_load_and_a_missing_part_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_bert(tmp_path / "prefixed", "mean", True)
    weights = load_file(path / "model.safetensors")
    renamed = {f"bert.{k}": v for k, v in weights.items()}  # BertForMaskedLM's names
    renamed["cls.predictions.bias"] = torch.zeros(8)  # a head an encoder does not use
    save_file(renamed, path / "model.safetensors")
    ref = hf_embeddings(build_bert(tmp_path / "plain", "mean", True), PROMPTS, "mean", True)
    with LLM(str(path), device="cpu") as llm:
        assert _cosines([o.embedding for o in llm.embed(PROMPTS)], ref).min() > 0.99999
    del weights["encoder.layer.1.attention.self.key.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="does not provide layers.1.qkv.weight"):
        LLM(str(path), device="cpu")


def test_embedding_prompts_are_never_chunked(tiny_checkpoint):
    resolved = EngineConfig("m", task="embed").resolve(
        model_max_len=8192, platform_block_size=16, platform_dtype=torch.float32)
    assert resolved.max_num_batched_tokens == 8192  # the longest prompt fits one step
    assert not resolved.enable_chunked_prefill and not resolved.enable_prefix_caching
    path = tiny_checkpoint("qwen3")
    with LLM(str(path), device="cpu", task="embed", max_num_batched_tokens=16) as llm:
        with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
            llm.embed([list(range(3, 20))])
        prompt = list(range(3, 19))
        got = llm.embed([prompt, prompt[:5]])
    assert _cosines([o.embedding for o in got],
                    hf_embeddings(path, [prompt, prompt[:5]], "last", True)).min() > 0.99999
