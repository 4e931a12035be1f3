"""The real SmolLM2-135M-Instruct (GGUF, dequantized) against transformers, token for token."""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams
from tiny_models import hf_greedy, hf_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    model = hf_model(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return model


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(str(smollm2_gguf), device="cpu", dtype="float32")


def test_greedy_32_tokens_match_transformers(llm, reference):
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for text, out in zip(PROMPTS, outs):
        ids = tok.encode(text)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(reference, ids, 32), text
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids,
                                                 skip_special_tokens=True)


def test_single_stream_greedy_matches_transformers(llm, reference):
    """One sequence at a time: decode steps of one row, which on the cpu platform run on
    the weights' exact compact encoding (Q4_1 and Q8_0 here), not the float32 copy."""
    from quire.platforms.cpu.packed_linear import PackedLinear

    kernels = [m.kernel for m in llm.engine.core.executor.worker.model.modules()
               if isinstance(getattr(m, "kernel", None), PackedLinear)]
    if kernels and kernels[0].native is not None:
        assert all(k.compact is not None for k in kernels), "every SmolLM2 weight encodes"
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for text in PROMPTS[:3]:
        ids = tok.encode(text)
        [out] = llm.generate(text, params)
        assert out.outputs[0].token_ids == hf_greedy(reference, ids, 32), text


def test_chat_prompt_stops_at_the_model_eos_like_transformers(llm, reference):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    eos = reference.generation_config.eos_token_id
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos])
    expected = hf_greedy(reference, ids, 64, eos_ids=eos_ids)
    [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=64))
    assert out.outputs[0].token_ids == expected
    assert expected[-1] in eos_ids, "the reference should end by itself within 64 tokens"
    assert out.outputs[0].finish_reason == "stop"
    assert "Paris" in out.outputs[0].text


@pytest.mark.parametrize("prompt", ["안녕하세요, 제 이름은", "Emoji time: 🎉🚀 I feel", "Ünïcödé façade — naïve café:"])
def test_multibyte_text_streams_without_broken_characters(llm, prompt):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = [out.outputs[0].text for out in llm.stream(prompt, params)]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)
    assert not any("\ufffd" in t for t in texts)
    [final] = llm.generate(prompt, params)
    assert texts[-1] == final.outputs[0].text
    assert final.outputs[0].text == llm.get_tokenizer().decode(final.outputs[0].token_ids,
                                                               skip_special_tokens=True)


def test_chat_answers_a_simple_question(llm):
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=48))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("split", [
    {"tensor_parallel_size": 3},  # 9 query heads and 3 KV heads: one of each group per rank
    {"pipeline_parallel_size": 2},  # layers 0-14, then 15-29 and the tied LM head
])
def test_parallel_splits_match_transformers(smollm2_gguf, reference, split):
    with LLM(str(smollm2_gguf), device="cpu", dtype="float32", **split) as llm:
        tok = llm.get_tokenizer()
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32,
                                                    ignore_eos=True))
    for text, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(reference, tok.encode(text), 32), text
