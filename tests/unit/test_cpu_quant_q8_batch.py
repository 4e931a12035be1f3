"""csrc/quant_q8.c's batch kernel (``quire_quant_gemm_q8_batch``): GGUF block weights
unpacked into column panels, times int8-quantised activations, at every ISA level this
host runs (the generic level has none: None, and the caller falls back).

The oracle is float64 ``F.linear(dequant_q8(x), W.dequantize())``: the activations
quantised with the kernel's rule in torch (:func:`dequant_q8`), the weight
by quire's ``dequant.py``. The integer sums are exact; what differs is float32 rounding
of the block terms and their sums. The panels take some codes with an offset (Q4_0's 8,
Q6_K's 32, Q8_0's 128 at VNNI, the minima of Q4_1 and the K-quants), whose terms are at
most twice the block's largest ``|w|``; so the bound held per output is
``(k / 32 + TOL_ULPS) * eps32 * 2 * sum_b sum_c |d_b q_c| * G_jb`` (``G_jb`` the largest
``|w|`` of the weight's 32-block), twice the tiles' bound in test_cpu_quant_q8.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from quire.platforms.cpu.native import NativeKernels, load_native_kernels
from quire.platforms.cpu.options import CpuOptions
from quire.platforms.cpu.quant_linear import make_quantized_linear
from quire.quantization.formats import FORMATS
from quire.quantization.random import random_quantized

#: the amx level's build differs in this file's kernels (tests/unit/conftest.py)
pytestmark = pytest.mark.amx

FORMATS_Q8 = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "q5_0", "q5_1", "q5_k")
BLOCK32 = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
#: the fewest rows that take AMX tiles at the amx level (quant_q8.c's QB_AMX_MIN_ROWS)
AMX_MIN_ROWS = 32
ROWS = (1, 5, 17, 64, 200)
TOL_ULPS = 8
EPS = torch.finfo(torch.float32).eps


def dequant_q8(x: torch.Tensor) -> torch.Tensor:
    """Each row's 32-value blocks quantised as the kernel does (``d = max|x| / 127``,
    round half to even), back to float32."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d > 0, torch.round(blocks / safe).clamp(-127, 127), torch.zeros_like(blocks))
    return (q * d).reshape(m, k)


