"""The sampler on small synthetic logits: distributions, penalties, masks, seeds, logprobs.

Statistical tests draw many tokens at once (a batch of identical rows) and compare the
empirical distribution with the exact filtered softmax, computed independently in float64.
The bound on the total-variation distance is
``sqrt((V ln 2 + ln(2 / delta)) / (2 n))`` with ``delta = 1e-6``: TV is the largest
|empirical - true| mass over the 2^V subsets of the vocabulary, Hoeffding bounds each
subset's deviation by ``2 exp(-2 n eps^2)``, and a union bound over the subsets gives a
false-failure chance of at most ``delta`` for a correct sampler (the seeds are fixed, so
in practice the result is simply reproducible). For V = 12 that is 0.024 at n = 20000 and
0.038 at n = 8000 -- far below the mass a wrong filter moves in these cases (>= 0.05).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from quire.engine.sequence import Sequence
from quire.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from quire.sampling.penalties import PenaltyState
from quire.sampling_params import SamplingParams

V = 12
EOS = frozenset({0})
# Distinct values in scrambled order, so that every filter has to sort.
BASE = torch.tensor([0.3, 2.0, -1.0, 1.2, 0.0, 1.5, -3.0, 0.8, -0.5, 1.0, -2.0, 0.5])


def tv_bound(n: int, vocab: int = V, delta: float = 1e-6) -> float:
    return math.sqrt((vocab * math.log(2) + math.log(2 / delta)) / (2 * n))


_seq_ids = itertools.count()


def make_seq(params: SamplingParams, prompt: list[int] | None = None,
             output: list[int] | None = None) -> Sequence:
    i = next(_seq_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=prompt or [1, 2],
                    params=params, output_token_ids=list(output or []))


def reference_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The exact distribution, in vLLM v1's order: temperature, min-p, top-k, top-p."""
    scaled = logits.double() / temperature
    probs = scaled.softmax(-1)
    keep = probs >= min_p * probs.max()
    if top_k:
        keep &= scaled >= scaled.sort(descending=True).values[top_k - 1]
    if top_p < 1.0:
        renorm = torch.where(keep, probs, 0.0)
        renorm /= renorm.sum()
        mass = 0.0
        for t in renorm.argsort(descending=True).tolist():
            if keep[t]:
                keep[t] = mass < top_p
                mass += renorm[t].item()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def empirical(tokens: list[int], vocab: int = V) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def check_distribution(tokens: list[int], expected: torch.Tensor) -> None:
    got = empirical(tokens, expected.numel())
    assert got[expected == 0].sum() == 0, "a filtered-out token was drawn"
    tv = 0.5 * (got - expected).abs().sum().item()
    assert tv < tv_bound(len(tokens), expected.numel()), (tv, got, expected)


