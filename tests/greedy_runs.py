"""Comparing greedy runs whose products round differently (bfloat16 activations, another
summation order): tokens agree up to a near-tie that rounding may decide either way."""

from __future__ import annotations

import pytest


def assert_greedy_close(ours, reference, tolerance: float) -> None:
    """Greedy runs, each sequence ``(tokens, logprobs, tops)`` with ``tops`` each step's
    ``{token: logprob}`` of at least its two likeliest, agree: the same tokens with
    logprobs within ``tolerance``, up to a step where the reference's two likeliest tokens
    lie within ``tolerance`` of each other (a near-tie that rounding may decide either
    way); there each side's token must be the other's runner-up, and the texts part."""
    for (tokens, logprobs, tops), (ref_tokens, ref_logprobs, ref_tops) in zip(ours,
                                                                           reference):
        part = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                    len(ref_tokens))
        assert len(tokens) == len(ref_tokens)
        assert logprobs[:part] == pytest.approx(ref_logprobs[:part], abs=tolerance)
        if part < len(ref_tokens):
            ref_step, step = ref_tops[part], tops[part]
            assert tokens[part] in ref_step and ref_tokens[part] in step
            gap = ref_step[ref_tokens[part]] - ref_step[tokens[part]]
            assert 0 <= gap <= tolerance, (part, gap)
