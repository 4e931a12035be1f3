"""Speculative decoding with a draft model (``speculative_config.model``): greedy output
equals greedy output without it for every family of tiny model, drafted by itself and
across families; emitted tokens follow the target's distribution at temperature 1 with
top-k and top-p, under a draft that is often rejected; the acceptance counters match a
case counted by hand; a draft at another dtype or weight format; SmolLM2 drafted by
itself and by a tiny random draft with its vocabulary (slow)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from draft_variant import perturbed_copy
from quire import LLM, SamplingParams
from tiny_models import ARCHS, hf_model

PROMPTS = [[5, 17, 42, 9, 77, 3, 101, 64, 8, 5, 17, 42, 9], [12, 7, 7, 12, 7, 7, 12, 7],
           [99, 98, 97, 96, 95, 94], list(range(30, 51)) * 2]


def _greedy(path, spec, prompts=PROMPTS, max_tokens=16, **options):
    """Each prompt's greedy tokens, and the engine's stats; checks that nothing leaked."""
    with LLM(str(path), device="cpu", block_size=4, speculative_config=spec,
             **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True))
        core = llm.engine.core
        assert core.block_manager.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs], core.stats()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_drafted_by_itself_and_by_another_keeps_greedy_output(
        arch, tiny_checkpoint):
    """Drafted by itself every proposal is accepted; drafted by the tiny llama (another
    family, the same vocabulary) few are: the outputs are the target's either way."""
    path = tiny_checkpoint(arch)
    plain, _ = _greedy(path, None)
    itself, stats = _greedy(path, {"model": str(path), "num_speculative_tokens": 3})
    assert itself == plain
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    other = tiny_checkpoint("qwen2" if arch == "llama" else "llama")
    crossed, stats = _greedy(path, {"model": str(other), "num_speculative_tokens": 2})
    assert crossed == plain
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens


def test_a_draft_catches_up_on_what_it_sat_out(tiny_checkpoint):
    """A model drafting for itself has every proposal accepted only if its K/V is right
    at every position. Here a long request (n = 2: its forked sample shares the parent's
    pages, computed without the draft) drafts alone, then sits out the steps where 3 or
    more sequences run (``disable_by_batch_size``) while shorter requests come and go,
    then drafts again after catching up, in forwards cut to an 8-token budget; a second
    pass takes its prompt from the prefix cache, also computed without the draft. Still
    every proposal is accepted, and the outputs are the target's."""
    path = tiny_checkpoint("llama")
    spec = {"model": str(path), "num_speculative_tokens": 3, "disable_by_batch_size": 3}
    # top-k 1: deterministic, as greedy (which n = 2 may not be)
    long = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=48, ignore_eos=True)
    short = SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True)
    runs, stats = {}, None
    for name, config in (("plain", None), ("spec", spec)):
        with LLM(str(path), device="cpu", block_size=4, max_num_batched_tokens=8,
                 enable_prefix_caching=True, speculative_config=config) as llm:
            runs[name] = [_in_waves(llm.engine, long, short) for _ in range(2)]
            stats = llm.engine.core.stats()
    assert runs["spec"] == runs["plain"]
    assert stats.prefix_hits > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


def _in_waves(engine, long: SamplingParams, short: SamplingParams) -> list:
    """A long request alone for 6 steps, then three short ones beside it; every
    request's samples, in the order added."""
    done: dict[str, list] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]

    ids = [engine.add_request(PROMPTS[1], long)]
    for _ in range(6):
        step()
    ids += [engine.add_request(p, short) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3])]
    while engine.has_unfinished_requests():
        step()
    return [done[i] for i in ids]


def test_acceptance_counts_match_a_case_counted_by_hand(tiny_checkpoint):
    """One sequence, 11 tokens, k=3, drafted by itself (every draft accepted): the
    prefill gives token 1; verifications then give 4 (3 drafts + 1), 4, and 2 (one
    draft: room for only two more tokens). So 3 verifications, 7 drafts, all accepted,
    3/2/2 at positions 0/1/2."""
    path = tiny_checkpoint("llama")
    _, stats = _greedy(path, {"model": str(path), "num_speculative_tokens": 3},
                       prompts=PROMPTS[:1], max_tokens=11)
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens) == (3, 7, 7)
    assert stats.spec_accepted_per_pos == [3, 2, 2]


@pytest.mark.parametrize("draft", [{"dtype": "bfloat16"}, {"quantization": "int8"}],
                         ids=["bfloat16", "int8"])
def test_a_draft_at_another_dtype_or_weight_format_keeps_greedy_output(draft,
                                                                       tiny_checkpoint):
    path = tiny_checkpoint("llama")
    plain, _ = _greedy(path, None)
    got, stats = _greedy(path, {"model": str(path), "num_speculative_tokens": 3, **draft})
    assert got == plain
    assert stats.spec_num_accepted_tokens > 0


