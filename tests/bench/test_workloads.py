"""Workloads: exact token lengths, determinism, distinct prompts, the presets' shapes."""

from __future__ import annotations

import dataclasses

import pytest
from quire.bench.corpus import CORPUS_PATH, ByteSource, Corpus, TokenizerSource
from quire.bench.workloads import (
    DISTINCT_HEAD,
    PRESETS,
    WorkloadSpec,
    build_requests,
    preset,
)

# The tiny model's tokenizer has a 384-token vocabulary: the corpus is long in its tokens,
# so every preset fits; a short custom spec keeps the slow checks quick.
SMALL = WorkloadSpec("S", "small", num_requests=24, input_len=(8, 96), output_len=(1, 9), seed=7)


def test_corpus_is_large_plain_text():
    data = CORPUS_PATH.read_bytes()
    assert len(data) >= 100_000
    assert data.isascii()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_give_exact_lengths_that_round_trip(name, tiny_corpus, tiny_tokenizer):
    spec = PRESETS[name]
    requests = build_requests(spec, tiny_corpus)
    assert len(requests) == spec.num_requests
    for r in requests:
        own = r.prompt_len - spec.shared_prefix_len - spec.quote_len
        assert spec.input_len[0] <= own <= spec.input_len[1]
        assert spec.output_len[0] <= r.output_len <= spec.output_len[1]
        # the text is what a server receives: it must tokenize to the very same ids
        assert tuple(tiny_tokenizer.encode(r.prompt.text)) == r.prompt_token_ids


def test_a_quoting_workload_repeats_each_prompt_s_start_after_it(tiny_corpus):
    spec = PRESETS["W6"].with_overrides(num_requests=4)
    for r in build_requests(spec, tiny_corpus):
        ids = r.prompt_token_ids
        assert len(ids) == 128 + 64
        passage = ids[tiny_corpus.num_special:128]
        quoted = ids[128:]
        # the quote is the passage's opening text again: the same ids, but for the first,
        # which the boundary with the passage's end may merge
        assert quoted[1:40] == passage[1:40]
    with pytest.raises(ValueError, match="quote_len"):
        PRESETS["W6"].__class__("X", "x", 1, (8, 8), (4, 4), quote_len=8)


def test_fixed_lengths_are_exact(tiny_corpus):
    spec = PRESETS["W1"].with_overrides(num_requests=10, input_len=37, output_len=5)
    requests = build_requests(spec, tiny_corpus)
    assert [r.prompt_len for r in requests] == [37] * 10
    assert [r.output_len for r in requests] == [5] * 10
    assert spec.name == "W1+custom" and "10 requests" in spec.description


def test_same_spec_gives_same_token_ids(tiny_tokenizer):
    first = build_requests(SMALL, Corpus(TokenizerSource(tiny_tokenizer)))
    again = build_requests(SMALL, Corpus(TokenizerSource(tiny_tokenizer)))
    assert first == again


def test_repeats_keep_the_shape_but_change_the_text(tiny_corpus):
    spec = SMALL.with_overrides(input_len=40, output_len=3)
    first = build_requests(spec, tiny_corpus, repeat=0)
    second = build_requests(spec, tiny_corpus, repeat=1)
    assert [r.prompt_len for r in first] == [r.prompt_len for r in second] == [40] * 24
    assert [r.prompt_token_ids for r in first] != [r.prompt_token_ids for r in second]


def _heads(requests, skip):
    return [r.prompt_token_ids[skip:skip + DISTINCT_HEAD] for r in requests]


@pytest.mark.parametrize("name", ["W1", "W3", "W5"])
def test_prompts_share_no_prefix(name, tiny_corpus):
    requests = build_requests(PRESETS[name], tiny_corpus)
    heads = _heads(requests, tiny_corpus.num_special)
    assert len(set(heads)) == len(heads)


def test_w4_shares_exactly_its_system_prompt(tiny_corpus):
    spec = PRESETS["W4"]
    requests = build_requests(spec, tiny_corpus)
    prefix = requests[0].prompt_token_ids[:spec.shared_prefix_len]
    assert all(r.prompt_token_ids[:spec.shared_prefix_len] == prefix for r in requests)
    assert all(r.prompt_len == spec.shared_prefix_len + 64 for r in requests)
    tails = _heads(requests, spec.shared_prefix_len)
    assert len(set(tails)) == len(tails)
    # the text begins with the system prompt's text too, so a server's cache can share it
    texts = {r.prompt.text[:200] for r in requests}
    assert len(texts) == 1


def test_w3_is_mixed_within_its_ranges(tiny_corpus):
    requests = build_requests(PRESETS["W3"], tiny_corpus)
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert min(prompts) >= 16 and max(prompts) <= 1024
    assert min(outputs) >= 16 and max(outputs) <= 256
    assert len(set(prompts)) > 20 and len(set(outputs)) > 20


def test_byte_source_needs_no_model():
    requests = build_requests(PRESETS["W3"], Corpus(ByteSource()))
    assert all(len(r.prompt.text.encode()) == r.prompt_len for r in requests)


def test_unknown_preset_and_bad_specs_are_named():
    with pytest.raises(ValueError, match="W1, W2, W3, W4, W5"):
        preset("W9")
    assert preset("w3") is PRESETS["W3"]
    with pytest.raises(ValueError, match="input_len"):
        dataclasses.replace(SMALL, input_len=(5, 4))
    with pytest.raises(ValueError, match="longer than the benchmark corpus"):
        build_requests(SMALL.with_overrides(input_len=10_000_000), Corpus(ByteSource()))
