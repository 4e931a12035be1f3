"""Structured outputs without a model: the parameters' checks, the bitmask against a plain
reference, and the llguidance backend's matchers and refusals."""

from __future__ import annotations

import msgspec
import pytest
import torch
from quire import SamplingParams
from quire.structured.backend import apply_bitmask, bitmask_words, make_grammar_backend
from quire.structured.params import StructuredOutputsParams
from tiny_models import build_checkpoint


@pytest.mark.parametrize("fields, words", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "JSON schema"),
    ({"regex": ""}, "non-empty"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty list"),
    ({"json_object": "yes"}, "json_object must be true"),
])
def test_bad_parameters_are_refused_naming_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_a_dict_and_cross_processes():
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert params.structured_outputs == StructuredOutputsParams(json={"type": "object"})
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert again.structured_outputs == params.structured_outputs
    with pytest.raises(ValueError, match="no field 'regexp'"):
        SamplingParams(structured_outputs={"regexp": "a"})


def test_the_cache_key_ignores_a_schema_dicts_key_order():
    a = StructuredOutputsParams(json={"type": "object", "required": []})
    b = StructuredOutputsParams(json={"required": [], "type": "object"})
    assert a.key() == b.key()


def test_apply_bitmask_equals_a_plain_reference():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 100, [0, 2, 3]
    logits = torch.randn(5, vocab, generator=gen)
    allowed = torch.rand(len(rows), vocab, generator=gen) < 0.3
    bitmask = torch.zeros(len(rows), bitmask_words(vocab), dtype=torch.int64)
    for t in range(vocab):
        bitmask[:, t // 32] |= allowed[:, t].long() << (t % 32)
    bitmask = bitmask.to(torch.int32)  # bit 31 set makes a word negative: still its bits
    expected = logits.clone()
    for i, r in enumerate(rows):
        expected[r][~allowed[i]] = float("-inf")
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from quire.tokenizer import load_tokenizer

    path = build_checkpoint("llama", tmp_path_factory.mktemp("tiny"))
    return make_grammar_backend(load_tokenizer(str(path)), 512, [2]), load_tokenizer(str(path))


def test_a_choice_matcher_allows_exactly_the_choices(backend):
    grammars, tokenizer = backend
    spec = StructuredOutputsParams(choice=["yes", "no"])
    grammars.check(spec)
    for word in ("yes", "no"):
        matcher = grammars.matcher(spec)
        for token in tokenizer.encode(word, add_special_tokens=False):
            mask = torch.zeros(1, bitmask_words(512), dtype=torch.int32)
            matcher.fill_bitmask(mask, 0)
            assert (mask[0, token // 32] >> (token % 32)) & 1, (word, token)
            matcher.accept(token)
        mask = torch.zeros(1, bitmask_words(512), dtype=torch.int32)
        matcher.fill_bitmask(mask, 0)
        assert (mask[0, 0] >> 2) & 1  # EOS allowed once a choice is complete


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputsParams(json={"type": "objectx"}), "objectx"),
    (StructuredOutputsParams(regex="(?=a)b"), "regex"),
    (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
])
def test_what_the_engine_cannot_compile_is_a_value_error(backend, spec, words):
    grammars, _ = backend
    with pytest.raises(ValueError, match=words):
        grammars.check(spec)
