"""Greedy outputs equal transformers' float32 greedy outputs, token for token.

Tiny random-weight Llama (llama3 RoPE scaling), Mistral (sliding window shorter than
the prompts), Qwen2 (qkv bias, tied embeddings) and Qwen3 (q/k norm, head_dim != hidden /
heads), each under every engine configuration that changes the data path: prefix caching
on and off, a token budget that forces chunked prefill, a page pool that forces
preemption, and block sizes 1, 16 and 7 (7 divides none of the prompt lengths).
"""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams
from tiny_models import ARCHS, hf_greedy, hf_model

MAX_TOKENS = 16
_TEXTS = [
    "Once upon a time there was a quiet village by the sea",
    "Once upon a time there was a quiet village by the sea, where the fishermen told",
    "Once upon a time there was a quiet village",
    "The capital of France is",
    "Attention is all you need; paged attention keeps the cache in fixed-size blocks of",
    "a",
]


def _page_bytes(llm: LLM) -> int:
    spec = llm.engine.core.kv_spec
    return 2 * spec.num_layers * llm.engine.config.block_size * spec.num_kv_heads \
        * spec.head_size * 4


SCENARIOS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 8},
    "preemption": {"block_size": 4, "kv_pages": 18},
    "block-size-1": {"block_size": 1},
    "block-size-7": {"block_size": 7, "max_num_batched_tokens": 13},
}


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint):
    """``oracle(arch) -> (prompts as token ids, HF greedy continuations)``, cached."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(arch: str):
        if arch not in cache:
            from transformers import AutoTokenizer

            path = tiny_checkpoint(arch)
            tok = AutoTokenizer.from_pretrained(path)
            prompts = [tok.encode(t) for t in _TEXTS]
            model = hf_model(path)
            cache[arch] = prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
        return cache[arch]

    return get


def _make_llm(path, scenario: dict) -> LLM:
    options = dict(scenario)
    kv_pages = options.pop("kv_pages", None)
    llm = LLM(str(path), device="cpu", dtype="float32", **options)
    if kv_pages is not None:  # rebuild with a pool of exactly kv_pages pages
        page = _page_bytes(llm)
        llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=kv_pages * page,
                  **options)
        assert llm.engine.core.block_manager.num_blocks == kv_pages
    return llm


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, scenario, tiny_checkpoint, oracle):
    prompts, expected = oracle(arch)
    llm = _make_llm(tiny_checkpoint(arch), SCENARIOS[scenario])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == expected[i], f"prompt {i} ({len(prompts[i])} tokens)"
        assert out.outputs[0].finish_reason == "length"

    engine = llm.engine
    if scenario == "preemption":
        assert engine.core.scheduler.stats.num_preemptions > 0
    if scenario == "chunked-prefill":
        assert max(len(p) for p in prompts) > engine.config.max_num_batched_tokens

    # Again, now that the prompts' pages are cached: same tokens, and served from cache.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in again] == expected
    cached = sum(o.num_cached_tokens for o in again)
    if engine.config.enable_prefix_caching:
        assert cached > 0
    else:
        assert cached == 0
    engine.core.block_manager.check_invariants([])
    assert engine.core.block_manager.num_used_blocks == 0


def test_text_prompts_and_outputs_round_trip(tiny_checkpoint, oracle):
    prompts, expected = oracle("llama")
    llm = LLM(str(tiny_checkpoint("llama")), device="cpu")
    outs = llm.generate(_TEXTS[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tok = llm.get_tokenizer()
    for text, ids, want, out in zip(_TEXTS, prompts, expected, outs):
        assert out.prompt == text
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].text == tok.decode(want, skip_special_tokens=True)
