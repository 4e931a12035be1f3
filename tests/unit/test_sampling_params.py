"""SamplingParams: vLLM defaults, normalisation, and errors that name the field."""

import math

import pytest

from quire.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == \
        (16, 0, None, None, None)
    assert p.stop == () and p.stop_token_ids == () and p.logit_bias is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, r"n must be an integer >= 1, got 0"),
        ({"n": 1.5}, r"n must be an integer"),
        ({"temperature": -0.1}, r"temperature must be in \[0, 2\], got -0.1"),
        ({"temperature": 2.5}, r"temperature must be in \[0, 2\]"),
        ({"temperature": math.nan}, r"temperature must be in"),
        ({"temperature": "hot"}, r"temperature must be in"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_k": -2}, r"top_k must be 0 or -1 \(off\) or an integer >= 1, got -2"),
        ({"top_k": 2.0}, r"top_k must be"),
        ({"min_p": 1.01}, r"min_p must be in \[0, 1\], got 1.01"),
        ({"min_p": -0.5}, r"min_p must be in \[0, 1\]"),
        ({"seed": 1.0}, r"seed must be an integer"),
        ({"seed": 2**64}, r"seed must be an integer in \["),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, inf\) and within "
                                      r"float32's normal range .*, got 0.0"),
        ({"repetition_penalty": 1e-300}, r"repetition_penalty must be in \(0, inf\) and "),
        ({"max_tokens": 2**64}, r"max_tokens must be an integer >= 1 \(within int64\)"),
        ({"repetition_penalty": math.inf}, r"repetition_penalty must be in \(0, inf\)"),
        ({"presence_penalty": 2.1}, r"presence_penalty must be in \[-2, 2\], got 2.1"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
        ({"logit_bias": {5: 101.0}}, r"logit_bias\[5\] must be in \[-100, 100\], got 101.0"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 1.0}}, r"logit_bias keys must be token ids"),
        ({"logit_bias": [1, 2]}, r"logit_bias must be a dict"),
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1, got 0"),
        ({"min_tokens": -1}, r"min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 17}, r"min_tokens must be in \[0, max_tokens=16\], got 17"),
        ({"stop": ""}, r"stop must be a non-empty string"),
        ({"stop": ["ok", ""]}, r"stop must be a non-empty string"),
        ({"stop": [3]}, r"stop must be"),
        ({"stop_token_ids": [-3]}, r"stop_token_ids must be token ids"),
        ({"stop_token_ids": [True]}, r"stop_token_ids must be token ids"),
        ({"logprobs": -2}, r"logprobs must be None, an integer >= 0, or -1"),
        ({"logprobs": True}, r"logprobs must be None"),
        ({"prompt_logprobs": 1.0}, r"prompt_logprobs must be None"),
        ({"ignore_eos": 1}, r"ignore_eos must be True or False"),
        ({"include_stop_str_in_output": None}, r"include_stop_str_in_output must be True"),
        ({"skip_special_tokens": "no"}, r"skip_special_tokens must be True or False"),
        ({"spaces_between_special_tokens": 0}, r"spaces_between_special_tokens must be"),
        ({"temperature": 0.0, "n": 2}, r"n must be 1 when sampling greedily"),
        ({"allowed_token_ids": []}, r"allowed_token_ids must hold at least one"),
        ({"allowed_token_ids": [1, -1]}, r"allowed_token_ids must hold token ids"),
        ({"allowed_token_ids": "12"}, r"allowed_token_ids must be a list"),
        ({"bad_words": ["ok", " "]}, r"bad_words must be a list of non-blank strings"),
        ({"bad_words": [3]}, r"bad_words must be a list"),
        ({"bad_words_token_ids": [[1], []]}, r"bad_words_token_ids must not hold an empty"),
        ({"bad_words_token_ids": [1, 2]}, r"bad_words_token_ids must be a list of token"),
        ({"logits_processors": [3]}, r"logits_processors must hold callables"),
        ({"logits_processors": [lambda x: x]}, r"logits_processors take \(output_ids"),
    ],
)
def test_invalid_values_name_the_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(top_k=-1, seed=-1, stop="###", stop_token_ids=[5, 3, 5],
                       logit_bias={7: -100, 2: 0.5}, max_tokens=None, min_tokens=40)
    assert p.top_k == 0 and p.seed is None
    assert p.stop == ("###",) and p.stop_token_ids == (5, 3)
    assert p.logit_bias == {7: -100.0, 2: 0.5}
    assert p.max_tokens is None and p.min_tokens == 40  # no upper bound without max_tokens
    assert SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b")


