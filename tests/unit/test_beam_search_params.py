"""Beam search parameters: what ``SamplingParams`` and the engine refuse, by name."""

from __future__ import annotations

import pytest
from quire import BeamSearchParams, SamplingParams
from quire.engine.beam_search import check_beam_fits, check_beam_params


@pytest.mark.parametrize("field,value", [
    ("top_p", 0.5), ("top_k", 5), ("min_p", 0.1), ("presence_penalty", 1.0),
    ("repetition_penalty", 1.2), ("logprobs", 2), ("prompt_logprobs", 1), ("stop", ["x"]),
    ("stop_token_ids", [3]), ("min_tokens", 2), ("logit_bias", {3: 1.0})])
def test_beam_search_refuses_options_it_does_not_run(field, value):
    params = SamplingParams(n=2, use_beam_search=True, temperature=1.0, **{field: value})
    with pytest.raises(ValueError, match=field):
        check_beam_params(params)


def test_beam_width_is_best_of_or_n():
    assert SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0).beam_width == 4
    assert SamplingParams(n=3, use_beam_search=True, temperature=0).beam_width == 3
    check_beam_params(BeamSearchParams(4, 8).to_sampling_params())


@pytest.mark.parametrize("kwargs,field", [
    ({"n": 1, "best_of": 3, "temperature": 0}, "best_of"),  # greedy samples are equal
    ({"n": 3, "best_of": 2, "use_beam_search": True}, "best_of"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"use_beam_search": True, "early_stopping": 1}, "early_stopping"),
    ({"use_beam_search": True, "length_penalty": float("inf")}, "length_penalty"),
    ({"use_beam_search": "yes"}, "use_beam_search")])
def test_bad_beam_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_every_beam_must_fit_the_pool_and_the_sequence_cap():
    params = SamplingParams(n=4, use_beam_search=True, temperature=0)
    check_beam_fits("r", params, max_kv_tokens=16, block_size=4, num_blocks=16,
                    max_num_seqs=4)
    with pytest.raises(ValueError, match="KV pages"):
        check_beam_fits("r", params, max_kv_tokens=17, block_size=4, num_blocks=16,
                        max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        check_beam_fits("r", params, max_kv_tokens=4, block_size=4, num_blocks=16,
                        max_num_seqs=3)


def test_best_of_sampling_runs_best_of_samples_with_their_logprobs():
    asked = SamplingParams(n=2, best_of=5, temperature=1.0, seed=1)
    run = asked.best_of_samples()
    assert (run.n, run.best_of, run.logprobs, run.seed) == (5, None, 0, 1)
    assert asked.n == 2 and asked.logprobs is None  # the request's own are untouched
    plain = SamplingParams(n=2, temperature=1.0)
    assert plain.best_of_samples() is plain
    beams = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0)
    assert beams.best_of_samples() is beams
