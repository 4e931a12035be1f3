"""Quantised models across worker processes (the ``mp`` executor, gloo on cpu): tensor
and pipeline parallel ranks hold their share of a GGUF file's blocks (column shards are
rows of blocks, row-parallel shards whole blocks of each row) or of int8 rows made on
load, and greedy output equals the single-process engine token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
from quire import LLM, SamplingParams

PROMPTS = [[1, 17, 45, 99, 23, 7], [1, 200, 33], list(range(3, 40))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _greedy(path, **options) -> list[list[int]]:
    with LLM(str(path), device="cpu", max_model_len=128, kv_cache_memory=16 << 20,
             **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def q4_k_m(random_gguf) -> Path:
    """A small Llama in llama.cpp's Q4_K_M mix whose row-parallel inputs (512 and 1024
    wide) split in two on whole 256-weight blocks."""
    return random_gguf("--preset", "tiny", "--hidden-size", "512", "--ffn-size", "1024",
                       "--head-dim", "128", "--seed", "5")


def test_tp2_and_pp2_on_gguf_blocks_equal_one_process(q4_k_m):
    one = _greedy(q4_k_m, quantization="gguf")
    assert _greedy(q4_k_m, quantization="gguf", tensor_parallel_size=2) == one
    assert _greedy(q4_k_m, quantization="gguf", pipeline_parallel_size=2) == one


def test_pp2_lone_sequence_on_gguf_blocks_equals_one_process(q4_k_m):
    """One sequence alone: each stage runs its range of layers in one C call (the cpu
    platform's FusedDecodeStack, the second from the residual stream the first sends),
    and the tokens and logprobs are the single process's."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)

    def lone(**options):
        with LLM(str(q4_k_m), device="cpu", max_model_len=128, kv_cache_memory=16 << 20,
                 quantization="gguf", **options) as llm:
            out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)[0].outputs[0]
        return out.token_ids, [step[t].logprob for step, t in zip(out.logprobs,
                                                                   out.token_ids)]

    (tokens, logprobs), (one_tokens, one_logprobs) = lone(pipeline_parallel_size=2), lone()
    assert tokens == one_tokens
    assert logprobs == pytest.approx(one_logprobs, abs=1e-5)


def test_tp2_int8_equals_one_process(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    per_row = {"quantization": "int8", "quantization_config": {"group_size": -1}}
    assert _greedy(path, **per_row, tensor_parallel_size=2) == _greedy(path, **per_row)


@pytest.mark.slow
def test_tp2_int8_groups_load_where_a_shard_splits_a_group(tiny_checkpoint):
    """The default 32-weight groups: down_proj's 96 inputs split in two are no whole
    groups, so that layer takes a scale per row (tests/unit/test_quantize_groups.py)."""
    tokens = _greedy(tiny_checkpoint("llama"), quantization="int8", tensor_parallel_size=2)
    assert [len(t) for t in tokens] == [8, 8, 8]


@pytest.mark.slow
def test_tp2_w8a8_turns_whole_group_shards_and_matches_one_process(tiny_checkpoint):
    """w8a8 in the Hadamard basis across two ranks: o_proj's 64 inputs split into whole
    groups of 32, each rank turning its own (tests/unit/test_quantize_groups.py holds the
    shards' sum to one rank's product); down_proj's 96 split into 48 cut a group and keep
    the plain basis, with a scale per row. The greedy tokens agree with one process on
    most positions (that one layer is quantised differently there)."""
    path = tiny_checkpoint("llama")
    two = _greedy(path, quantization="w8a8", tensor_parallel_size=2)
    one = _greedy(path, quantization="w8a8")
    assert [len(t) for t in two] == [8, 8, 8]
    same = sum(a == b for x, y in zip(two, one) for a, b in zip(x, y))
    assert same >= 16, (two, one)  # 20 of 24 here