CASES = {
    "temperature 0.5": dict(temperature=0.5),
    "temperature 1.7": dict(temperature=1.7),
    "top_k 3": dict(top_k=3),
    "top_p 0.6": dict(top_p=0.6),
    "min_p 0.3": dict(min_p=0.3),
    "all four": dict(temperature=1.5, min_p=0.1, top_k=6, top_p=0.7),
    "top_k and top_p": dict(temperature=0.8, top_k=4, top_p=0.9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_samples_the_filtered_softmax(case):
    kwargs = CASES[case]
    n = 20000
    params = SamplingParams(**kwargs)
    seqs = [make_seq(params) for _ in range(n)]
    out = Sampler(EOS, V, seed=1).sample(BASE.repeat(n, 1), seqs)
    check_distribution(out.token_ids, reference_probs(BASE, **kwargs))


def test_each_row_uses_its_own_parameters():
    """All cases interleaved in one batch, plus greedy rows, row i in group i % groups."""
    groups = [SamplingParams(**kw) for kw in CASES.values()] + [SamplingParams(temperature=0)]
    per_group = 8000
    seqs = [make_seq(groups[i % len(groups)]) for i in range(per_group * len(groups))]
    logits = BASE.repeat(len(seqs), 1)
    tokens = Sampler(EOS, V, seed=2).sample(logits, seqs).token_ids
    for g, kwargs in enumerate(CASES.values()):
        check_distribution(tokens[g::len(groups)], reference_probs(BASE, **kwargs))
    assert set(tokens[len(groups) - 1::len(groups)]) == {int(BASE.argmax())}


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    seqs = [make_seq(SamplingParams(top_k=2)) for _ in range(4000)]
    tokens = Sampler(EOS, 8, seed=0).sample(logits.repeat(4000, 1), seqs).token_ids
    assert set(tokens) == {0, 1, 2}


def test_top_p_always_keeps_the_most_likely_token():
    seqs = [make_seq(SamplingParams(top_p=0.01)) for _ in range(500)]
    tokens = Sampler(EOS, V, seed=0).sample(BASE.repeat(500, 1), seqs).token_ids
    assert set(tokens) == {int(BASE.argmax())}


# -- penalties, bias, min_tokens ---------------------------------------------------------
def reference_adjusted(logits: torch.Tensor, seq: Sequence, eos=EOS) -> torch.Tensor:
    """Bias, min_tokens mask and penalties for one row, written out per token."""
    p = seq.params
    out = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    if len(seq.output_token_ids) < p.min_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            out[t] = -math.inf
    counts = Counter(seq.output_token_ids)
    for t in range(out.numel()):
        if t in seq.prompt_token_ids or counts[t]:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return out


def random_params(rng: torch.Generator, greedy: bool) -> SamplingParams:
    def pick(values):
        return values[int(torch.randint(len(values), (1,), generator=rng))]
    bias = {int(torch.randint(V, (1,), generator=rng)): pick([-5.0, 3.0])} \
        if pick([True, False]) else None
    return SamplingParams(temperature=0.0 if greedy else pick([0.7, 1.0]),
                          repetition_penalty=pick([1.0, 1.3, 0.8]),
                          presence_penalty=pick([0.0, 1.5, -0.5]),
                          frequency_penalty=pick([0.0, 0.7, 2.0]),
                          logit_bias=bias, seed=pick([None, 5]))


def random_tokens(rng: torch.Generator, n: int) -> list[int]:
    return torch.randint(V, (n,), generator=rng).tolist()


def test_penalty_state_matches_the_reference():
    rng = torch.Generator().manual_seed(0)
    seqs = [make_seq(random_params(rng, greedy=True), random_tokens(rng, 5),
                     random_tokens(rng, 7)) for _ in range(16)]
    seqs.append(make_seq(SamplingParams(repetition_penalty=1.5), [3, 3, 4], []))
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
            or s.params.presence_penalty or s.params.frequency_penalty]
    logits = torch.randn(len(seqs), V, generator=rng) * 3
    state = PenaltyState(seqs, rows, V, torch.device("cpu"))
    state.update()
    got = logits.clone()
    state.apply(got)
    for i, seq in enumerate(seqs):
        no_bias = make_seq(SamplingParams(
            repetition_penalty=seq.params.repetition_penalty,
            presence_penalty=seq.params.presence_penalty,
            frequency_penalty=seq.params.frequency_penalty),
            seq.prompt_token_ids, seq.output_token_ids)
        # float32 against float64: equal to float32 rounding.
        torch.testing.assert_close(got[i], reference_adjusted(logits[i], no_bias).float(),
                                   atol=1e-5, rtol=1e-5)


def _assert_greedy_choice(chosen: int, reference: torch.Tensor) -> None:
    # Equal to the reference argmax up to float32 rounding of near-ties.
    assert reference[chosen] >= reference.max() - 1e-5, (chosen, reference)


def test_greedy_with_bias_and_penalties_over_steps_and_batch_changes():
    """Greedy rows pick the argmax of the reference-adjusted logits at every step, while
    tokens are appended and sequences leave and join (counts carried over, not rebuilt)."""
    rng = torch.Generator().manual_seed(1)
    sampler = Sampler(EOS, V, seed=0)

    def new_seq(greedy: bool) -> Sequence:
        return make_seq(random_params(rng, greedy), random_tokens(rng, 6),
                        random_tokens(rng, int(torch.randint(4, (1,), generator=rng))))

    batch = [new_seq(greedy=i % 3 != 0) for i in range(12)]
    for step in range(8):
        if step in (3, 6):  # one leaves, two join, order shuffled
            batch = batch[1:] + [new_seq(True), new_seq(False)]
            batch = [batch[i] for i in torch.randperm(len(batch), generator=rng).tolist()]
        logits = torch.randn(len(batch), V, generator=rng) * 2
        refs = [reference_adjusted(logits[i], s) for i, s in enumerate(batch)]
        out = sampler.sample(logits.clone(), batch)
        for seq, ref, token in zip(batch, refs, out.token_ids):
            if seq.params.temperature == 0:
                _assert_greedy_choice(token, ref)
            seq.output_token_ids.append(token)


def test_logit_bias_can_force_and_forbid():
    logits = BASE.repeat(3, 1)
    seqs = [make_seq(SamplingParams(temperature=0, logit_bias={6: 100.0})),
            make_seq(SamplingParams(logit_bias={t: -100.0 for t in range(V) if t != 4})),
            make_seq(SamplingParams(temperature=0, logit_bias={1: -100.0}))]
    assert Sampler(EOS, V).sample(logits, seqs).token_ids == [6, 4, 5]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(V)
    logits[:3] = torch.tensor([9.0, 8.0, 7.0])  # EOS 0 and 1, stop id 2, most likely
    eos = frozenset({0, 1})
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2], ignore_eos=True),
              SamplingParams(temperature=0, stop_token_ids=[2])]
    seqs = [make_seq(p) for p in params]
    sampler = Sampler(eos, V)
    steps = []
    for _ in range(4):
        tokens = sampler.sample(logits.repeat(3, 1), seqs).token_ids
        steps.append(tokens)
        for s, t in zip(seqs, tokens):
            s.output_token_ids.append(t)
    assert all(t[0] not in (0, 1, 2) and t[1] not in (0, 1, 2) for t in steps[:3])
    assert steps[3][:2] == [0, 0]
    assert [t[2] for t in steps] == [0, 0, 0, 0]


