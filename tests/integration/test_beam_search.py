"""Beam search (``LLM.beam_search``, ``use_beam_search``) against transformers'
``generate(num_beams=...)`` in float32 on tiny random models: the same token sequences,
scores within ``SCORE_TOL``; beams share prefix pages (block manager ref counts);
preemption and aborts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from quire import LLM, BeamSearchParams, SamplingParams
from tiny_models import hf_model
from transformers import GenerationConfig

#: Scores are float32 sums of float32 logprobs on both sides; ours are rebuilt in
#: float64 from the sum (transformers divides in float32).
SCORE_TOL = 1e-4

PROMPTS = [[1, 5, 9, 33, 71, 100, 7], [1, 40, 41, 42], [1, 200, 13, 77, 77, 12, 8, 90, 150, 3, 64]]

#: The tiny checkpoints' EOS id (their config's).
TINY_EOS = 2

#: (beam width, returned n, length_penalty, early_stopping)
CASES = [(2, 2, 1.0, False), (4, 2, 0.5, True), (3, 3, 2.0, "never"), (4, 1, 0.0, "never"),
         (2, 1, 1.5, True)]


@torch.inference_mode()
def hf_beams(model, prompt: list[int], width: int, n: int, max_new: int, lp: float,
             es: bool | str, eos: int | list[int] | None) -> list[tuple[list[int], float]]:
    """transformers' best ``n`` beams: (output tokens, sequences_scores)."""
    config = GenerationConfig(
        num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=max_new,
        length_penalty=lp, early_stopping=es, eos_token_id=eos, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True)
    r = model.generate(torch.tensor([prompt]), generation_config=config)
    out = []
    for i in range(n):
        length = int((r.beam_indices[i] >= 0).sum())
        tokens = r.sequences[i, len(prompt):len(prompt) + length].tolist()
        out.append((tokens, float(r.sequences_scores[i])))
    return out


def assert_same(ours, theirs, prompt):
    assert [s.tokens[len(prompt):] for s in ours.sequences] == [t for t, _ in theirs]
    for seq, (_, score) in zip(ours.sequences, theirs):
        assert seq.score == pytest.approx(score, abs=SCORE_TOL)
        assert seq.tokens[:len(prompt)] == prompt


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    with LLM(str(path), device="cpu", block_size=4, dtype="float32") as llm:
        yield path, llm, hf_model(path)


@pytest.mark.parametrize("width,n,lp,es", CASES)
def test_beams_equal_transformers(model, width, n, lp, es):
    _path, llm, hf = model
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
        n=n, best_of=width, use_beam_search=True, temperature=0, max_tokens=8,
        length_penalty=lp, early_stopping=es))
    for prompt, out in zip(PROMPTS, outs):
        theirs = hf_beams(hf, prompt, width, n, 8, lp, es, TINY_EOS)
        assert [c.token_ids for c in out.outputs] == [t for t, _ in theirs]
        for c, (tokens, score) in zip(out.outputs, theirs):
            assert c.cumulative_logprob / len(tokens) ** lp == pytest.approx(score,
                                                                            abs=SCORE_TOL)
            assert c.finish_reason == ("stop" if tokens[-1] == TINY_EOS else "length")
            assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0 and not stats.has_unfinished


