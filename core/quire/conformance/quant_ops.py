"""A platform's ``quantized_linear`` op against the reference, per method it declares.

One row per method of ``Platform.quantizations`` but ``none``: ``gguf`` runs every GGUF
format (the block types, then F16/BF16/F32), ``int8`` its 32-weight groups (Q8_0)
and its rows, ``fp8`` its rows, ``w8a8`` both int8 layouts with ``int8_activations``
(int8 activations per 32 values on Q8_0, per row on the rows). Each case multiplies random inputs,
rounded to each dtype the platform declares, by a random weight
(:mod:`quire.quantization.random`), with a bias, for one row (a decode step) and for
batches, at widths that leave partial tiles. The oracle is
:func:`quire.ops.quantized.quantized_linear` on the host in float32 from the same
rounded inputs.

Tolerances, relative to the largest reference output (``|out - ref| <= atol * max|ref|
+ rtol * |ref|``): float32 1e-4 (float32 products in another order; a TF32 or bfloat16
product errs by 1e-3 and fails); float16 5e-3 and bfloat16 3e-2 (the output rounded to
the dtype, and a kernel may multiply in it). ``w8a8`` compares integer products, so the
same float32 bound holds whatever the kernel's order.

An op that takes ``bf16_activations`` (``Platform.bf16_activations``, which the cpu
platform's ``activations`` option answers) gets one more row per weight-only method:
float32 inputs with the keyword, against the reference's rounded product, at bfloat16's
tolerance (the op may round fewer rows, or none), the output float32.
"""

from __future__ import annotations

import inspect

import torch

from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.ops import quantized
from quire.quantization.formats import GGUF_TYPES
from quire.quantization.random import random_quantized

QUANT = "quantized linear"
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
#: (rows of x, output features, input features): one decode row; batches across tiles.
CASES = ((1, 48, 256), (7, 40, 512), (33, 24, 768))
#: Formats each method is checked in.
METHOD_FORMATS = {"gguf": GGUF_TYPES, "int8": ("q8_0", "int8"), "fp8": ("fp8_e4m3",),
                  "w8a8": ("q8_0", "int8")}


def check_quantized_linear(ctx: CheckContext) -> list[CheckResult]:
    """One row per declared method and dtype."""
    methods = [m for m in ctx.platform.quantizations if m in METHOD_FORMATS]
    if not methods:
        return [CheckResult(QUANT, Outcome.NOT_RUN, reason="the platform declares no "
                            "quantization method (Platform.quantizations)")]
    try:
        ops = ctx.platform.make_ops()
    except Exception as exc:  # reported, not raised: the table names the check
        return [CheckResult(QUANT, Outcome.FAIL, reason=f"make_ops() raised "
                            f"{type(exc).__name__}: {exc}")]
    rows = [_row(ctx, ops, method, dtype) for method in methods for dtype in ctx.dtypes]
    if _takes_bf16_activations(ops.quantized_linear):
        rows += [_row(ctx, ops, method, torch.float32, bf16=True) for method in methods
                 if method != "w8a8"]
    return rows


def _takes_bf16_activations(op: object) -> bool:
    try:
        return "bf16_activations" in inspect.signature(op).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _row(ctx: CheckContext, ops: object, method: str, dtype: torch.dtype,
         bf16: bool = False) -> CheckResult:
    name = f"{method}, {str(dtype).removeprefix('torch.')}" + (
        ", bf16_activations" if bf16 else "")
    tol = TOLERANCE.get(torch.bfloat16 if bf16 else dtype)
    if tol is None:
        return CheckResult(QUANT, Outcome.FAIL, name, f"no tolerance for {dtype}")
    int8_act = method == "w8a8"
    extra = {"int8_activations": True} if int8_act else \
        {"bf16_activations": True} if bf16 else {}
    worst, failures = 0.0, []
    for fmt in METHOD_FORMATS[method]:
        for n, (m, rows, cols) in enumerate(CASES):
            label = f"{fmt}, M={m}, N={rows}, K={cols}"
            g = torch.Generator().manual_seed(ctx.seed * 1000 + n)
            weight = random_quantized(fmt, rows, cols, g)
            x = torch.randn(m, cols, generator=g).to(dtype)
            bias = torch.randn(rows, generator=g).to(dtype)
            ref = quantized.quantized_linear(x.float(), weight, bias.float(), **extra)
            try:
                out = ops.quantized_linear(x.to(ctx.device), weight.to(ctx.device),
                                           bias.to(ctx.device), **extra)
            except Exception as exc:  # one broken case must not hide the others
                failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
                continue
            if tuple(out.shape) != (m, rows) or out.dtype != dtype:
                failures.append(f"{label}: returned {tuple(out.shape)} {out.dtype}, "
                                f"expected {(m, rows)} {dtype}")
                continue
            err = (out.float().cpu() - ref).abs()
            bound = tol * ref.abs().max() + tol * ref.abs()
            ratio = float((err / bound).max())
            worst = max(worst, ratio)
            if not torch.isfinite(out).all() or ratio > 1:
                failures.append(f"{label}: max |err| {float(err.max()):.2e} "
                                f"({ratio:.1f}x the bound)")
    figure = (f"worst {worst:.0%} of tol {tol:g}; {len(METHOD_FORMATS[method])} formats x "
              f"{len(CASES)} shapes; quantized_linear: {ops.source_of('quantized_linear')}")
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(QUANT, Outcome.FAIL, name, failures[0] + more, figure)
    return CheckResult(QUANT, Outcome.PASS, name, figure=figure)