def test_min_tokens_masks_random_rows_too():
    logits = torch.zeros(V)
    logits[0] = 3.0
    short = [make_seq(SamplingParams(min_tokens=2, stop_token_ids=[5])) for _ in range(2000)]
    done = [make_seq(SamplingParams(min_tokens=2), output=[3, 3]) for _ in range(2000)]
    tokens = Sampler(EOS, V, seed=3).sample(logits.repeat(4000, 1), short + done).token_ids
    assert not {0, 5} & set(tokens[:2000])
    assert 0 in tokens[2000:]


# -- seeds -------------------------------------------------------------------------------
def _seeded_run(target_params: SamplingParams, n_others: int, engine_seed: int,
                steps: int = 6) -> list[int]:
    sampler = Sampler(EOS, V, seed=engine_seed)
    target = make_seq(target_params, [4, 5, 6])
    other_rng = torch.Generator().manual_seed(engine_seed)
    kinds = [dict(temperature=0), dict(top_k=2, seed=99), dict(top_p=0.5),
             dict(min_p=0.2, logprobs=2), dict(repetition_penalty=1.4, seed=7),
             dict(temperature=1.3, frequency_penalty=1.0, min_tokens=3)]
    others = [make_seq(SamplingParams(**kinds[i % len(kinds)])) for i in range(n_others)]
    target_rng = torch.Generator().manual_seed(1234)
    for step in range(steps):
        if step == 3 and others:
            others = others[2:]  # the batch changes mid-way
        batch = others[: len(others) // 2] + [target] + others[len(others) // 2:]
        logits = torch.randn(len(batch), V, generator=other_rng)
        logits[len(others) // 2] = torch.randn(V, generator=target_rng)
        out = sampler.sample(logits, batch)
        for seq, token in zip(batch, out.token_ids):
            seq.output_token_ids.append(token)
    return target.output_token_ids


def test_seeded_row_is_the_same_alone_and_in_any_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, seed=7)
    alone = _seeded_run(params, 0, engine_seed=0)
    assert _seeded_run(params, 16, engine_seed=0) == alone
    assert _seeded_run(params, 16, engine_seed=5) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, seed=8)
    assert _seeded_run(other_seed, 0, engine_seed=0) != alone


