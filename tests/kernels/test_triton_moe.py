"""The Triton fused-MoE kernels against the torch reference, in Triton's interpreter.

``conftest.py`` sets ``TRITON_INTERPRET=1`` before triton is imported, so the kernels run
on CPU tensors. Inputs are seeded random (never zeros); ids come from
:func:`~quire.ops.moe.select_experts` on random logits or are chosen to leave experts
without tokens. Shapes cover T = 1, T * top_k above the slot block (several blocks per
expert), top-k 1 and 2 and 3, sizes that are not multiples of the tiles.

Tolerances, against the reference in the same dtype:

- float32: rtol = atol = 1e-4 (both accumulate in float32; the kernels in tiles of K).
- bfloat16: rtol = atol = 2e-2, one bfloat16 step of outputs of order 1, where float32
  sums that differ in the last bits round to neighbouring values.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quire.ops.moe import fused_moe as reference_fused_moe  # noqa: E402
from quire.ops.moe import select_experts  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def kernels():
    from quire.kernels import triton_moe

    assert triton_moe.INTERPRETED
    return triton_moe


def random_case(t, h, i, e, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    weights, ids = select_experts(torch.randn(t, e, generator=g), k, renormalize=True)
    return hidden, w13, w2, weights, ids


@pytest.mark.parametrize("t, h, i, e, k", [
    (1, 32, 24, 4, 1),      # one token, one expert
    (1, 48, 40, 8, 2),      # one token, two experts, sizes off the tiles
    (13, 32, 16, 4, 2),     # 26 slots: more than a 16-slot block
    (40, 64, 48, 6, 2),     # several blocks for most experts
    (9, 32, 32, 8, 3),
    (3, 16, 16, 16, 2),     # more experts than slots: most get none
])
def test_fused_moe_matches_the_reference(t, h, i, e, k):
    case = random_case(t, h, i, e, k, seed=t * 7 + e)
    got = kernels().fused_moe(*case, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(got, reference_fused_moe(*case), rtol=1e-4, atol=1e-4)


def test_default_blocks_and_bfloat16():
    case = random_case(21, 64, 80, 8, 2, seed=11, dtype=torch.bfloat16)
    got = kernels().fused_moe(*case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference_fused_moe(*case), rtol=2e-2, atol=2e-2)


def test_every_token_on_one_expert_and_experts_left_empty():
    hidden, w13, w2, _, _ = random_case(20, 32, 16, 5, 2, seed=3)
    ids = torch.tensor([[4, 1]] * 20)  # experts 0, 2, 3 get nothing; 4 and 1 two blocks each
    weights = torch.rand(20, 2, generator=torch.Generator().manual_seed(4))
    got = kernels().fused_moe(hidden, w13, w2, weights, ids, block_m=16, block_n=16,
                              block_k=16)
    torch.testing.assert_close(got, reference_fused_moe(hidden, w13, w2, weights, ids),
                               rtol=1e-4, atol=1e-4)


def test_align_slots_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # slots 0..5
    slots, block_expert = kernels().align_slots(ids, num_experts=5, block_m=16)
    n = 6
    assert block_expert.tolist()[:3] == [0, 2, 3] and set(block_expert.tolist()[3:]) == {-1}
    runs = slots.view(-1, 16)
    assert runs[0].tolist() == [1, 4] + [n] * 14  # expert 0: slots 1 and 4, in order
    assert runs[1].tolist() == [0, 2, 5] + [n] * 13
    assert runs[2].tolist() == [3] + [n] * 15
    assert (runs[3:] == n).all()


def test_bad_blocks_and_layouts_are_refused_by_name():
    case = random_case(2, 32, 16, 4, 2, seed=0)
    with pytest.raises(ValueError, match="block_m=8"):
        kernels().fused_moe(*case, block_m=8)
    hidden, w13, w2, weights, ids = case
    with pytest.raises(ValueError, match="w13's last dimension"):
        kernels().fused_moe(hidden, w13.transpose(1, 2).contiguous().transpose(1, 2), w2,
                            weights, ids)
    with pytest.raises(ValueError, match="w2 must be"):
        kernels().fused_moe(hidden, w13, w2[:, :, :8], weights, ids)


def test_the_lazy_op_and_the_gpu_platforms_use_the_kernels():
    from quire.kernels.triton_moe_op import fused_moe
    from quire_cuda.platform import CudaPlatform
    from quire_rocm.platform import RocmPlatform

    case = random_case(5, 32, 16, 4, 2, seed=9)
    torch.testing.assert_close(fused_moe(*case), reference_fused_moe(*case),
                               rtol=1e-4, atol=1e-4)
    for platform in (CudaPlatform(), RocmPlatform()):
        ops = platform.make_ops()
        assert ops.fused_moe is fused_moe and ops.source_of("fused_moe") == "triton"
        assert ops.source_of("select_experts") == "reference"


def test_conformance_moe_row_passes_for_cuda_in_kernels_only_mode():
    """The suite's MoE check, as ``quire conformance --device cuda --kernels-only`` runs it."""
    from quire.conformance import ConformanceOptions, Outcome, run_conformance
    from quire_cuda.platform import CudaPlatform

    platform = CudaPlatform()
    rows = run_conformance(platform, ConformanceOptions(kernels_only=True, checks=("moe",)),
                           expected_name="cuda").results
    assert len(rows) == len(platform.supported_dtypes)
    for row in rows:
        assert row.outcome is Outcome.PASS, f"{row.case}: {row.reason}"
        assert "fused_moe: triton" in row.figure
