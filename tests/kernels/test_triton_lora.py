"""The Triton ``lora_linear`` kernels against the torch reference, in Triton's interpreter.

``conftest.py`` sets ``TRITON_INTERPRET=1`` before triton is imported, so the kernels run
on CPU tensors. Inputs are seeded random: each slot's A and B random up to its own rank
and zero past it (the manager's zero-padding to the stack's rank), slots drawn from -1
up with every slot and -1 present where there are tokens enough. Shapes cover one token
and 40, one, two and three slices (a fused q/k/v at offsets 0, 64, 80), ranks 1, 8, 16
and 20 (padded in the kernel to 16 and 32), widths that are not multiples of the blocks,
strided rows, and batches with no adapter at all.

Tolerances, against :func:`quire.ops.lora.lora_linear` in float32 on the same rounded
inputs (outputs of order 1 to 5):

- float32: ``rtol = atol = 1e-4``; both sum float32 products, in other orders (about
  1e-6 apart).
- float16 / bfloat16: ``rtol`` one step of the dtype (2^-10 / 2^-7), ``atol`` 1e-4. The
  kernel sums in float32 and rounds once, to nearest, so it errs by at most half a step
  of ``|out|`` plus the float32 noise (it uses up to 47% of the bound); the reference
  run in the dtype, which also rounds ``A x`` and the update, errs by 1.4 to 43 times
  the bound, so a kernel rounding more than once fails.
- rows of tokens with slot -1: bit for bit ``y``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from quire.ops.lora import lora_linear as reference_lora  # noqa: E402

FLOAT32 = {"rtol": 1e-4, "atol": 1e-4}
HALF = {torch.float16: {"rtol": 2.0 ** -10, "atol": 1e-4},
        torch.bfloat16: {"rtol": 2.0 ** -7, "atol": 1e-4}}
QKV = (0, 64, 80)


def kernels():
    from quire.kernels import triton_lora

    assert triton_lora.INTERPRETED
    return triton_lora


def random_case(t, d_in, offsets, d_out, ranks, r, seed, dtype=torch.float32,
                slots=None):
    """(y, x, a, b, offsets, token_slots) rounded to ``dtype``; ``ranks``: each slot's."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(len(ranks), len(offsets), r, d_in)
    b = torch.zeros(len(ranks), d_out, r)
    for s, rank in enumerate(ranks):
        a[s, :, :rank] = torch.randn(len(offsets), rank, d_in, generator=g) / d_in ** 0.5
        b[s, :, :rank] = torch.randn(d_out, rank, generator=g) / rank ** 0.5
    if slots is None:
        slots = torch.randint(-1, len(ranks), (t,), generator=g)
        present = torch.tensor([*range(len(ranks)), -1])[:t]
        slots[:len(present)] = present[torch.randperm(len(present), generator=g)]
    y = torch.randn(t, d_out, generator=g).to(dtype)
    x = torch.randn(t, d_in, generator=g).to(dtype)
    return y, x, a.to(dtype), b.to(dtype), offsets, slots


def reference(case):
    y, x, a, b, offsets, slots = case
    return reference_lora(y.float(), x.float(), a.float(), b.float(), offsets, slots)


def run(case, **blocks):
    y, *rest = case
    return kernels().lora_linear(y.clone(), *rest, **blocks)


def assert_base_rows_untouched(got, case):
    y, slots = case[0], case[-1]
    assert torch.equal(got[slots < 0], y[slots < 0])


@pytest.mark.parametrize("t, d_in, offsets, d_out, ranks, r", [
    (1, 70, (0,), 50, (8,), 16),                # one token
    (7, 96, QKV, 100, (1, 8, 16), 16),          # fused q/k/v, ranks padded to 16
    (23, 130, (0, 48), 96, (16, 1, 8, 8), 16),  # gate/up
    (40, 200, (0,), 136, (8, 16, 1), 16),
    (33, 72, QKV, 112, (20, 3), 20),            # R=20: padded to 32 in the kernel
    (12, 40, QKV, 90, (1, 1), 1),               # a stack of rank 1: padded to 16
])
@pytest.mark.parametrize("blocks", [{}, {"block_k": 16, "block_n": 16}])
def test_float32_matches_the_reference(t, d_in, offsets, d_out, ranks, r, blocks):
    case = random_case(t, d_in, offsets, d_out, ranks, r, seed=t * 31 + d_in)
    got = run(case, **blocks)
    torch.testing.assert_close(got, reference(case), **FLOAT32)
    assert_base_rows_untouched(got, case)
    if t > 1:  # the case mixes base-model tokens with adapters' tokens
        assert (case[-1] < 0).any() and (case[-1] >= 0).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t, d_in, offsets, d_out, ranks, r", [
    (1, 70, (0,), 50, (8,), 16),
    (37, 100, QKV, 100, (1, 8, 16), 16),
    (9, 130, (0, 48), 96, (20, 4), 20),
])
def test_half_dtypes_round_once(dtype, t, d_in, offsets, d_out, ranks, r):
    case = random_case(t, d_in, offsets, d_out, ranks, r, seed=t + 5, dtype=dtype)
    got = run(case)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), reference(case), **HALF[dtype])
    assert_base_rows_untouched(got, case)


