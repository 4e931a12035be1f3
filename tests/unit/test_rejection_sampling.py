"""quire.sampling.rejection.verify: speculative decoding's acceptance rule.

- greedy rows: the exact tokens and counts of the argmax rule, ties to the lowest index;
- exactness: over many sequences in one batched call, the emitted tokens follow the
  target p whatever the drafter's q (with q given, and with one-hot q), and the number
  accepted follows sum(min(p, q)); counts are held to 5 binomial standard deviations
  per cell (a cell with p = 0 must stay empty);
- no drafts: exactly the sampler's ``argmax(p / noise)``;
- mixed batches: equal to a per-sequence loop, greedy rows blind to uniforms and noise;
- shape, dtype and id errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from quire.sampling.rejection import verify

SIGMAS = 5.0


def _rows(draft_token_ids: list[list[int]]) -> int:
    return sum(len(d) + 1 for d in draft_token_ids)


def _random_inputs(num_rows: int, vocab: int, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    uniforms = torch.rand(num_rows, generator=gen)
    noise = torch.empty(num_rows, vocab).exponential_(generator=gen).clamp_min_(1e-30)
    return uniforms, noise


def _distribution(vocab: int, gen: torch.Generator, zeros: int) -> torch.Tensor:
    """A random distribution over ``vocab`` tokens with ``zeros`` of them at 0."""
    weights = torch.rand(vocab, generator=gen) + 0.05
    weights[torch.randperm(vocab, generator=gen)[:zeros]] = 0.0
    return weights / weights.sum()


def _assert_binomial(counts: torch.Tensor, probs: torch.Tensor, trials: int) -> None:
    """Each count within SIGMAS binomial standard deviations of trials * prob."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = trials * probs
    sigma = (trials * probs * (1 - probs)).sqrt()
    assert torch.all((counts - expected).abs() <= SIGMAS * sigma + 1e-9), (
        f"counts {counts.tolist()} vs expected {expected.tolist()}")


