"""The Triton quantised-weight products against the torch reference, in Triton's
interpreter.

``conftest.py`` sets ``TRITON_INTERPRET=1`` before triton is imported, so the kernels run
on CPU tensors. Weights are seeded random valid blocks: ``gguf.quants.quantize`` of random
floats where it supports the type (f32, f16, bf16, q4_0 .. q8_0), else random bytes with
the f16 scale fields overwritten by small finite values (the K-quants), and
:func:`~quire.quantization.quantize.quantize_rows` for int8 and fp8_e4m3.

Checks and tolerances (``bound`` = ``|x| @ |W|^T``, the sum of the absolute products,
which bounds every rounding error of a sum of products):

- dequantisation, bit for bit: ``I_K @ W^T`` (float32 ``I``) is every weight times 1 plus
  zeros, exact in float32, so both kernels must give ``W.dequantize().t()`` exactly.
- float32 x: ``|got - ref| <= 4e-6 * bound``. Both sum float32 products in float32, in
  different orders (tiles of K, split-K shares); float32 summation error is at most
  about ``K * 2^-24 * bound`` (3e-5 at K = 512), in practice about ``sqrt(K) * 2^-24``;
  the largest seen here is 1.5e-7, and one flipped weight byte gives 6e-5 or more.
- float16 / bfloat16 x: ``2^-9`` / ``2^-7`` times ``bound``. Both results are rounded to
  the half dtype (half a step each, relative to ``|y| <= bound``), and a compiled kernel
  also rounds each dequantised weight to the half dtype for the tensor-core dot (half a
  step relative to each product); three half steps and float32 noise fit in one step
  times two. (In the interpreter bfloat16 tiles are widened to float32, see the module.)
- w8a8: exactly :func:`quire.ops.quantized.quantized_linear` with ``int8_activations``
  (integer sums are exact and the kernels scale them in float64 as the reference does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from quire.ops.quantized import quantized_linear as reference_linear  # noqa: E402
from quire.quantization.formats import FORMATS  # noqa: E402
from quire.quantization.quantize import quantize_rows  # noqa: E402
from quire.quantization.tensor import QuantizedTensor  # noqa: E402

#: byte offsets of the f16 scale fields of the K-quants' blocks
K_QUANT_F16 = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2),
               "q6_k": (208,)}
GGUF_QUANTIZE = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
ALL = GGUF_QUANTIZE + tuple(K_QUANT_F16) + ("int8", "fp8_e4m3")
FLOAT32_TOLERANCE = 4e-6
HALF_TOLERANCE = {torch.float32: FLOAT32_TOLERANCE, torch.float16: 2.0 ** -9,
                  torch.bfloat16: 2.0 ** -7}


def kernels():
    from quire.kernels import triton_quant

    assert triton_quant.INTERPRETED
    return triton_quant


def random_weight(name: str, rows: int, cols: int, seed: int) -> QuantizedTensor:
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.5
    if fmt.row_scaled:
        return quantize_rows(w, name)
    if name in GGUF_QUANTIZE:
        q = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[name.upper()])
        data = torch.from_numpy(np.ascontiguousarray(q).view(np.uint8).reshape(rows, -1))
        return QuantizedTensor(fmt, data.clone(), cols)
    blocks = torch.randint(0, 256, (rows * cols // fmt.block, fmt.block_bytes),
                           dtype=torch.uint8, generator=g)
    for start in K_QUANT_F16[name]:
        small = (torch.rand(blocks.shape[0], generator=g) * 0.02 + 1e-3).half()
        blocks[:, start:start + 2] = small.view(torch.uint8).view(-1, 2)
    return QuantizedTensor(fmt, blocks.reshape(rows, -1).contiguous(), cols)


def widths(name: str) -> tuple[int, int]:
    """Two K per format: 256 and one that is not a multiple of 256 (nor of the 64-wide
    K tile) where the blocks allow, else 512."""
    return (256, 512) if FORMATS[name].block == 256 else (256, 160)


def check_close(got, x, weight, bias, tol):
    w = weight.dequantize()
    ref = F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
    bound = F.linear(x.float().abs(), w.abs(), None if bias is None else bias.float().abs())
    assert got.dtype == x.dtype and got.shape == ref.shape
    err = (got.float() - ref.float()).abs()
    assert torch.isfinite(got.float()).all()
    excess = err - tol * bound - 1e-30
    assert (excess <= 0).all(), f"max error {err.max():.3g}, bound {(tol * bound).max():.3g}"


@pytest.mark.parametrize("name", ALL)
def test_dequantisation_is_bit_exact_through_an_identity_product(name):
    weight = random_weight(name, 24, 256, seed=len(name))
    eye = torch.eye(256)
    want = weight.dequantize().t()
    q = kernels()
    tiled = q.quantized_matmul(eye, weight, block_m=64, block_n=32, block_k=128)
    assert torch.equal(tiled, want)
    # the GEMV kernel runs one program per row, slow in the interpreter: 16 rows of I
    picked = torch.arange(3, 256, 16)
    rows = q.quantized_matmul(eye[picked], weight, gemv_max_m=16, block_n=32, block_k=64)
    assert torch.equal(rows, want[picked])


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("m", [1, 5, 33])
def test_every_format_matches_the_reference_in_float32(name, m):
    q = kernels()
    for i, k in enumerate(widths(name)):
        weight = random_weight(name, 40, k, seed=m * 31 + i)
        g = torch.Generator().manual_seed(m + k)
        x = torch.randn(m, k, generator=g)
        bias = torch.randn(40, generator=g) if i == 0 else None
        check_close(q.quantized_linear(x, weight, bias), x, weight, bias, FLOAT32_TOLERANCE)


@pytest.mark.parametrize("name", ["q4_0", "q5_1", "q8_0", "q3_k", "q6_k", "bf16", "int8",
                                  "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 33])
def test_half_activations(name, dtype, m):
    k = widths(name)[1]
    weight = random_weight(name, 24, k, seed=7)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(2, m, k, generator=g).to(dtype)  # leading dims are flattened
    bias = torch.randn(24, generator=g).to(dtype)
    got = kernels().quantized_linear(x, weight, bias)
    assert got.shape == (2, m, 24)
    check_close(got.reshape(-1, 24), x.reshape(-1, k), weight, bias, HALF_TOLERANCE[dtype])


@pytest.mark.parametrize("name", ["q4_1", "q5_0", "q2_k", "q4_k", "q5_k", "f16", "int8"])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_strided_rows_and_split_k(name, m):
    block = FORMATS[name].block
    width = 512 if block == 256 else 192
    full = random_weight(name, 36, 2 * width, seed=m)
    start = 256 if block == 256 else 96
    weight = full.narrow_cols(start, width)
    assert weight.data.stride(0) > weight.data.shape[1]  # rows further apart than a row
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, width, generator=g)
    bias = torch.randn(36, generator=g)
    q = kernels()
    for split in (1, 3):
        got = q.quantized_matmul(x, weight, bias, split_k=split, block_k=32, block_n=16)
        check_close(got, x, weight, bias, FLOAT32_TOLERANCE)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 2])
def test_w8a8_is_the_reference_exactly(m, dtype, split):
    k = 160
    full = random_weight("int8", 40, 2 * k, seed=m)
    weight = full.narrow_cols(64, k)  # strided rows
    g = torch.Generator().manual_seed(m + 100)
    x = torch.randn(m, k, generator=g).to(dtype)
    x[0, :] = 0.0  # a zero row: scale 1
    bias = torch.randn(40, generator=g).to(dtype)
    want = reference_linear(x, weight, bias, int8_activations=True)
    got = kernels().quantized_matmul(x, weight, bias, activations="int8", split_k=split,
                                     block_k=32)
    assert torch.equal(got, want)
    got = kernels().quantized_linear(x, weight, None, int8_activations=True)
    assert torch.equal(got, reference_linear(x, weight, None, int8_activations=True))


@pytest.mark.parametrize("m", [1, 20])
def test_fp8_activations_follow_their_torch_model(m):
    """Interpreter only: the fp8 ``tl.dot`` is emulated in float32 (exact products of
    e4m3 values); a GPU's fp8 tensor cores are not exercised here."""
    k = 96
    weight = random_weight("fp8_e4m3", 24, k, seed=m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(24, generator=g)
    q = kernels()
    qx, sx = q._quantize_fp8(x)
    acc = qx.view(torch.float8_e4m3fn).float() @ weight.data.view(torch.float8_e4m3fn).float().t()
    want = acc * sx[:, None] * weight.scale + bias
    for split in (1, 2):
        got = q.quantized_matmul(x, weight, bias, activations="fp8", split_k=split,
                                 block_k=32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and it stays near the weight-only product (e4m3 activations: 2^-4 relative steps)
    check_close(got, x, weight, bias, 2.0 ** -3)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("split", [1, 3])
def test_w8a8_on_q8_0_is_the_blockwise_integer_product(m, split):
    """``int8``'s 32-weight groups (Q8_0) with Q8 activations: within float32 summation
    of the reference (float64 sums of the same integer block products), the bound of
    tests/unit/test_quantize_groups.py."""
    from quire.ops.quantized import quantize_activation_blocks
    from quire.quantization.quantize import quantize_groups

    k = 320
    g = torch.Generator().manual_seed(m + 7 * split)
    w = torch.randn(40, 2 * k, generator=g) * 0.02
    w.view(40, -1, 32)[:, ::8] *= 50
    weight = quantize_groups(w).narrow_cols(64, k)  # strided rows
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    bias = torch.randn(40, generator=g)
    want = reference_linear(x, weight, bias, int8_activations=True)
    got = kernels().quantized_matmul(x, weight, bias, activations="int8", split_k=split)
    qx, dx = quantize_activation_blocks(x)
    xq = (qx.float().view(m, -1, 32) * dx.unsqueeze(-1)).view(m, k)
    gmax = weight.dequantize().abs().view(40, -1, 32).amax(-1).repeat_interleave(32, 1)
    eps = torch.finfo(torch.float32).eps
    bound = (k / 32 + 8) * eps * (xq.abs().double() @ gmax.double().T + bias.abs())
    assert torch.all((got.double() - want.double()).abs() <= bound + 1e-30)
    y16 = kernels().quantized_linear(x.bfloat16(), weight, None, int8_activations=True)
    assert y16.dtype == torch.bfloat16 and y16.shape == (m, 40)


def test_the_op_is_in_triton_ops_and_refuses_what_the_reference_refuses():
    from quire.kernels.triton_ops import quantized_linear, triton_ops

    assert triton_ops()["quantized_linear"] is quantized_linear
    weight = random_weight("q8_0", 16, 64, seed=1)
    x = torch.randn(3, 64)
    check_close(quantized_linear(x, weight), x, weight, None, FLOAT32_TOLERANCE)
    with pytest.raises(ValueError, match="int8 activations need int8 weights"):
        quantized_linear(x, random_weight("q4_0", 16, 64, seed=1), int8_activations=True)
    with pytest.raises(ValueError, match="features"):
        quantized_linear(torch.randn(3, 32), weight)
    empty = quantized_linear(torch.randn(0, 64), weight)
    assert empty.shape == (0, 16)


_COMPILE = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from quire.kernels import triton_quant as Q
    from quire.quantization.formats import FORMATS

    assert not Q.INTERPRETED

    def compile_for(fn, target, consts, types):
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
                continue
            sig[name] = "*" + types.get(name, "fp32") if name.endswith("_ptr") else "i32"
            if name.endswith("_ptr") or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=target, options=dict(
            num_warps=4, num_stages=2, enable_fp_fusion=False))

    half = dict(x_ptr="bf16", w_ptr="u8", b_ptr="bf16", y_ptr="bf16")
    common = dict(HAS_BIAS=True, SPLIT=1, INTERPRETED=False)
    results = []
    for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
        jobs = [
            ("qmm", Q._qmm_kernel, dict(FMT=FORMATS["q4_k"].id, ROW_SCALED=False,
             DOT_FP32=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, **common), half),
            ("gemv", Q._qgemv_kernel, dict(FMT=FORMATS["q6_k"].id, ROW_SCALED=False,
             ACT_INT8=False, BLOCK_N=32, BLOCK_K=64, **common), half),
            ("w8a8", Q._qmm_act_kernel, dict(ACT=Q.ACT_INT8, BLOCK_M=64, BLOCK_N=64,
             BLOCK_K=128, **common), dict(half, x_ptr="u8")),
            ("w8a8 q8_0", Q._qmm_q8_kernel, dict(BLOCK_M=64, BLOCK_N=64, **common),
             dict(half, x_ptr="u8")),
        ]
        if target.backend == "cuda":
            jobs.append(("fp8", Q._qmm_act_kernel, dict(ACT=Q.ACT_FP8, BLOCK_M=64,
                         BLOCK_N=64, BLOCK_K=128, **common), dict(half, x_ptr="u8")))
        for name, fn, consts, types in jobs:
            binary = "cubin" if target.backend == "cuda" else "hsaco"
            kernel = compile_for(fn, target, consts, types)
            results.append([target.backend, name, len(kernel.asm[binary]) > 0])
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_kernels_compile_for_nvidia_and_amd_targets():
    """Proves the kernels lower (sm_90, gfx942), not that they run correctly there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True,
                            text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert len(results) == 9 and all(r[-1] for r in results), results