def test_inputs_are_copied_not_kept():
    stops, bias = ["x"], {1: 1.0}
    p = SamplingParams(stop=stops, logit_bias=bias)
    stops.append("y")
    bias[2] = 2.0
    assert p.stop == ("x",) and p.logit_bias == {1: 1.0}


def test_greedy_turns_filters_off():
    p = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, 0, 0.0)


def test_tiny_temperature_is_raised_like_vllm(caplog):
    assert SamplingParams(temperature=1e-4).temperature == 0.01
    assert "below" in caplog.text


def test_check_against_engine_facts():
    SamplingParams(logprobs=20, prompt_logprobs=0).check_against(vocab_size=100)
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, max_logprobs=20\]"):
        SamplingParams(logprobs=21).check_against(vocab_size=100)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, max_logprobs=5\]"):
        SamplingParams(prompt_logprobs=6).check_against(vocab_size=100, max_logprobs=5)
    with pytest.raises(ValueError, match=r"logprobs must be"):
        SamplingParams(logprobs=-1).check_against(vocab_size=100)
    SamplingParams(logprobs=-1).check_against(vocab_size=100, max_logprobs=-1)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).check_against(vocab_size=100)
    with pytest.raises(ValueError, match=r"stop_token_ids token ids must be in \[0, 100\)"):
        SamplingParams(stop_token_ids=[150]).check_against(vocab_size=100)


def test_max_output_tokens():
    assert SamplingParams(max_tokens=None).max_output_tokens(10, 64) == 54
    assert SamplingParams(max_tokens=8).max_output_tokens(10, 64) == 8
    assert SamplingParams(max_tokens=80).max_output_tokens(10, 64) == 54


def test_for_sequence_gives_each_child_its_seed():
    p = SamplingParams(n=3, seed=10, top_p=0.5)
    kids = [p.for_sequence(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12]
    assert all(k.n == 1 and k.top_p == 0.5 for k in kids)
    assert p.n == 3 and p.seed == 10  # the parent is untouched
    assert SamplingParams(n=2).for_sequence(1).seed is None
    one = SamplingParams(seed=4)
    assert one.for_sequence(0) is one
    with pytest.raises(ValueError, match=r"index must be in \[0, n=3\)"):
        p.for_sequence(3)


def test_vocabulary_limits_are_normalised_and_checked_against_the_vocabulary():
    p = SamplingParams(allowed_token_ids=[5, 3, 5], bad_words="hello",
                       bad_words_token_ids=[[1, 2], [1, 2], [4]])
    assert p.allowed_token_ids == (5, 3)
    assert p.bad_words == ("hello",)
    assert p.bad_words_token_ids == ((1, 2), (4,))
    p.check_against(vocab_size=6)
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids must be in \[0, 5\)"):
        p.check_against(vocab_size=5)
    q = SamplingParams(bad_words_token_ids=[[1, 9]])
    with pytest.raises(ValueError, match=r"bad_words_token_ids token ids must be in"):
        q.check_against(vocab_size=9)


def test_logits_processors_take_two_or_three_arguments():
    from quire.sampling_params import logits_processor_arity

    assert logits_processor_arity(lambda out, logits: logits) == 2
    assert logits_processor_arity(lambda prompt, out, logits, scale=1.0: logits) == 3
    def one(out, logits):
        return logits

    assert SamplingParams(logits_processors=one).logits_processors == (one,)
