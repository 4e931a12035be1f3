"""The decoder layer's elementwise ops of a platform's ``make_ops()`` against the reference:
``rms_norm`` (alone, with the residual add, with Gemma's ``1 + w`` offset),
``silu_and_mul``, ``gelu_tanh_and_mul``, and ``rotary_write_kv`` (the rotated queries,
and the whole KV cache after the write: written slots and untouched ones).

Per dtype the platform declares, one row, every op over several shapes (one row; many
rows; hidden sizes that are not powers of two). Inputs are random, rounded to the dtype;
the oracle is :mod:`quire.ops.reference` run in float32 on the host from the same
rounded inputs, so only the platform's own arithmetic is measured.

Tolerances (``|out - ref| <= atol + rtol * |ref|``; outputs of order 1 to 10): float32
1e-5 (sums in another order and a last-bit ``exp`` cost about 1e-6); float16 2e-3 and
bfloat16 1.6e-2. The reference itself, run in the dtype, rounds twice (the normalised
value or the activation, then the product): at most about ``2u`` relative, ``u`` the
dtype's half unit (2**-11, 2**-8); measured, about 40% of the tolerance. The residual sum (one
rounded add) and the rotation (three roundings of values below about 6) are held to the
same tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.conformance.tolerances import Comparison, Tolerance, compare
from quire.ops import reference

LAYER = "layer ops"
#: What an op's second output is, for failure messages.
PART_NAMES = {"rms_norm": "the residual sum", "rotary_write_kv": "the KV cache"}
TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
}
#: rms_norm cases: (rows, hidden size, with residual, offset).
NORM_CASES = ((1, 64, False, 0.0), (37, 576, True, 0.0), (5, 99, True, 1.0),
              (70, 256, False, 1.0), (3, 1000, True, 0.0))
#: Gated activation cases: (rows, intermediate size); the input is [rows, 2 * size].
GATED_CASES = ((1, 48), (37, 200), (70, 99))
GATED_OPS = ("silu_and_mul", "gelu_tanh_and_mul")
#: rotary_write_kv cases: (tokens, query heads, kv heads, head size); the cache has 8
#: pages of 4 slots and random contents, which must stay where nothing is written.
ROTARY_CASES = ((1, 4, 2, 64), (23, 8, 2, 128), (5, 3, 3, 18))
OPS = ("rms_norm", *GATED_OPS, "rotary_write_kv")


def check_layer_ops(ctx: CheckContext) -> list[CheckResult]:
    """One row per dtype: the platform's ``rms_norm``, gated activations and
    ``rotary_write_kv``."""
    try:
        ops = ctx.platform.make_ops()
    except Exception as exc:  # reported, not raised: the table names the check
        return [CheckResult(LAYER, Outcome.FAIL, reason=f"make_ops() raised "
                            f"{type(exc).__name__}: {exc}")]
    return [_row(ctx, ops, dtype) for dtype in ctx.dtypes]


def _row(ctx: CheckContext, ops: Any, dtype: torch.dtype) -> CheckResult:
    name = str(dtype).removeprefix("torch.")
    tol = TOLERANCE.get(dtype)
    if tol is None:
        return CheckResult(LAYER, Outcome.FAIL, name, f"no tolerance for {name}")
    worst, failures = Comparison(0.0, 0.0, 0), []
    for label, run, want in _cases(ctx, ops, dtype):
        try:
            got = run()
        except Exception as exc:  # one broken case must not hide the others
            failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
            continue
        for part, (out, ref) in enumerate(zip(_tensors(got), want, strict=False)):
            what = label if part == 0 else f"{label} ({PART_NAMES[label.split(',')[0]]})"
            if not isinstance(out, torch.Tensor) or out.shape != ref.shape \
                    or out.dtype != dtype:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out)
                failures.append(f"{what}: returned {shape} "
                                f"{getattr(out, 'dtype', '')}, expected "
                                f"{tuple(ref.shape)} {dtype}")
                continue
            cmp = compare(out, ref, tol)
            worst = max(worst, cmp, key=lambda c: c.worst_ratio)
            if not cmp.ok:
                failures.append(f"{what}: max |err| {cmp.max_abs_err:.2e}"
                                + (f", {cmp.nonfinite} non-finite" if cmp.nonfinite else ""))
        if len(_tensors(got)) != len(want):
            failures.append(f"{label}: returned {len(_tensors(got))} tensors, expected "
                            f"{len(want)}")
    sources = ", ".join(f"{op}: {ops.source_of(op)}" for op in OPS)
    count = len(NORM_CASES) + len(GATED_CASES) * len(GATED_OPS) + len(ROTARY_CASES)
    figure = (f"max |err| {worst.max_abs_err:.1e}, {worst.worst_ratio:.0%} of tol {tol}; "
              f"{count} cases; {sources}")
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(LAYER, Outcome.FAIL, name, failures[0] + more, figure)
    return CheckResult(LAYER, Outcome.PASS, name, figure=figure)


def _cases(ctx: CheckContext, ops: Any, dtype: torch.dtype
           ) -> list[tuple[str, Callable[[], Any], tuple[torch.Tensor, ...]]]:
    """(label, the platform's call, the float32 oracle's outputs) per case."""
    dev, cases = ctx.device, []
    for n, (rows, size, with_residual, offset) in enumerate(NORM_CASES):
        g = torch.Generator().manual_seed(ctx.seed * 1000 + n)
        x = (2 * torch.randn(rows, size, generator=g)).to(dtype)
        residual = torch.randn(rows, size, generator=g).to(dtype) if with_residual else None
        weight = (1 + 0.2 * torch.randn(size, generator=g)).to(dtype)
        ref = reference.rms_norm(x.float(), weight.float(), 1e-6,
                                 None if residual is None else residual.float(),
                                 offset=offset)
        label = (f"rms_norm, T={rows}, H={size}, residual={with_residual}, "
                 f"offset={offset:g}")
        cases.append((label, _norm_call(ops, x, weight, residual, offset, dev),
                       _tensors(ref)))
    for n, (rows, size) in enumerate(GATED_CASES):
        g = torch.Generator().manual_seed(ctx.seed * 1000 + 100 + n)
        x = (2 * torch.randn(rows, 2 * size, generator=g)).to(dtype)
        for op in GATED_OPS:
            ref = getattr(reference, op)(x.float())
            cases.append((f"{op}, T={rows}, I={size}", _gated_call(ops, op, x, dev), (ref,)))
    for n, (t, hq, hkv, d) in enumerate(ROTARY_CASES):
        g = torch.Generator().manual_seed(ctx.seed * 1000 + 200 + n)
        angles = torch.rand(t, 1, d // 2, generator=g) * 100
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
        sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
        qk = torch.randn(t, hq + hkv, d, generator=g).to(dtype)
        v = torch.randn(t, hkv, d, generator=g).to(dtype)
        cache = torch.randn(2, 8, 4, hkv, d, generator=g).to(dtype)
        slots = torch.randperm(32, generator=g)[:t]
        ref_cache = cache.float().clone()  # .float() of a float32 tensor is the tensor
        ref = reference.rotary_write_kv(qk.float(), v.float(), cos.float(), sin.float(),
                                        ref_cache, slots)
        cases.append((f"rotary_write_kv, T={t}, Hq={hq}, Hkv={hkv}, D={d}",
                      _rotary_call(ops, qk, v, cos, sin, cache, slots, dev),
                      (ref, ref_cache)))
    return cases


def _rotary_call(ops: Any, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                 dev: torch.device) -> Callable[[], Any]:
    def call() -> Any:  # the rotated queries, then the whole cache after the write
        pages = cache.to(dev, copy=True)  # a fresh cache per call, the input kept
        query = ops.rotary_write_kv(qk.to(dev), v.to(dev), cos.to(dev), sin.to(dev), pages,
                                    slots.to(dev))
        return query, pages
    return call


def _norm_call(ops: Any, x: torch.Tensor, weight: torch.Tensor,
               residual: torch.Tensor | None, offset: float,
               dev: torch.device) -> Callable[[], Any]:
    def call() -> Any:
        res = None if residual is None else residual.to(dev)
        return ops.rms_norm(x.to(dev), weight.to(dev), 1e-6, res, offset=offset)
    return call


def _gated_call(ops: Any, op: str, x: torch.Tensor, dev: torch.device
                ) -> Callable[[], Any]:
    return lambda: getattr(ops, op)(x.to(dev))


def _tensors(result: Any) -> tuple[torch.Tensor, ...]:
    """An op's outputs, on the host: one tensor, or the tuple an op with residual returns."""
    parts = result if isinstance(result, tuple) else (result,)
    return tuple(p.cpu() if isinstance(p, torch.Tensor) else p for p in parts)
