"""Speculative decoding changes no greedy output: the same tokens, finish and stop
reasons and text as without it, through chunked prefill, preemption, prefix hits, n > 1,
stop strings, stop token ids, EOS, max_tokens, min_tokens, penalties and a grammar;
seeded sampling stays reproducible; nothing leaks. Each test runs with n-gram prompt
lookup and with a draft model (a noisy copy of the target), on the tiny llama, whose
greedy outputs repeat: drafts of both kinds are proposed, accepted and rejected."""

from __future__ import annotations

import re

import pytest
from draft_variant import perturbed_copy
from eos_variant import eos_variant
from quire import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 9, 77, 3, 101, 64, 8, 5, 17, 42, 9], [12, 7, 7, 12, 7, 7, 12, 7],
           [99, 98, 97, 96, 95, 94], list(range(30, 51)) * 2, [1, 2, 3, 4, 5, 1, 2, 3]]
REGEX = r"[a-z]{2,5}( [a-z]{2,5}){0,3}\."
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def made(tiny_checkpoint, tmp_path_factory):
    """A copy of the tiny llama whose EOS is a token greedy decoding reaches, a stop
    string and a stop token id that the greedy outputs hold, and a noisy copy of it to
    draft (noise small enough that some of its proposals are accepted)."""
    directory = tmp_path_factory.mktemp("spec")
    path, eos, stop, stop_id = eos_variant(tiny_checkpoint("llama"), PROMPTS, directory,
                                           eos_at=6)
    return path, eos, stop, stop_id, perturbed_copy(path, directory, scale=0.02)


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec(request, made) -> dict:
    """The ``speculative_config`` of each method under test."""
    if request.param == "ngram":
        return NGRAM
    return {"model": made[4], "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def setup(made):
    """(the target's path, its EOS id, a stop string, a stop token id)."""
    return made[:4]


def _greedy_params(stop: str, stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),  # EOS on
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=8, repetition_penalty=1.2,
                       frequency_penalty=0.3, presence_penalty=0.2, logit_bias={7: 2.0}),
    ]


def _generate(path: str, spec: dict | None, params, passes: int = 1, **options):
    """Every pass's outputs (per sample: tokens, finish and stop reasons, text, logprobs)
    and the engine's stats; checks that nothing leaked."""
    with LLM(path, device="cpu", block_size=4, speculative_config=spec, **options) as llm:
        core = llm.engine.core
        runs = []
        for _ in range(passes):
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            runs.append([[(c.token_ids, c.finish_reason, c.stop_reason, c.text,
                           [{t: lp.rank for t, lp in d.items()} for d in c.logprobs or []])
                          for c in o.outputs] for o in outs])
        assert not core.has_unfinished_requests()
        assert core.block_manager.num_used_blocks == 0
        core.block_manager.check_invariants(list(core.scheduler.live_sequences()))
        assert core.sampler.num_seq_generators() == 0
        assert core._speculator is None or len(core._speculator.tokens) == 0
        return runs, core.stats()


def _page_bytes(path: str, spec: dict | None = None) -> int:
    """One page's bytes (a draft model's K/V shares the page ids, and the budget)."""
    with LLM(path, device="cpu", block_size=4, speculative_config=spec) as probe:
        return probe.engine.core.executor.bytes_per_block()


@pytest.mark.parametrize("scenario", ["plain", "chunked-prefill", "preemption",
                                      "prefix-hits", "async-scheduling"])
def test_greedy_outputs_equal_those_without_speculation(scenario, setup, spec):
    path, eos, stop, stop_id = setup
    options: dict = {}
    spec_options: dict | None = None
    passes = 1
    if scenario == "chunked-prefill":
        options = {"max_num_batched_tokens": 8}
    elif scenario == "preemption":
        # the same 20 pages either way: a draft's K/V takes its share of the budget
        options = {"kv_cache_memory": 20 * _page_bytes(path)}
        spec_options = {"kv_cache_memory": 20 * _page_bytes(path, spec)}
    elif scenario == "prefix-hits":
        passes = 2  # the second pass finds pages the first pass's accepted drafts filled
    elif scenario == "async-scheduling":
        # asynchronous steps while 3 or more of the 5 sequences run (no drafts), then
        # synchronous ones with drafts
        options = {"async_scheduling": True}
        spec = {**spec, "disable_by_batch_size": 3}
    params = _greedy_params(stop, stop_id)
    if scenario == "async-scheduling":
        # one outlives the rest by enough that a draft model's catch-up pays (it stops
        # drafting a sequence whose lag exceeds what it has left to produce)
        params[1] = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain, plain_stats = _generate(path, None, params, passes, **options)
    got, stats = _generate(path, spec, params, passes,
                           **(options if spec_options is None else spec_options))
    assert got == plain
    # drafts were proposed, and both accepted and rejected
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_drafts > 0 and len(stats.spec_accepted_per_pos) == 3
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert plain_stats.spec_num_drafts == 0
    # the rules this workload is meant to exercise did fire
    samples = [x for run in plain for out in run for x in out]
    assert any(x[1] == "stop" and x[2] is None and x[0][-1] == eos for x in samples), \
        "no EOS"
    assert any(x[2] == stop_id for x in samples), "no stop token id"
    assert any(x[2] == stop for x in samples), "no stop string"
    assert any(x[1] == "length" for x in samples)
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario == "prefix-hits":
        assert stats.prefix_hits > 0


