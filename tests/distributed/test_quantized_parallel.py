"""Quantised models across worker processes (the ``mp`` executor, gloo on cpu): tensor
and pipeline parallel ranks hold their share of a GGUF file's blocks (column shards are
rows of blocks, row-parallel shards whole blocks of each row) or of int8 rows made on
load, and greedy output equals the single-process engine token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
from greedy_runs import assert_greedy_close
from quire import LLM, SamplingParams

PROMPTS = [[1, 17, 45, 99, 23, 7], [1, 200, 33], list(range(3, 40))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _greedy(path, **options) -> list[list[int]]:
    with LLM(str(path), device="cpu", max_model_len=128, kv_cache_memory=16 << 20,
             **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _greedy_tops(path, **options):
    """Each sequence's greedy tokens, their logprobs and each step's two likeliest
    (``greedy_runs.assert_greedy_close``'s runs)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(str(path), device="cpu", max_model_len=128, kv_cache_memory=16 << 20,
             **options) as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return [(o.token_ids, [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)],
             [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def q4_k_m(random_gguf) -> Path:
    """A small Llama in llama.cpp's Q4_K_M mix whose row-parallel inputs (512 and 1024
    wide) split in two on whole 256-weight blocks."""
    return random_gguf("--preset", "tiny", "--hidden-size", "512", "--ffn-size", "1024",
                       "--head-dim", "128", "--seed", "5")


def test_tp2_and_pp2_on_gguf_blocks_equal_one_process(q4_k_m):
    """Float32 activations (an explicit dtype): every product is the blocks' exact one up
    to summation order, so the shards' greedy tokens are the whole model's."""
    one = _greedy(q4_k_m, quantization="gguf", dtype="float32")
    assert _greedy(q4_k_m, quantization="gguf", dtype="float32",
                   tensor_parallel_size=2) == one
    assert _greedy(q4_k_m, quantization="gguf", dtype="float32",
                   pipeline_parallel_size=2) == one


def test_tp2_and_pp2_on_gguf_blocks_at_the_defaults_stay_close(q4_k_m):
    """At the defaults a CPU with AVX512_BF16 rounds the products' rows to bfloat16
    (``activations``, ``decode_activations``). A shard rounds the values the whole model
    does, but its sums' float32 order moves a value past a bfloat16 rounding boundary
    now and then, a change of 2^-8 in that value: logprobs stay within 1e-2, and tokens
    agree up to a near-tie within that (``greedy_runs.assert_greedy_close``)."""
    one = _greedy_tops(q4_k_m, quantization="gguf")
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        assert_greedy_close(_greedy_tops(q4_k_m, quantization="gguf", **layout), one, 1e-2)


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