def test_sequence_i_of_a_request_samples_like_seed_plus_i():
    parent = SamplingParams(n=3, seed=40, temperature=1.0)
    children = [_seeded_run(parent.for_sequence(i), 4, engine_seed=i) for i in range(3)]
    assert children[1] == _seeded_run(SamplingParams(seed=41), 0, engine_seed=9)
    assert len({tuple(c) for c in children}) == 3


def test_unseeded_rows_follow_the_engine_seed():
    def draw(seed: int) -> list[int]:
        seqs = [make_seq(SamplingParams()) for _ in range(64)]
        return Sampler(EOS, V, seed=seed).sample(torch.zeros(64, V), seqs).token_ids

    assert draw(11) == draw(11)
    assert draw(12) != draw(11)


def test_release_drops_the_generator():
    sampler = Sampler(EOS, V)
    seqs = [make_seq(SamplingParams(seed=s)) for s in (1, 2)] + [make_seq(SamplingParams())]
    sampler.sample(torch.zeros(3, V), seqs)
    assert sampler.num_seq_generators() == 2
    sampler.release(seqs[0].seq_id)
    sampler.release(seqs[2].seq_id)  # unseeded: nothing to drop, no error
    sampler.release(10**9)
    assert sampler.num_seq_generators() == 1


# -- logprobs ----------------------------------------------------------------------------
def test_logprobs_are_of_the_raw_logits():
    rng = torch.Generator().manual_seed(4)
    logits = torch.randn(5, V, generator=rng) * 2
    seqs = [make_seq(SamplingParams(logprobs=3, temperature=0.5, logit_bias={2: 50.0},
                                    repetition_penalty=2.0), output=[1, 1]),
            make_seq(SamplingParams(logprobs=0, temperature=0)),
            make_seq(SamplingParams()),
            make_seq(SamplingParams(logprobs=-1, top_k=2, seed=3)),
            make_seq(SamplingParams(logprobs=V + 5, temperature=0))]
    out = Sampler(EOS, V).sample(logits.clone(), seqs)
    assert isinstance(out, SamplerOutput) and len(out.logprobs) == 5
    assert out.logprobs[2] is None
    assert out.token_ids[0] == 2  # the bias decided the token, not the logprobs
    raw = torch.log_softmax(logits, dim=-1)
    for row, k in ((0, 3), (1, 0), (3, V), (4, V)):
        entry = out.logprobs[row]
        token = out.token_ids[row]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert entry.rank == int((raw[row] >= raw[row, token]).sum())
        values, ids = raw[row].sort(descending=True)
        assert [t for t, _ in entry.top] == ids[:k].tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values[:k].tolist(), abs=1e-6)
    assert out.logprobs[1].rank == 1  # greedy on unadjusted logits: the top token


def test_prompt_logprobs_helper():
    rng = torch.Generator().manual_seed(5)
    logits = torch.randn(7, V, generator=rng)
    targets = torch.randint(V, (7,), generator=rng)
    entries = compute_prompt_logprobs(logits, targets, k=2)
    raw = torch.log_softmax(logits, dim=-1)
    for i, e in enumerate(entries):
        assert e.token_id == targets[i].item()
        assert e.logprob == pytest.approx(raw[i, e.token_id].item(), abs=1e-6)
        assert e.rank == int((raw[i] >= raw[i, e.token_id]).sum())
        assert [t for t, _ in e.top] == raw[i].topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits, targets, k=2, chunk_rows=3) == entries
    assert all(len(e.top) == V for e in compute_prompt_logprobs(logits, targets, k=-1))
    with pytest.raises(ValueError, match="target_ids"):
        compute_prompt_logprobs(logits, targets[:3], k=1)