def bound(x: torch.Tensor, w_float: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float64 reference and the tolerance per output (the module's docstring)."""
    xq = dequant_q8(x).double()
    expected = F.linear(xq, w_float.double(), None if bias is None else bias.double())
    k = x.shape[1]
    group_max = w_float.abs().reshape(w_float.shape[0], k // 32, 32).amax(-1, keepdim=True)
    magnitude = xq.abs() @ group_max.expand(-1, -1, 32).reshape(-1, k).double().T
    if bias is not None:
        magnitude = magnitude + bias.abs().double()
    return expected, (k / 32 + TOL_ULPS) * EPS * 2 * magnitude + 1e-30


def check(y: torch.Tensor, x: torch.Tensor, w_float: torch.Tensor,
          bias: torch.Tensor | None = None) -> None:
    expected, tol = bound(x, w_float, bias)
    err = (y.double() - expected).abs()
    assert torch.all(err <= tol), f"worst {(err / tol).max().item():.2f} of the bound"


def need_batch(kernels: NativeKernels) -> None:
    if not kernels.has_quant_q8_batch:
        assert kernels.level == "generic", "every SIMD level has the batch kernel"
        pytest.skip("the generic level has no batch kernel (the caller falls back)")


@pytest.mark.parametrize("fmt", FORMATS_Q8)
def test_matches_reference(kernels: NativeKernels, fmt: str) -> None:
    need_batch(kernels)
    g = torch.Generator().manual_seed(300 + FORMATS[fmt].id)
    k = 96 if fmt in BLOCK32 else 512
    for n in (37, 3):  # odd: a panel's lanes past n left out
        weight = random_quantized(fmt, n, k, g)
        w_float = weight.dequantize()
        bias = torch.randn(n, generator=g)
        for m in ROWS:
            x = torch.randn(m, k, generator=g) * 3
            x[0, 32:64] = 0.0  # an all-zero block: d = 0
            check(kernels.quant_linear_q8(x, weight, batch=True), x, w_float)
            check(kernels.quant_linear_q8(x, weight, bias, batch=True), x, w_float, bias)


@pytest.mark.parametrize("fmt", FORMATS_Q8)
def test_matches_the_tiles_of_up_to_four_rows(kernels: NativeKernels, fmt: str) -> None:
    """The same products as quire_quant_gemm_q8's tiles, up to float rounding: within
    the sum of both bounds of the reference."""
    need_batch(kernels)
    g = torch.Generator().manual_seed(400 + FORMATS[fmt].id)
    k = 256 if fmt in BLOCK32 else 768
    weight = random_quantized(fmt, 45, k, g)
    w_float = weight.dequantize()
    for m in (1, 2, 3, 4, 9):
        x = torch.randn(m, k, generator=g)
        batch = kernels.quant_linear_q8(x, weight, batch=True)
        tiles = kernels.quant_linear_q8(x, weight)
        _, tol = bound(x, w_float, None)
        assert torch.all((batch.double() - tiles.double()).abs() <= 2 * tol)


@pytest.mark.parametrize("fmt", ("q4_k", "q6_k", "q8_0", "q4_1"))
def test_strided_rows_and_out(kernels: NativeKernels, fmt: str) -> None:
    """A column slice of a wider weight, written into a slice of a wider output."""
    need_batch(kernels)
    g = torch.Generator().manual_seed(500 + FORMATS[fmt].id)
    block = FORMATS[fmt].block
    wide = random_quantized(fmt, 21, 4 * 256, g)
    weight = wide.narrow_cols(block * (256 // block), 2 * 256)
    x = torch.randn(19, 2 * 256, generator=g)
    out = torch.full((19, 30), float("nan"))
    assert kernels.quant_linear_q8(x, weight, out=out[:, 5:26], batch=True) is not None
    check(out[:, 5:26], x, weight.dequantize())
    assert torch.isnan(out[:, :5]).all() and torch.isnan(out[:, 26:]).all()


@pytest.mark.parametrize("fmt", FORMATS_Q8)
def test_amx_tiles_give_the_vnni_kernel_s_products(kernels: NativeKernels, fmt: str) -> None:
    """At the amx level, batches of 32 rows or more multiply whole 16 rows on AMX-INT8
    tiles (the rest of the rows, smaller batches, and Q6_K's panels, on vpdpbusd). The
    tiles' integer
    block sums are exact and scaled as vpdpbusd's are, so on unsigned codes the result
    is the avx512_bf16 level's bit for bit; Q8_0's codes stay signed on the tiles (no
    offset of 128, no minimum term), so its result is held to the reference's bound."""
    if kernels.level != "amx" or not kernels.has_amx:
        pytest.skip("AMX tiles run at the amx level only, once Linux grants them")
    vnni = load_native_kernels(isa="avx512_bf16")
    assert vnni is not None and vnni.level == "avx512_bf16"
    g = torch.Generator().manual_seed(600 + FORMATS[fmt].id)
    k = 352 if fmt in BLOCK32 else 768  # 11 blocks of 32: an odd count for the tiles' pairs
    weight = random_quantized(fmt, 45, k, g)
    bias = torch.randn(45, generator=g)
    for m in (16, 31, 32, 33, 40, 64):
        x = torch.randn(m, k, generator=g) * 3
        x[m - 1, 64:96] = 0.0  # an all-zero block in a tile's row
        sections = kernels.amx_sections()
        tiles = kernels.quant_linear_q8(x, weight, bias, batch=True)
        # Q6_K's panels and batches under AMX_MIN_ROWS keep vpdpbusd
        on_tiles = fmt != "q6_k" and m >= AMX_MIN_ROWS
        assert (kernels.amx_sections() > sections) == on_tiles, m
        if fmt == "q8_0" and m >= AMX_MIN_ROWS:
            check(tiles, x, weight.dequantize(), bias)
            assert not torch.equal(tiles, vnni.quant_linear_q8(x, weight, bias, batch=True))
        else:
            assert torch.equal(tiles, vnni.quant_linear_q8(x, weight, bias, batch=True))


def test_formats_it_does_not_take(kernels: NativeKernels) -> None:
    """Another format: code 4 from the entry (at every level), None from the wrapper; a
    width that is not whole blocks: code 2."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 256, generator=g)
    y = torch.empty(6, 4)
    for fmt in ("q2_k", "q3_k", "f32", "bf16", "int8"):
        weight = random_quantized(fmt, 4, 256, g)
        assert kernels.quant_linear_q8(x, weight, batch=True) is None
        data = weight.data
        code = kernels._quant_q8_batch(FORMATS[fmt].id, x.data_ptr(), 6, 256, data.data_ptr(),
                                       data.stride(0), 4, None, y.data_ptr(), 4)
        assert code == NativeKernels.QUANT_Q8_UNSUPPORTED
    if kernels.has_quant_q8_batch:
        code = kernels._quant_q8_batch(FORMATS["q4_k"].id, x.data_ptr(), 6, 128,
                                       ctypes.c_void_p(0), 0, 4, None, y.data_ptr(), 4)
        assert code == 2


def test_the_activations_option() -> None:
    """``activations=int8`` implies int8 decode rows; other values are refused."""
    assert CpuOptions.parse({"activations": "int8"}, {}).int8_decode
    assert CpuOptions.parse({}, {"QUIRE_CPU_ACTIVATIONS": "int8"}).activations == "int8"
    assert not CpuOptions.parse({}, {}).int8_decode
    assert CpuOptions.parse({"decode_activations": "int8"}, {}).int8_decode
    with pytest.raises(ValueError, match="activations"):
        CpuOptions.parse({"activations": "int4"}, {})


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_the_linear_takes_every_row_to_int8(kernels: NativeKernels, dtype) -> None:
    """The platform's quantized_linear with ``int8_all``: a 40-row product (a bfloat16
    one widened to float32 first) is the int8 kernel's, rounded to the rows' dtype;
    without it, a float32 one is not (float activations)."""
    g = torch.Generator().manual_seed(9)
    weight = random_quantized("q4_1", 33, 192, g)
    x = torch.randn(2, 20, 192, generator=g).to(dtype)
    bias = torch.randn(33, generator=g)
    y = make_quantized_linear(kernels, int8_all=True)(x, weight, bias)
    assert y.dtype == dtype and y.shape == (2, 20, 33)
    rows = x.reshape(40, 192).float()
    int8 = kernels.quant_linear_q8(rows, weight, bias, batch=kernels.has_quant_q8_batch)
    torch.testing.assert_close(y.reshape(40, 33), int8.to(dtype), rtol=0, atol=0)
    if dtype == torch.float32:
        check(y.reshape(40, 33), rows, weight.dequantize(), bias)
        plain = make_quantized_linear(kernels)(x, weight, bias)
        assert not torch.equal(plain, y)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_an_engine_with_int8_activations_stays_close_to_float_rows(random_gguf, monkeypatch,
                                                                   dtype) -> None:
    """``activations=int8`` on a GGUF model: the prompts (one batch of 6 prompts) and the
    6-row decode steps take the batch kernel, and the tokens and logprobs stay close to
    the float rows' run of the same dtype (logprobs within 0.05 where the tokens agree;
    measured within 0.02), while differing from it (int8 ran)."""
    from quire import LLM, SamplingParams

    path = random_gguf("--preset", "tiny", "--seed", "7")
    batched = []
    original = NativeKernels.quant_linear_q8

    def counting(self, x, *args, batch=False, **kwargs):
        batched.append(batch)
        return original(self, x, *args, batch=batch, **kwargs)

    monkeypatch.setattr(NativeKernels, "quant_linear_q8", counting)
    prompts = [[1, 17 + i, 45, 99, 23, 7 + i, 5] for i in range(6)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)

    def run(**options):
        with LLM(str(path), device="cpu", kv_cache_memory=16 << 20, dtype=dtype,
                 **options) as llm:
            outs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids,
                 [step[t].logprob for step, t in zip(o.outputs[0].logprobs,
                                                     o.outputs[0].token_ids)]) for o in outs]

    floats = run()
    assert not any(batched)
    int8 = run(platform_options={"activations": "int8"})
    assert any(batched) == (load_batch_level() != "generic")
    differs = False
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(int8, floats):
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
                     len(tokens))
        assert agree >= 2
        assert logprobs[:agree] == pytest.approx(ref_logprobs[:agree], abs=0.05)
        differs |= logprobs[:agree] != pytest.approx(ref_logprobs[:agree], abs=1e-6)
    assert differs


def load_batch_level() -> str:
    """The ISA level an engine's kernels run at on this host (its best)."""
    from quire.platforms.cpu.native import load_native_kernels

    loaded = load_native_kernels()
    return "generic" if loaded is None else loaded.level