def _sequence_layout(per_position: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[k + 1, V] rows, one per position, repeated for each of num_seqs sequences."""
    return per_position.repeat(num_seqs, 1)


# greedy


def _greedy_call(target: torch.Tensor, drafts: list[list[int]]
                 ) -> tuple[list[list[int]], list[int]]:
    rows, vocab = target.shape
    nan = torch.full((rows,), float("nan"))
    return verify(target, drafts, None, torch.ones(rows, dtype=torch.bool), nan,
                  torch.full((rows, vocab), float("nan")))


def test_greedy_accepts_up_to_the_first_mismatch() -> None:
    # argmax per position: 2, 0, 3, 1 (bonus)
    top = torch.tensor([2, 0, 3, 1])
    target = torch.nn.functional.one_hot(top, 5).float() * 0.6 + 0.1
    target /= target.sum(dim=-1, keepdim=True)
    cases = {
        (2, 0, 3): ([2, 0, 3, 1], 3),  # all accepted: the bonus row's argmax
        (2, 0, 4): ([2, 0, 3], 2),     # the last mismatches: its argmax replaces it
        (2, 4, 3): ([2, 0], 1),        # a later match after a mismatch is not used
        (1, 0, 3): ([2], 0),
    }
    for drafts, (tokens, accepted) in cases.items():
        got = _greedy_call(target, [list(drafts)])
        assert got == ([tokens], [accepted]), drafts


def test_greedy_ties_go_to_the_lowest_index() -> None:
    target = torch.tensor([[0.1, 0.4, 0.1, 0.4], [0.3, 0.3, 0.3, 0.1]])
    assert _greedy_call(target, [[3]]) == ([[1]], [0])
    assert _greedy_call(target, [[1]]) == ([[1, 0]], [1])


def test_greedy_without_drafts_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    target = torch.rand(50, 3000, generator=gen).softmax(dim=-1)
    tokens, accepted = _greedy_call(target, [[] for _ in range(50)])
    assert tokens == [[t] for t in target.argmax(dim=-1).tolist()]
    assert accepted == [0] * 50


# exactness of the random rule


def _sample_drafts(q: torch.Tensor, num_seqs: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [num_seqs, k]: draft j of every sequence drawn from q[j]."""
    return torch.stack([torch.multinomial(q_j, num_seqs, replacement=True, generator=gen)
                        for q_j in q], dim=1)


def _run_random(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
                gen: torch.Generator) -> tuple[list[list[int]], list[int]]:
    """verify for num_seqs sequences sharing the position rows p ([k + 1, V])."""
    num_seqs, vocab = drafts.shape[0], p.shape[1]
    target = _sequence_layout(p, num_seqs)
    draft_probs = None
    if q is not None:
        # bonus rows are never read: NaN there would show if they were
        q_rows = torch.cat((q, torch.full((1, vocab), float("nan"))))
        draft_probs = _sequence_layout(q_rows, num_seqs)
    uniforms, noise = _random_inputs(target.shape[0], vocab, gen)
    greedy = torch.zeros(target.shape[0], dtype=torch.bool)
    return verify(target, drafts.tolist(), draft_probs, greedy, uniforms, noise)


def _first_tokens(tokens: list[list[int]], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=vocab)


def _first_two_tokens(tokens: list[list[int]], p_next: torch.Tensor,
                      gen: torch.Generator) -> torch.Tensor:
    """[V, V] counts of the first two tokens. A sequence that emitted one token samples
    its second in a step without drafts (target rows do not depend on earlier tokens)."""
    vocab = p_next.shape[0]
    short = [i for i, t in enumerate(tokens) if len(t) == 1]
    target = p_next.repeat(len(short), 1)
    uniforms, noise = _random_inputs(len(short), vocab, gen)
    nxt, _ = verify(target, [[] for _ in short], None,
                    torch.zeros(len(short), dtype=torch.bool), uniforms, noise)
    second = [t[1] if len(t) > 1 else 0 for t in tokens]
    for i, t in zip(short, nxt):
        second[i] = t[0]
    pairs = torch.tensor([t[0] for t in tokens]) * vocab + torch.tensor(second)
    return torch.bincount(pairs, minlength=vocab * vocab).view(vocab, vocab)


def _acceptance_rates(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(accepted >= j) for j = 1..k: prod over positions of sum(min(p_i, q_i))."""
    return torch.minimum(p[: q.shape[0]], q).sum(dim=-1).double().cumprod(0)


def _assert_accept_counts(accepted: list[int], rates: torch.Tensor) -> None:
    counts = torch.tensor(accepted)
    at_least = torch.stack([(counts >= j).sum() for j in range(1, len(rates) + 1)])
    _assert_binomial(at_least, rates, len(accepted))


def test_one_draft_keeps_the_target_distribution() -> None:
    vocab, num_seqs = 5, 200_000
    gen = torch.Generator().manual_seed(1)
    p = torch.stack([_distribution(vocab, gen, zeros=1) for _ in range(2)])
    q = torch.stack([_distribution(vocab, gen, zeros=1)])
    drafts = _sample_drafts(q, num_seqs, gen)
    tokens, accepted = _run_random(p, q, drafts, gen)
    first = _first_tokens(tokens, vocab)
    _assert_binomial(first, p[0], num_seqs)
    # the bound has power: the drafts themselves (q) would fail it
    sigma = (num_seqs * p[0] * (1 - p[0])).sqrt()
    assert ((num_seqs * (q[0] - p[0])).abs() > SIGMAS * sigma).any()
    _assert_accept_counts(accepted, _acceptance_rates(p, q))
    # an accepted draft is followed by the bonus row's sample
    _assert_binomial(_first_two_tokens(tokens, p[1], gen), torch.outer(p[0], p[1]), num_seqs)


def test_three_drafts_keep_the_target_distribution() -> None:
    vocab, num_seqs = 5, 150_000
    gen = torch.Generator().manual_seed(2)
    p = torch.stack([_distribution(vocab, gen, zeros=i % 2) for i in range(4)])
    q = torch.stack([_distribution(vocab, gen, zeros=1 + i % 2) for i in range(3)])
    drafts = _sample_drafts(q, num_seqs, gen)
    tokens, accepted = _run_random(p, q, drafts, gen)
    _assert_binomial(_first_tokens(tokens, vocab), p[0], num_seqs)
    _assert_binomial(_first_two_tokens(tokens, p[1], gen), torch.outer(p[0], p[1]), num_seqs)
    _assert_accept_counts(accepted, _acceptance_rates(p, q))


@pytest.mark.parametrize("k", [1, 3])
def test_one_hot_drafts_keep_the_target_distribution(k: int) -> None:
    vocab, num_seqs = 5, 100_000
    gen = torch.Generator().manual_seed(3 + k)
    p = torch.stack([_distribution(vocab, gen, zeros=1) for _ in range(k + 1)])
    # deterministic drafts (q one-hot), chosen here by some unrelated distribution
    chooser = torch.stack([_distribution(vocab, gen, zeros=2) for _ in range(k)])
    drafts = _sample_drafts(chooser, num_seqs, gen)
    tokens, _ = _run_random(p, None, drafts, gen)
    _assert_binomial(_first_tokens(tokens, vocab), p[0], num_seqs)
    _assert_binomial(_first_two_tokens(tokens, p[1], gen), torch.outer(p[0], p[1]), num_seqs)


def test_one_hot_acceptance_follows_the_target_probability() -> None:
    vocab, num_seqs = 5, 100_000
    gen = torch.Generator().manual_seed(7)
    p = torch.stack([_distribution(vocab, gen, zeros=1) for _ in range(3)])
    fixed = [int(p[0].argsort()[2]), int(p[1].argmax())]  # a middling and a likely token
    drafts = torch.tensor(fixed).repeat(num_seqs, 1)
    _, accepted = _run_random(p, None, drafts, gen)
    rates = torch.tensor([p[0, fixed[0]], p[0, fixed[0]] * p[1, fixed[1]]])
    _assert_accept_counts(accepted, rates.double())


def test_a_draft_the_target_forbids_is_never_accepted() -> None:
    vocab, num_seqs = 4, 5_000
    gen = torch.Generator().manual_seed(8)
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    tokens, accepted = _run_random(p, q, torch.full((num_seqs, 1), 2), gen)
    assert accepted == [0] * num_seqs
    assert {t[0] for t in tokens} == {0, 1}
    tokens, accepted = _run_random(p, None, torch.full((num_seqs, 1), 3), gen)
    assert accepted == [0] * num_seqs
    assert math.isclose(sum(t[0] for t in tokens) / num_seqs, 0.5, abs_tol=0.05)


def test_a_residual_of_zero_falls_back_to_the_target() -> None:
    # rounding can leave max(0, p - q) all zero; exaggerated here with q above p everywhere
    target = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    draft_probs = torch.tensor([[0.6, 0.6, 0.0], [0.0, 0.0, 0.0]])
    noise = torch.tensor([[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]])
    uniforms = torch.tensor([0.9, 0.0])  # 0.9 * 0.6 >= 0.5: rejected
    tokens, accepted = verify(target, [[0]], draft_probs, torch.zeros(2, dtype=torch.bool),
                              uniforms, noise)
    assert (tokens, accepted) == ([[1]], [0])  # argmax(p / noise), not of the zero residual


# no drafts


def test_no_drafts_is_the_exponential_race() -> None:
    vocab, num_seqs = 3000, 64
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(num_seqs, vocab, generator=gen) * 3
    logits[:, ::7] = float("-inf")  # masked tokens: probability 0
    target = logits.softmax(dim=-1)
    uniforms, noise = _random_inputs(num_seqs, vocab, gen)
    greedy = torch.arange(num_seqs) % 4 == 0
    tokens, accepted = verify(target, [[] for _ in range(num_seqs)], None, greedy,
                              uniforms, noise)
    want = torch.where(greedy, target.argmax(dim=-1), (target / noise).argmax(dim=-1))
    assert tokens == [[t] for t in want.tolist()]
    assert accepted == [0] * num_seqs


# mixed batches against a per-sequence loop


def _reference(target: torch.Tensor, drafts: list[list[int]], draft_probs: torch.Tensor | None,
               greedy: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor
               ) -> tuple[list[list[int]], list[int]]:
    """The rule, one sequence and one position at a time."""
    tokens, counts, row = [], [], 0
    for seq_drafts in drafts:
        out: list[int] = []
        for j in range(len(seq_drafts) + 1):
            p = target[row + j]
            if j == len(seq_drafts):
                residual = p
            else:
                d = seq_drafts[j]
                if bool(greedy[row + j]):
                    ok = d == int(p.argmax())
                else:
                    q_d = 1.0 if draft_probs is None else draft_probs[row + j, d]
                    ok = bool(uniforms[row + j] * q_d < p[d])
                if ok:
                    out.append(d)
                    continue
                if draft_probs is None:
                    residual = p.clone()
                    residual[d] = 0.0
                else:
                    residual = (p - draft_probs[row + j]).clamp(min=0.0)
                if residual.sum() <= 0:
                    residual = p
            pick = p.argmax() if bool(greedy[row + j]) else (residual / noise[row + j]).argmax()
            out.append(int(pick))
            break
        tokens.append(out)
        counts.append(len(out) - 1)
        row += len(seq_drafts) + 1
    return tokens, counts


def _mixed_batch(gen: torch.Generator, with_q: bool
                 ) -> tuple[torch.Tensor, list[list[int]], torch.Tensor | None, torch.Tensor]:
    vocab, num_seqs = 11, 60
    lengths = torch.randint(0, 5, (num_seqs,), generator=gen).tolist()
    seq_greedy = (torch.rand(num_seqs, generator=gen) < 0.4).tolist()
    num_rows = sum(k + 1 for k in lengths)
    target = torch.stack([_distribution(vocab, gen, zeros=3) for _ in range(num_rows)])
    draft_probs = (torch.stack([_distribution(vocab, gen, zeros=3) for _ in range(num_rows)])
                   if with_q else None)
    drafts, greedy, row = [], [], 0
    for k, is_greedy in zip(lengths, seq_greedy):
        # mostly the argmax, so greedy rows accept some; otherwise any token
        top = target[row: row + k].argmax(dim=-1)
        other = torch.randint(0, vocab, (k,), generator=gen)
        pick = torch.rand(k, generator=gen) < 0.7
        drafts.append(torch.where(pick, top, other).tolist())
        greedy += [is_greedy] * (k + 1)
        row += k + 1
    return target, drafts, draft_probs, torch.tensor(greedy)


@pytest.mark.parametrize("with_q", [True, False])
def test_mixed_batch_matches_a_loop_and_greedy_ignores_randomness(with_q: bool) -> None:
    gen = torch.Generator().manual_seed(10 + with_q)
    target, drafts, draft_probs, greedy = _mixed_batch(gen, with_q)
    num_rows, vocab = target.shape
    uniforms, noise = _random_inputs(num_rows, vocab, gen)
    got = verify(target, drafts, draft_probs, greedy, uniforms, noise)
    assert got == _reference(target, drafts, draft_probs, greedy, uniforms, noise)
    assert {len(d) for d in drafts} == {0, 1, 2, 3, 4}
    assert any(n > 0 for n in got[1]) and any(n < len(d) for n, d in zip(got[1], drafts))

    # other randomness, NaN on greedy rows: greedy sequences give the same tokens
    uniforms, noise = _random_inputs(num_rows, vocab, gen)
    uniforms[greedy] = float("nan")
    noise[greedy] = float("nan")
    again = verify(target, drafts, draft_probs, greedy, uniforms, noise)
    assert again == _reference(target, drafts, draft_probs, greedy, uniforms, noise)
    starts = [sum(len(d) + 1 for d in drafts[:s]) for s in range(len(drafts))]
    greedy_seqs = [s for s, start in enumerate(starts) if greedy[start]]
    assert greedy_seqs
    assert [again[0][s] for s in greedy_seqs] == [got[0][s] for s in greedy_seqs]
    assert [again[1][s] for s in greedy_seqs] == [got[1][s] for s in greedy_seqs]


def test_an_empty_batch() -> None:
    empty = torch.empty(0, 7)
    assert verify(empty, [], None, torch.empty(0, dtype=torch.bool), torch.empty(0),
                  empty) == ([], [])


# errors


def _valid() -> dict:
    drafts = [[1, 2], [], [3]]
    rows, vocab = _rows(drafts), 6
    return dict(target_probs=torch.full((rows, vocab), 1 / vocab), draft_token_ids=drafts,
                draft_probs=torch.full((rows, vocab), 1 / vocab),
                greedy=torch.zeros(rows, dtype=torch.bool), uniforms=torch.rand(rows),
                noise=torch.ones(rows, vocab))


@pytest.mark.parametrize("change, message", [
    (dict(draft_token_ids=[[1, 2], [], [3, 4]]), "target_probs has 6 rows"),
    (dict(target_probs=torch.full((6,), 0.5)), "target_probs must be"),
    (dict(draft_probs=torch.ones(6, 5)), "draft_probs must have shape"),
    (dict(draft_probs=torch.ones(7, 6)), "draft_probs must have shape"),
    (dict(noise=torch.ones(6, 7)), "noise must have shape"),
    (dict(uniforms=torch.rand(5)), "uniforms must have shape"),
    (dict(greedy=torch.zeros(6, 1, dtype=torch.bool)), "greedy must have shape"),
    (dict(greedy=torch.zeros(6)), "greedy must be a bool"),
    (dict(draft_token_ids=[[1, 6], [], [3]]), "outside the vocabulary"),
    (dict(draft_token_ids=[[1, -1], [], [3]]), "outside the vocabulary"),
])
def test_inputs_that_do_not_fit_raise(change: dict, message: str) -> None:
    verify(**_valid())
    with pytest.raises(ValueError, match=message):
        verify(**(_valid() | change))
