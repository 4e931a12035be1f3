"""The mixture-of-experts reference ops against a naive dense loop over every expert.

The oracle runs every expert on every token and keeps, per token, the ``top_k`` it
chose, so it shares no sorting or grouping with ``quire.ops.moe``. Random seeded inputs;
float32 outputs agree within rtol = atol = 1e-5 (the two sum the same products in a
different order). Routing is checked against Hugging Face's own routers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quire.ops import reference_ops
from quire.ops.moe import fused_moe, select_experts


def dense_moe(hidden, w13, w2, weights, ids):
    out = torch.zeros_like(hidden)
    for e in range(w13.shape[0]):
        gate, up = F.linear(hidden, w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])  # [T, H] for every token
        chosen = (ids == e).float() * weights  # [T, k]: this expert's weight, or 0
        out += y * chosen.sum(dim=1, keepdim=True)
    return out


def random_moe(t, h, i, e, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    logits = torch.randn(t, e, generator=g)
    return hidden, w13, w2, logits


@pytest.mark.parametrize("t, h, i, e, k", [
    (1, 16, 8, 4, 1), (1, 32, 24, 8, 2), (7, 16, 8, 4, 2), (33, 64, 40, 8, 2),
    (50, 32, 16, 6, 3), (5, 16, 8, 16, 2),  # more experts than slots: some get none
])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_dense_loop(t, h, i, e, k, renormalize):
    hidden, w13, w2, logits = random_moe(t, h, i, e, k, seed=t * 100 + e)
    weights, ids = select_experts(logits, k, renormalize)
    got = fused_moe(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(got, dense_moe(hidden, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_experts_with_no_tokens_are_skipped_and_all_tokens_may_share_one():
    hidden, w13, w2, _ = random_moe(9, 16, 8, 5, 2, seed=3)
    ids = torch.tensor([[3, 1]] * 9)
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fused_moe(hidden, w13, w2, weights, ids),
                               dense_moe(hidden, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_bfloat16_matches_the_dense_loop_in_float32():
    hidden, w13, w2, logits = random_moe(12, 32, 16, 4, 2, seed=5, dtype=torch.bfloat16)
    weights, ids = select_experts(logits.bfloat16(), 2, True)
    got = fused_moe(hidden, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    expected = dense_moe(hidden.float(), w13.float(), w2.float(), weights, ids)
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_matches_qwen3_moe_router(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(1))
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, 2, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)


def test_select_experts_matches_mixtral_router():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=2)
    router = MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(2))
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(3))
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, 2, True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)


def test_the_ops_are_in_the_reference_set():
    ops = reference_ops()
    assert ops.fused_moe is fused_moe and ops.select_experts is select_experts
    assert ops.source_of("fused_moe") == "reference"


@pytest.mark.parametrize("change, words", [
    (lambda a: {**a, "hidden": a["hidden"][0]}, "hidden must be [T, H]"),
    (lambda a: {**a, "w13": a["w13"][:, :, :-1]}, "w13 must be"),
    (lambda a: {**a, "w2": a["w2"][:, :, :-1]}, "w2 must be"),
    (lambda a: {**a, "ids": a["ids"][:-1]}, "ids must be"),
    (lambda a: {**a, "weights": a["weights"][:, :1]}, "weights"),
    (lambda a: {**a, "ids": a["ids"] + 4}, "expert ids must be in [0, 4)"),
])
def test_bad_inputs_are_refused_by_name(change, words):
    hidden, w13, w2, logits = random_moe(3, 16, 8, 4, 2, seed=0)
    weights, ids = select_experts(logits, 2, True)
    args = change(dict(hidden=hidden, w13=w13, w2=w2, weights=weights, ids=ids))
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
        fused_moe(**args)


def test_select_experts_refuses_a_bad_top_k():
    with pytest.raises(ValueError, match="top_k=5"):
        select_experts(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match="router_logits must be"):
        select_experts(torch.zeros(4), 1, True)