@pytest.fixture(scope="module")
def eos_model(tiny_checkpoint, tmp_path_factory):
    """A Llama copy whose EOS is a token the beams reach early and often."""
    path = tiny_checkpoint("llama")
    with LLM(str(path), device="cpu", block_size=4, dtype="float32") as probe:
        [out] = probe.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                                  BeamSearchParams(4, 8, ignore_eos=True))
    eos = out.sequences[0].tokens[len(PROMPTS[0]) + 2]
    copy = tmp_path_factory.mktemp("beam") / "eos"
    shutil.copytree(path, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    with LLM(str(copy), device="cpu", block_size=4, dtype="float32") as llm:
        yield copy, eos, llm, hf_model(copy)


@pytest.mark.parametrize("width,n,lp,es", [(4, 4, 1.0, False), (3, 2, 2.0, True),
                                           (4, 3, 0.5, "never"), (2, 2, -1.0, False)])
def test_eos_ends_beams_as_in_transformers(eos_model, width, n, lp, es):
    _, eos, llm, hf = eos_model
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(width, 10, length_penalty=lp,
                                            early_stopping=es))
    stopped = 0
    for prompt, out in zip(PROMPTS, outs):
        theirs = hf_beams(hf, prompt, width, n, 10, lp, es, eos)
        assert len(out.sequences) == width
        out.sequences[:] = out.sequences[:n]
        assert_same(out, theirs, prompt)
        for seq in out.sequences:
            ends_in_eos = seq.tokens[-1] == eos
            assert seq.finish_reason == ("stop" if ends_in_eos else "length")
            stopped += ends_in_eos
    if lp <= 1.0:  # (a large length penalty ranks the long beams first)
        assert stopped, "no beam ended at the EOS: the case is not exercised"


def _page_bytes(llm: LLM) -> int:
    return llm.engine.core.executor.bytes_per_block()


def test_preemption_keeps_beams_equal_to_transformers(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with LLM(str(path), device="cpu", block_size=4, dtype="float32") as probe:
        page = _page_bytes(probe)
    params = BeamSearchParams(4, 16, length_penalty=0.5)
    # 4 beams of up to 26 tokens need 28 pages: one request fits, three do not at once
    with LLM(str(path), device="cpu", block_size=4, dtype="float32",
             kv_cache_memory=28 * page, enable_prefix_caching=False) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_used_blocks == 0
    hf = hf_model(path)
    for prompt, out in zip(PROMPTS, outs):
        assert_same(out, hf_beams(hf, prompt, 4, 4, 16, 0.5, False, TINY_EOS), prompt)


def test_groups_that_block_each_other_are_untangled(tiny_checkpoint):
    """Two 4-beam searches under max_num_seqs=4: each holds running beams that wait for
    beams the sequence cap keeps out; the newer group's waiting beams are preempted so
    the older one can go on, and both still equal transformers."""
    path = tiny_checkpoint("llama")
    with LLM(str(path), device="cpu", block_size=4, dtype="float32", max_num_seqs=4) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                               BeamSearchParams(4, 6))
        stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_used_blocks == 0
    hf = hf_model(path)
    for prompt, out in zip(PROMPTS, outs):
        assert_same(out, hf_beams(hf, prompt, 4, 4, 6, 1.0, False, TINY_EOS), prompt)


def _run_watching_pages(llm: LLM, prompt: list[int], params: SamplingParams
                        ) -> tuple[int, int]:
    """Run one request step by step, checking the pool's invariants; (the most pages
    held after a step, the most references any page had)."""
    engine = llm.engine
    core = engine.core
    bm = core.block_manager
    engine.add_request(prompt, params)
    most_pages = most_refs = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = list(core.scheduler.live_sequences())
        bm.check_invariants(live)
        most_pages = max(most_pages, bm.num_used_blocks)
        for seq in live:
            most_refs = max([most_refs] + [bm.ref_count(b) for b in seq.block_table])
    return most_pages, most_refs