def _filtered(logits: torch.Tensor, temperature: float, top_k: int,
              top_p: float) -> torch.Tensor:
    """The sampler's distribution: temperature, then top-k, then top-p (a token stays
    while the mass before it is under ``top_p``), in float64."""
    x = logits.double() / temperature
    ordered, index = x.sort(descending=True)
    ordered[top_k:] = -math.inf
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs
    probs = torch.where(before < top_p, probs, 0.0)
    out = torch.zeros_like(probs)
    out[index] = probs / probs.sum()
    return out


def test_emitted_tokens_follow_the_target_distribution_under_a_rejected_draft(
        tiny_checkpoint, tmp_path):
    """4000 samples of 4 tokens at temperature 1 with top-k 3 and top-p 0.9; the draft (a
    noisy copy) proposes tokens 2 and 3 together, and is often rejected. The joint
    frequency of tokens 1..3 is within the multinomial bound (total variation, failure
    probability 1e-6) of the exact joint distribution transformers' logits give, and
    nothing outside its support is emitted."""
    path = tiny_checkpoint("llama")
    draft = perturbed_copy(path, tmp_path, scale=0.01)
    prompt = [5, 17, 42, 9, 77, 3]
    temperature, top_k, top_p, n = 1.0, 3, 0.9, 4000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            max_tokens=4, ignore_eos=True)
    with LLM(str(path), device="cpu", block_size=4, max_num_seqs=256, seed=5,
             speculative_config={"model": draft, "num_speculative_tokens": 2,
                                 "disable_by_batch_size": None}) as llm:
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
        stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(out.outputs[0].token_ids[:3])
        counts[key] = counts.get(key, 0) + 1

    model = hf_model(path)
    want: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == 3:
            want[prefix] = mass
            return
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        probs = _filtered(logits, temperature, top_k, top_p)
        for token in torch.nonzero(probs).flatten().tolist():
            walk((*prefix, token), mass * probs[token].item())

    walk((), 1.0)
    assert set(counts) <= set(want), "a token outside the filtered distribution"
    tv = 0.5 * sum(abs(counts.get(key, 0) / n - p) for key, p in want.items())
    cells = len(want)
    bound = math.sqrt((cells * math.log(2) + math.log(2 / 1e-6)) / (2 * n))
    assert tv < bound, (tv, bound, cells)


def test_a_draft_with_another_vocabulary_is_refused_naming_the_field(tiny_checkpoint,
                                                                    tmp_path):
    path = tiny_checkpoint("llama")
    bigger = tmp_path / "bigger"
    shutil.copytree(path, bigger)
    config = json.loads((bigger / "config.json").read_text())
    config["vocab_size"] += 64
    (bigger / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"speculative_config\.model .* vocabulary of 448 "
                                         r"tokens, the target's has 384"):
        LLM(str(path), device="cpu", speculative_config={"model": str(bigger),
                                                         "num_speculative_tokens": 2})
    renamed = tmp_path / "renamed"
    shutil.copytree(path, renamed)
    tokenizer = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (renamed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"speculative_config\.model .* another tokenizer"):
        LLM(str(path), device="cpu", speculative_config={"model": str(renamed),
                                                         "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model '/no/such/draft'"):
        LLM(str(path), device="cpu", speculative_config={"model": "/no/such/draft",
                                                         "num_speculative_tokens": 2})


@pytest.mark.slow  # about a minute: SmolLM2 four times
def test_smollm2_drafted_by_itself_and_by_a_tiny_random_draft(smollm2_gguf, tmp_path):
    """SmolLM2 (Q4_1) drafted by itself accepts nearly every proposal; a tiny random
    llama with SmolLM2's vocabulary and tokenizer almost none: greedy output is
    SmolLM2's either way."""
    from quire.models.gguf_hf_cache import hf_dir_for_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer_dir = hf_dir_for_gguf(str(smollm2_gguf))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True,
                                             return_dict=False)
               for text in ("Repeat exactly: the quick brown fox jumps over the lazy dog.",
                            "List the numbers from one to twelve, in words.",
                            "What is the capital of France?")]
    torch.manual_seed(0)
    tiny = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=tokenizer_config_vocab(tokenizer_dir), hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True))
    tiny.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    # float32 products throughout: with bfloat16 activations (activations=auto on AMX
    # hosts) a verify step's rows round where a one-row decode's do not, so equal greedy
    # output would hold only up to near-ties
    options = {"max_model_len": 512, "prompts": prompts, "max_tokens": 48,
               "platform_options": {"activations": "dtype"}}
    plain, _ = _greedy(smollm2_gguf, None, **options)
    itself, stats = _greedy(smollm2_gguf, {"model": str(smollm2_gguf),
                                           "num_speculative_tokens": 4}, **options)
    assert itself == plain
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0
    random_draft, stats = _greedy(smollm2_gguf, {"model": str(tmp_path / "tiny"),
                                                 "num_speculative_tokens": 2}, **options)
    assert random_draft == plain
    assert stats.spec_num_draft_tokens > 0


def tokenizer_config_vocab(directory) -> int:
    """The vocabulary size a converted GGUF's config states."""
    return json.loads((directory / "config.json").read_text())["vocab_size"]