def test_a_grammar_holds_drafts_and_outputs(setup, spec):
    path = setup[0]
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": REGEX})
    plain, _ = _generate(path, None, params)
    got, _ = _generate(path, spec, params)
    assert got == plain
    for out in got[0]:
        assert re.fullmatch(REGEX, out[0][3]), out[0][3]


def test_seeded_sampling_is_reproducible_and_keeps_its_rules(setup, spec):
    path = setup[0]
    params = [SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=3, max_tokens=14,
                             min_tokens=6, ignore_eos=False, repetition_penalty=1.1),
              SamplingParams(temperature=0.7, seed=11, max_tokens=30,
                             structured_outputs={"regex": REGEX}),
              SamplingParams(temperature=0.5, top_k=5, seed=5, max_tokens=16, logprobs=1,
                             ignore_eos=True),
              SamplingParams(temperature=0.9, min_p=0.05, seed=8, max_tokens=12,
                             ignore_eos=True),
              SamplingParams(temperature=1.2, seed=9, max_tokens=12, ignore_eos=True,
                             presence_penalty=0.5, frequency_penalty=0.2)]
    first, stats = _generate(path, spec, params)
    again, _ = _generate(path, spec, params)
    assert first == again
    assert stats.spec_num_drafts > 0
    for out in first[0][0]:
        assert len(out[0]) >= 6  # min_tokens
    assert re.fullmatch(REGEX, first[0][1][0][3])
    for tokens, _, _, _, logprobs in first[0][2]:
        assert len(tokens) == 16 and len(logprobs) == len(tokens)
        assert all(len(entry) in (1, 2) for entry in logprobs)


@pytest.mark.slow  # about 30 s each: two worker processes per engine
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
def test_greedy_outputs_with_worker_processes_equal_those_without(setup, spec, layout,
                                                                   monkeypatch):
    """A draft model runs on every rank of a tensor-parallel group, and on the first
    pipeline stage, whose first rank sends its proposals back with the step: the drafts
    verified are the draft's own greedy tokens (transformers', for a spread of them)."""
    from spec_probes import record_drafts
    from tiny_models import hf_greedy, hf_model

    path, _, stop, stop_id = setup
    params = _greedy_params(stop, stop_id)
    plain, _ = _generate(path, None, params)
    seen = record_drafts(monkeypatch)
    got, stats = _generate(path, spec, params, distributed_executor_backend="mp", **layout)
    assert got == plain
    assert stats.spec_num_accepted_tokens > 0
    if "model" in spec:
        draft = hf_model(spec["model"])
        checked = [(c, d) for c, d in seen[:: max(1, len(seen) // 8)] if d]
        assert len(checked) >= 4
        for context, drafts in checked:
            assert drafts == hf_greedy(draft, context, len(drafts)), context


@pytest.mark.slow  # about 20 s: two engine core processes
def test_engine_core_processes_speculate_and_report_their_counts(setup, spec):
    path, _, stop, stop_id = setup
    params = _greedy_params(stop, stop_id)
    plain, _ = _generate(path, None, params)
    with LLM(path, device="cpu", block_size=4, speculative_config=spec,
             data_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        stats = llm.engine.stats()
    got = [[(c.token_ids, c.finish_reason, c.stop_reason, c.text,
             [{t: lp.rank for t, lp in d.items()} for d in c.logprobs or []])
            for c in o.outputs] for o in outs]
    assert got == plain[0]
    assert stats.spec_num_draft_tokens >= stats.spec_num_accepted_tokens > 0
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