def test_beams_share_pages_and_use_fewer_than_samples(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompt = [1] + list(range(10, 40))  # 31 tokens: 7 full pages of 4
    with LLM(str(path), device="cpu", block_size=4, dtype="float32",
             enable_prefix_caching=False) as llm:
        beam_pages, beam_refs = _run_watching_pages(llm, prompt, SamplingParams(
            n=4, use_beam_search=True, temperature=0, max_tokens=16, ignore_eos=True))
        beam_peak = llm.engine.stats().peak_used_blocks
    with LLM(str(path), device="cpu", block_size=4, dtype="float32",
             enable_prefix_caching=False) as llm:
        sample_pages, _ = _run_watching_pages(llm, prompt, SamplingParams(
            n=4, temperature=1.0, seed=0, max_tokens=16, ignore_eos=True))
        sample_peak = llm.engine.stats().peak_used_blocks
    assert beam_refs >= 4, "the prompt's pages are shared by every beam"
    assert beam_peak < sample_peak
    assert beam_pages <= sample_pages


def test_abort_frees_every_beam(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with LLM(str(path), device="cpu", block_size=4, dtype="float32") as llm:
        engine = llm.engine
        rid = engine.add_request(PROMPTS[2], SamplingParams(
            n=4, use_beam_search=True, temperature=0, max_tokens=20, ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert len(engine.core._requests[rid].seqs) > 1, "beams forked"
        out = engine.abort_request(rid)
        assert out is not None and out.finished
        assert {c.finish_reason for c in out.outputs} == {"abort"}
        bm = engine.core.block_manager
        assert bm.num_used_blocks == 0
        assert not engine.has_unfinished_requests()
        assert not list(engine.core.scheduler.live_sequences())
        bm.check_invariants([])


@pytest.mark.slow  # two engine core processes
def test_beams_in_core_processes_with_async_scheduling(tiny_checkpoint):
    """The search lives in the core: cores in their own processes (data parallel) and
    async scheduling (a beam search steps synchronously) give the same beams."""
    path = tiny_checkpoint("llama")
    params = BeamSearchParams(3, 8, length_penalty=0.5)
    with LLM(str(path), device="cpu", block_size=4, dtype="float32",
             data_parallel_size=2, async_scheduling=True) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    hf = hf_model(path)
    for prompt, out in zip(PROMPTS, outs):
        assert_same(out, hf_beams(hf, prompt, 3, 3, 8, 0.5, False, TINY_EOS), prompt)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """SmolLM2-135M (GGUF) in float32, ours and transformers' dequantized copy."""
    with LLM(str(smollm2_gguf), device="cpu", dtype="float32") as llm:
        yield llm, hf_model(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.mark.slow  # SmolLM2-135M in float32 on both sides
@pytest.mark.parametrize("width,n,lp,es", [(4, 2, 1.0, False), (3, 3, 0.8, True)])
def test_smollm2_beams_equal_transformers(smollm2, width, n, lp, es):
    llm, hf = smollm2
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    eos = sorted(llm.engine.core.eos_token_ids)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(width, 12, length_penalty=lp, early_stopping=es))
    for prompt, out in zip(prompts, outs):
        out.sequences[:] = out.sequences[:n]
        assert_same(out, hf_beams(hf, prompt, width, n, 12, lp, es, eos), prompt)


def test_best_of_sampling_keeps_the_likeliest_samples(tiny_checkpoint):
    """``best_of > n`` without beam search (vLLM's): the ``n`` of ``best_of`` seeded
    samples with the highest cumulative logprob, best first, without the per-token
    logprobs nobody asked for."""
    path = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(path), device="cpu", block_size=4, dtype="float32") as llm:
        every = llm.generate(prompts, SamplingParams(n=5, temperature=1.0, seed=11,
                                                     max_tokens=8, logprobs=0))
        best = llm.generate(prompts, SamplingParams(n=2, best_of=5, temperature=1.0,
                                                    seed=11, max_tokens=8))
        assert llm.engine.stats().num_used_blocks == 0
    for all_out, best_out in zip(every, best):
        ranked = sorted(all_out.outputs, key=lambda c: -c.cumulative_logprob)
        assert [c.token_ids for c in best_out.outputs] == [c.token_ids for c in ranked[:2]]
        assert [c.index for c in best_out.outputs] == [0, 1]
        assert all(c.logprobs is None for c in best_out.outputs)
        assert [c.cumulative_logprob for c in best_out.outputs] == pytest.approx(
            [c.cumulative_logprob for c in ranked[:2]])
