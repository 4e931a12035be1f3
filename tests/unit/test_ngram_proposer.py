"""Prompt-lookup drafting: hand-made cases, a brute-force reference, argument checks."""

import random

import numpy as np
import pytest
from quire.spec.ngram import NgramProposer


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The spec, written plainly: longest n first, then the most recent earlier start."""
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= size:
            continue
        suffix = tokens[size - n:]
        for i in range(size - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # [2, 3] recurs at index 5 (followed by 9); [1, 2, 3] only at index 0 (followed by 4)
    tokens = [1, 2, 3, 4, 5, 2, 3, 9, 1, 2, 3]
    assert NgramProposer(2, 1, 3).propose(tokens) == [4, 5]
    assert NgramProposer(2, 1, 2).propose(tokens) == [9, 1]


def test_most_recent_occurrence_wins():
    tokens = [7, 8, 1, 7, 8, 2, 7, 8]
    assert NgramProposer(1, 2, 2).propose(tokens) == [2]


def test_drafts_are_cut_by_k_and_by_max_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    proposer = NgramProposer(4, 1, 2)
    assert proposer.propose(tokens) == [3, 4, 5, 6]
    assert proposer.propose(tokens, max_tokens=2) == [3, 4]
    assert proposer.propose(tokens, max_tokens=10) == [3, 4, 5, 6]
    assert proposer.propose(tokens, max_tokens=0) == []


def test_a_match_near_the_end_proposes_fewer_than_k():
    assert NgramProposer(5, 2, 2).propose([4, 1, 2, 9, 1, 2]) == [9, 1, 2]
    # the occurrence may overlap the suffix: [3, 3] starts at 1, one token follows
    assert NgramProposer(5, 2, 2).propose([1, 3, 3, 3]) == [3]


def test_no_match_proposes_nothing():
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4]) == []
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 1, 4, 2]) == []  # only 1-grams recur
    assert NgramProposer(3, 1, 3).propose([]) == []
    assert NgramProposer(3, 1, 3).propose([7]) == []


def test_n_longer_than_the_sequence_falls_back_to_shorter_n():
    proposer = NgramProposer(2, 1, 10)
    assert proposer.propose([1, 2, 1]) == [2, 1]
    assert NgramProposer(2, 3, 10).propose([1, 2, 1]) == []


def test_min_equal_to_max_uses_that_length_only():
    tokens = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    assert NgramProposer(1, 3, 3).propose(tokens) == [9]
    assert NgramProposer(1, 2, 2).propose(tokens) == [8]


def test_repeated_tokens():
    assert NgramProposer(3, 1, 3).propose([5, 5, 5, 5]) == [5]
    assert NgramProposer(3, 1, 1).propose([5, 5, 5, 5]) == [5]  # start 2, one follows
    assert NgramProposer(3, 1, 5).propose([5] * 10) == [5]
    assert NgramProposer(3, 1, 2).propose([5] * 10) == [5]


def test_a_long_match_far_back_beats_many_short_recent_ones():
    # 80 recent copies of the last token, each only a 2-gram [0, 4]; the 4-gram is at the start
    tokens = [1, 2, 3, 4, 7] + [0, 4] * 80 + [1, 2, 3, 4]
    assert NgramProposer(2, 1, 4).propose(tokens) == [7, 0]
    assert NgramProposer(2, 1, 1).propose(tokens) == [1, 2]


def test_numpy_input_and_batch():
    proposer = NgramProposer(2, 1, 3)
    seqs = [[1, 2, 3, 1, 2], np.array([4, 5, 4], dtype=np.int32), [9]]
    assert proposer.propose(seqs[1]) == [5, 4]
    assert proposer.propose_batch(seqs, [8, 1, 8]) == [[3, 1], [5], []]
    with pytest.raises(ValueError, match="max_tokens"):
        proposer.propose_batch(seqs, [1])


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    for case in range(300):
        vocab = rng.choice([2, 4, 8])
        size = rng.randrange(0, 60) if case % 2 else rng.randrange(200, 600)
        tokens = [rng.randrange(vocab) for _ in range(size)]
        k = rng.randint(1, 6)
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        cap = rng.choice([None, 0, 1, 3, 10])
        expected = reference(tokens, k if cap is None else min(k, cap), lo, hi)
        proposer = NgramProposer(k, lo, hi)
        assert proposer.propose(tokens, cap) == expected, (tokens, k, lo, hi, cap)
        assert proposer.propose(np.array(tokens, dtype=np.int32), cap) == expected


@pytest.mark.parametrize(("args", "field"), [
    ((0, 1, 2), "num_speculative_tokens"),
    ((3, 0, 2), "prompt_lookup_min"),
    ((3, 3, 2), "prompt_lookup_max"),
])
def test_bad_arguments_name_the_field(args: tuple[int, int, int], field: str):
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)
