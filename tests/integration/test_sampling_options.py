"""``allowed_token_ids``, ``bad_words`` and per-request ``logits_processors`` on a tiny
Llama and Qwen3, against transformers' own logits processors on its float32 logits.

The oracle runs transformers' ``PrefixConstrainedLogitsProcessor`` (allowed tokens),
``NoBadWordsLogitsProcessor`` (bad words) or the same user callable (logits processors)
on the model's logits at every step and takes the argmax, recomputing the whole sequence
each step. Bad words are checked against the output only (vLLM's rule) and transformers'
processor reads the prompt too, so the multi-token words here never start with the
prompt's last token.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from quire import LLM, SamplingParams
from tiny_models import hf_model

ARCHS = ("llama", "qwen3")
MAX_TOKENS = 12
TEXTS = ["The capital of France is", "Once upon a time there was a quiet village"]


@torch.inference_mode()
def hf_greedy_with(model, prompt: list[int], max_new_tokens: int, processor) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        scores = model(torch.tensor([ids])).logits[:, -1].float()
        scores = processor(torch.tensor([ids]), scores)
        ids.append(int(scores[0].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    cache = {}

    def get(arch):
        if arch not in cache:
            from transformers import AutoTokenizer

            path = tiny_checkpoint(arch)
            tok = AutoTokenizer.from_pretrained(path)
            llm = LLM(str(path), device="cpu", dtype="float32")
            cache[arch] = path, tok, hf_model(path), llm, [tok.encode(t) for t in TEXTS]
        return cache[arch]

    return get


def _ours(llm: LLM, prompts: list[list[int]], **options) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_allowed_token_ids_match_transformers(arch, setup):
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

    _, _, model, llm, prompts = setup(arch)
    free = _ours(llm, prompts)
    # the tokens it would choose anyway are left out, so the limit must change the output
    vocab = model.config.vocab_size
    allowed = sorted(set(range(3, vocab, 7)) - {t for out in free for t in out[:4]})
    processor = PrefixConstrainedLogitsProcessor(lambda _b, _ids: allowed, num_beams=1)
    ours = _ours(llm, prompts, allowed_token_ids=allowed)
    assert ours == [hf_greedy_with(model, p, MAX_TOKENS, processor) for p in prompts]
    assert all(set(out) <= set(allowed) for out in ours)
    assert ours != free


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_words_match_transformers(arch, setup):
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    _, _, model, llm, prompts = setup(arch)
    free = _ours(llm, prompts)
    # a one-token word the model chose, and a two-token word it made (whose first token
    # is not a prompt's last token: transformers would match across the boundary)
    words = [[free[0][1]]]
    last_tokens = {p[-1] for p in prompts}
    for out in free:
        for a, b in itertools.pairwise(out):
            if a not in last_tokens and [a, b] not in words and a != free[0][1]:
                words.append([a, b])
                break
    assert len(words) >= 2
    processor = NoBadWordsLogitsProcessor(words, eos_token_id=None)
    ours = _ours(llm, prompts, bad_words_token_ids=words)
    assert ours == [hf_greedy_with(model, p, MAX_TOKENS, processor) for p in prompts]
    assert ours != free


def _contains(out: list[int], ids: list[int]) -> bool:
    return any(out[i:i + len(ids)] == ids for i in range(len(out) - len(ids) + 1))


def _word_in(outs: list[list[int]], tok) -> str | None:
    """A word of the outputs' text whose spelling (with or without a space) is a run of
    the output's tokens, so that banning it must change the output."""
    for out in outs:
        for word in tok.decode(out).split():
            for spelled in (word, " " + word):
                if _contains(out, tok.encode(spelled, add_special_tokens=False)):
                    return word
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_words_as_text(arch, setup):
    """A word given as text is banned as the tokenizer spells it, mid-text too."""
    _, tok, _, llm, prompts = setup(arch)
    free = _ours(llm, prompts)
    word = _word_in(free, tok)
    if word is None:
        pytest.skip("no word of the output is spelled by its own tokens")
    ours = _ours(llm, prompts, bad_words=[word])
    spelled = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    for out in ours:
        for ids in spelled:
            assert not _contains(out, ids), (word, out)
    assert ours != free


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_processors_match_transformers(arch, setup):
    from transformers import LogitsProcessorList

    _, _, model, llm, prompts = setup(arch)
    vocab = model.config.vocab_size
    seen: list[tuple[int, int]] = []

    def push_down(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        # each token already output is pushed down by its count; the next even id up
        logits = logits.clone()
        for t in output_ids:
            logits[t] -= 5.0
        logits[(len(output_ids) * 2) % vocab] += 3.0
        return logits

    def with_prompt(prompt_ids: list[int], output_ids: list[int],
                    logits: torch.Tensor) -> torch.Tensor:
        seen.append((len(prompt_ids), len(output_ids)))
        logits[prompt_ids[0]] += 1.0
        return logits

    class Both:
        def __init__(self, prompt_len: int):
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            ids = input_ids[0].tolist()
            prompt, out = ids[:self.prompt_len], ids[self.prompt_len:]
            row = with_prompt(prompt, out, push_down(out, scores[0]))
            return row.unsqueeze(0)

    expected = [hf_greedy_with(model, p, MAX_TOKENS, LogitsProcessorList([Both(len(p))]))
                for p in prompts]
    seen.clear()
    ours = _ours(llm, prompts, logits_processors=[push_down, with_prompt])
    assert ours == expected
    assert ours != _ours(llm, prompts)
    # every step of every prompt called it, with the prompt and the output so far
    assert sorted(seen) == sorted((len(p), i) for p in prompts for i in range(MAX_TOKENS))


def test_logprobs_stay_raw_under_processors(setup):
    _, _, _, llm, prompts = setup("llama")
    params = {"temperature": 0, "max_tokens": 3, "ignore_eos": True, "logprobs": 2}
    free = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(**params))
    allowed = list(range(50, 60))
    limited = llm.generate([{"prompt_token_ids": prompts[0]}],
                           SamplingParams(allowed_token_ids=allowed, **params))
    first_free = free[0].outputs[0].logprobs[0]
    first_limited = limited[0].outputs[0].logprobs[0]
    chosen = limited[0].outputs[0].token_ids[0]
    assert chosen in allowed
    # the top alternatives are the model's own, not the limited distribution's
    top = sorted(first_free.items(), key=lambda kv: -kv[1].logprob)[:2]
    for token, entry in top:
        assert first_limited[token].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_processor_errors_name_the_field(setup):
    _, _, _, llm, prompts = setup("llama")
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda logits: logits])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([{"prompt_token_ids": prompts[0]}],
                     SamplingParams(allowed_token_ids=[10**7]))
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        llm.generate([{"prompt_token_ids": prompts[0]}],
                     SamplingParams(bad_words_token_ids=[[1, 10**7]]))
