"""The offline API's contract: prompt forms, stopping, limits, and errors that name things."""

from __future__ import annotations

import json
import shutil

import pytest

from quire import LLM, SamplingParams
from tiny_models import hf_greedy, hf_model

PROMPT = "Once upon a time there was a quiet village by the sea"


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    llm = LLM(str(path), device="cpu")
    ids = llm.get_tokenizer().encode(PROMPT)
    expected = hf_greedy(hf_model(path), ids, 16)
    return path, llm, ids, expected


def test_prompt_forms_give_the_same_tokens(llama):
    _, llm, ids, expected = llama
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt in (PROMPT, ids, {"prompt_token_ids": ids}, {"prompt": PROMPT}):
        [out] = llm.generate(prompt, params)
        assert out.outputs[0].token_ids == expected
        assert out.prompt_token_ids == ids
        assert out.outputs[0].index == 0 and out.request_id


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(llama):
    _, llm, ids, expected = llama
    outs = llm.generate([ids, ids[:3], ids],
                        [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                         SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 2, 9]
    assert outs[0].outputs[0].token_ids == expected[:4]
    assert outs[2].outputs[0].token_ids == expected[:9]
    assert outs[1].prompt_token_ids == ids[:3]


def test_stop_token_ids_end_generation_and_are_reported(llama):
    _, llm, ids, expected = llama
    stop = expected[5]
    first = expected.index(stop)
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                             stop_token_ids=[stop]))
    assert out.outputs[0].token_ids == expected[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop


def test_eos_from_generation_config_stops_unless_ignored(llama, tmp_path):
    path, _, ids, expected = llama
    eos = expected[6]
    first = expected.index(eos)
    model_dir = tmp_path / "with-eos"
    shutil.copytree(path, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    llm = LLM(str(model_dir), device="cpu")
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16))
    assert out.outputs[0].token_ids == expected[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out.outputs[0].token_ids == expected


def test_max_model_len_caps_generation(llama):
    path, _, ids, expected = llama
    llm = LLM(str(path), device="cpu", max_model_len=len(ids) + 5)
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out.outputs[0].token_ids == expected[:5]
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt"),
        ([10**6], "outside the vocabulary"),
        (list(range(1, 300)), "max_model_len"),
        ({"text": "x"}, "prompt_token_ids"),
        (3.5, "prompt"),
    ],
)
def test_bad_prompts_raise_before_anything_runs_and_the_engine_keeps_working(
    llama, prompt, message
):
    _, llm, ids, expected = llama
    with pytest.raises(ValueError, match=message):
        llm.generate([ids, prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()
    [out] = llm.generate(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out.outputs[0].token_ids == expected[:4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"dtype": "float8"}, "dtype"),
        ({"kv_cache_memory": 1.5}, "kv_cache_memory"),
        ({"no_such_option": 1}, "no_such_option"),
        ({"device": "nonexistent"}, "nonexistent"),
        ({"max_model_len": 10**6}, "max_model_len"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "max_num_batched_tokens"),
    ],
)
def test_bad_engine_options_name_the_option(tiny_checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_checkpoint("llama")), **kwargs)


def test_unsupported_architecture_lists_the_supported_ones(tiny_checkpoint, tmp_path):
    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    config["model_type"] = "llama"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(model_dir), device="cpu")


def test_abort_frees_pages_at_once(llama):
    _, llm, ids, _ = llama
    engine = llm.engine
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.core.block_manager.num_used_blocks > 0
    engine.abort_request(rid)
    assert engine.core.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    engine.core.block_manager.check_invariants([])