def test_no_adapter_leaves_y_unchanged():
    for t in (1, 6):
        case = random_case(t, 64, QKV, 100, (8, 16), 16, seed=t,
                           slots=torch.full((t,), -1, dtype=torch.int64))
        y = case[0].clone()
        got = kernels().lora_linear(*case)
        assert torch.equal(got, y)


def test_a_single_token_of_the_last_slot():
    case = random_case(1, 33, QKV, 97, (16, 8, 1), 16, seed=3,
                       slots=torch.tensor([2]))
    torch.testing.assert_close(run(case), reference(case), **FLOAT32)


def test_y_is_updated_in_place_and_strided_rows_are_read():
    y, x, a, b, offsets, slots = random_case(11, 72, QKV, 100, (8, 16, 1), 16, seed=4)
    wide_x = torch.randn(11, 90)
    wide_x[:, :72] = x
    wide_y = torch.randn(11, 120)
    wide_y[:, 10:110] = y
    out = wide_y[:, 10:110]
    got = kernels().lora_linear(out, wide_x[:, :72], a, b, offsets, slots)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(wide_y[:, 10:110], reference((y, x, a, b, offsets, slots)),
                               **FLOAT32)


def test_no_tokens_and_bad_shapes():
    y, x, a, b, offsets, slots = random_case(3, 32, (0,), 40, (8,), 16, seed=5)
    empty = kernels().lora_linear(y[:0], x[:0], a, b, offsets, slots[:0])
    assert empty.shape == (0, 40)
    with pytest.raises(ValueError, match="2 offsets for 1 slices"):
        kernels().lora_linear(y, x, a, b, (0, 20), slots)
    with pytest.raises(ValueError, match="shapes do not agree"):
        kernels().lora_linear(y, x[:, :16], a, b, offsets, slots)
    with pytest.raises(ValueError, match="token_slots"):
        kernels().lora_linear(y, x, a, b, offsets, slots[:2])
    with pytest.raises(ValueError, match="block_n=24"):
        kernels().lora_linear(y, x, a, b, offsets, slots, block_n=24)


def test_the_lazy_op_and_the_gpu_platforms_use_the_kernels():
    from quire.kernels.triton_ops import lora_linear, triton_ops
    from quire_cuda.platform import CudaPlatform
    from quire_rocm.platform import RocmPlatform

    assert triton_ops()["lora_linear"] is lora_linear
    case = random_case(5, 48, QKV, 90, (8, 2), 16, seed=6)
    torch.testing.assert_close(lora_linear(case[0].clone(), *case[1:]), reference(case),
                               **FLOAT32)
    for platform in (CudaPlatform(), RocmPlatform()):
        ops = platform.make_ops()
        assert ops.lora_linear is lora_linear and ops.source_of("lora_linear") == "triton"


def test_conformance_lora_row_passes_for_cuda_in_kernels_only_mode():
    """The suite's LoRA check, as ``quire conformance --device cuda --kernels-only`` runs
    it."""
    from quire.conformance import ConformanceOptions, Outcome, run_conformance
    from quire_cuda.platform import CudaPlatform

    platform = CudaPlatform()
    rows = run_conformance(platform, ConformanceOptions(kernels_only=True, checks=("lora",)),
                           expected_name="cuda").results
    assert len(rows) == len(platform.supported_dtypes)
    for row in rows:
        assert row.outcome is Outcome.PASS, f"{row.case}: {row.reason}"
        assert "lora_linear: triton" in row.figure


_COMPILE = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from quire.kernels import triton_lora as L

    assert not L.INTERPRETED
    TYPES = {"v_ptr": "fp32", "slots_ptr": "i64", "offsets_ptr": "i64"}

    def compile_for(fn, target, consts):
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
                continue
            sig[name] = "*" + TYPES.get(name, "bf16") if name.endswith("_ptr") else "i32"
            if name.endswith("_ptr") or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=target, options=dict(num_warps=4))

    results = []
    for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
        binary = "cubin" if target.backend == "cuda" else "hsaco"
        for name, fn, consts in (
            ("shrink", L._shrink_kernel, dict(R_PAD=16, BLOCK_K=64)),
            ("expand", L._expand_kernel, dict(N_SLICES=3, R_PAD=16, BLOCK_N=64,
                                              INTERPRETED=False)),
        ):
            kernel = compile_for(fn, target, consts)
            results.append([target.backend, name, len(kernel.asm[binary]) > 0])
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_kernels_compile_for_nvidia_and_amd_targets():
    """Proves the kernels lower (sm_90, gfx942), not that they run correctly there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True,
                            text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert len(results) == 4 and all(r[-1] for r in results), results