def test_shapes_are_checked():
    sampler = Sampler(EOS, V)
    with pytest.raises(ValueError, match=r"logits must be \[2, 12\]"):
        sampler.sample(torch.zeros(3, V), [make_seq(SamplingParams()) for _ in range(2)])
    with pytest.raises(ValueError, match=r"logits must be \[1, 12\]"):
        sampler.sample(torch.zeros(1, V + 1), [make_seq(SamplingParams())])
    assert sampler.sample(torch.zeros(0, V), []).token_ids == []
    with pytest.raises(ValueError, match="logit_bias token id 20"):
        sampler.sample(torch.zeros(1, V), [make_seq(SamplingParams(logit_bias={20: 1.0}))])


# -- allowed tokens, bad words, logits processors ---------------------------------------
def test_allowed_token_ids_limit_greedy_and_random_rows():
    allowed = [2, 4, 7, 9]
    greedy = make_seq(SamplingParams(temperature=0, allowed_token_ids=allowed))
    free = make_seq(SamplingParams(temperature=0))
    assert Sampler(EOS, V).sample(BASE.repeat(2, 1), [greedy, free]).token_ids == [9, 1]
    n = 8000
    seqs = [make_seq(SamplingParams(temperature=0.9, allowed_token_ids=allowed))
            for _ in range(n)]
    tokens = Sampler(EOS, V, seed=5).sample(BASE.repeat(n, 1), seqs).token_ids
    expected = torch.zeros(V, dtype=torch.float64)
    expected[allowed] = (BASE[allowed].double() / 0.9).softmax(-1)
    check_distribution(tokens, expected)


def test_bad_words_ban_the_last_token_only_after_the_rest():
    # BASE's argmax is 1, then 5, then 3
    one = make_seq(SamplingParams(temperature=0, bad_words_token_ids=[[1]]))
    after_6 = make_seq(SamplingParams(temperature=0, bad_words_token_ids=[[6, 1]]),
                       output=[6])
    after_7 = make_seq(SamplingParams(temperature=0, bad_words_token_ids=[[6, 1]]),
                       output=[7])
    three = make_seq(SamplingParams(temperature=0, bad_words_token_ids=[[4, 6, 1], [6, 5]]),
                     output=[4, 6])
    longer = make_seq(SamplingParams(temperature=0, bad_words_token_ids=[[8, 8, 1]]),
                      output=[8])  # the word's prefix is longer than the output: no ban
    seqs = [one, after_6, after_7, three, longer]
    tokens = Sampler(EOS, V).sample(BASE.repeat(len(seqs), 1), seqs).token_ids
    assert tokens == [5, 5, 1, 3, 1]


def test_logits_processors_see_the_row_s_tokens_and_logprobs_stay_raw():
    calls = []

    def two(out, logits):
        calls.append(("two", list(out)))
        return logits - 100.0 * (torch.arange(V) == 1)  # a new tensor, not in place

    def three(prompt, out, logits):
        calls.append(("three", list(prompt), list(out)))
        logits[0] = 50.0
        logits[0] -= 51.0  # ends below the next best, 5 after `two`
        return logits

    seq = make_seq(SamplingParams(temperature=0, logprobs=1, logits_processors=[two, three]),
                   prompt=[3, 4], output=[8])
    plain = make_seq(SamplingParams(temperature=0))
    out = Sampler(EOS, V).sample(BASE.repeat(2, 1), [seq, plain])
    assert out.token_ids == [5, 1]
    assert calls == [("two", [8]), ("three", [3, 4], [8])]
    raw = BASE.log_softmax(-1)
    assert out.logprobs[0].logprob == pytest.approx(float(raw[5]), abs=1e-6)


def test_a_processor_returning_a_wrong_shape_names_itself():
    def broken(out, logits):
        return logits[:3]

    seq = make_seq(SamplingParams(temperature=0, logits_processors=[broken]))
    with pytest.raises(ValueError, match="must return a tensor of shape"):
        Sampler(EOS, V).sample(BASE.repeat(1, 1), [seq])
