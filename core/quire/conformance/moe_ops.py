"""The mixture-of-experts ops of a platform's ``make_ops()`` against the reference.

Per dtype the platform declares, one row: ``select_experts`` on random router logits
(the same experts, weights within the float32 tolerance) and ``fused_moe`` on random
inputs rounded to the dtype, fed the reference's routing, so each op is judged alone.
The oracle is :mod:`quire.ops.moe` run in float32 on the host from the same rounded
inputs, so only the platform's own arithmetic is measured.

Tolerances (``|out - ref| <= atol + rtol * |ref|``; outputs of order 1):

- float32: 1e-4; the products in float32 (a TF32 product errs by about 1e-3, and fails).
- float16: 5e-3 and bfloat16: 3e-2. The gated rows are rounded to the dtype before the
  down projection and each expert's output before the weighted sum, as the reference
  does in that dtype; the reference itself, run in the dtype, uses up to a third of it.
"""

from __future__ import annotations

import torch

from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.conformance.tolerances import Comparison, Tolerance, compare
from quire.ops import moe

MOE = "moe ops"
TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
}
#: (tokens, hidden, expert intermediate, experts, top_k, renormalize): one token; a
#: batch larger than a kernel's block; more experts than slots (some get none).
CASES = ((1, 64, 48, 8, 2, True), (37, 128, 96, 8, 2, False), (5, 64, 32, 16, 1, True),
         (70, 64, 64, 4, 2, True))


def check_moe_ops(ctx: CheckContext) -> list[CheckResult]:
    """One row per dtype: the platform's ``select_experts`` and ``fused_moe``."""
    try:
        ops = ctx.platform.make_ops()
    except Exception as exc:  # reported, not raised: the table names the check
        return [CheckResult(MOE, Outcome.FAIL, reason=f"make_ops() raised "
                            f"{type(exc).__name__}: {exc}")]
    return [_row(ctx, ops, dtype) for dtype in ctx.dtypes]


def _row(ctx: CheckContext, ops: object, dtype: torch.dtype) -> CheckResult:
    name = str(dtype).removeprefix("torch.")
    tol = TOLERANCE.get(dtype)
    if tol is None:
        return CheckResult(MOE, Outcome.FAIL, name, f"no tolerance for {name}")
    sources = f"select_experts: {ops.source_of('select_experts')}, " \
              f"fused_moe: {ops.source_of('fused_moe')}"
    worst, failures = Comparison(0.0, 0.0, 0), []
    for n, (t, h, i, e, k, renorm) in enumerate(CASES):
        label = f"T={t}, H={h}, I={i}, E={e}, top_k={k}"
        g = torch.Generator().manual_seed(ctx.seed * 1000 + n)
        logits = torch.randn(t, e, generator=g)
        hidden = torch.randn(t, h, generator=g).to(dtype)
        w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
        w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
        ref_weights, ref_ids = moe.select_experts(logits, k, renorm)
        try:
            weights, ids = ops.select_experts(logits.to(ctx.device), k, renorm)
            problem = _routing_problem(weights, ids, ref_weights, ref_ids)
            if problem:
                failures.append(f"select_experts, {label}: {problem}")
            dev = ctx.device
            out = ops.fused_moe(hidden.to(dev), w13.to(dev), w2.to(dev),
                                ref_weights.to(dev), ref_ids.to(dev))
        except Exception as exc:  # one broken case must not hide the others
            failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
            continue
        if tuple(out.shape) != (t, h) or out.dtype != dtype:
            failures.append(f"fused_moe, {label}: returned {tuple(out.shape)} {out.dtype}, "
                            f"expected {(t, h)} {dtype}")
            continue
        ref = moe.fused_moe(hidden.float(), w13.float(), w2.float(), ref_weights, ref_ids)
        cmp = compare(out, ref, tol)
        worst = max(worst, cmp, key=lambda c: c.worst_ratio)
        if not cmp.ok:
            failures.append(f"fused_moe, {label}: max |err| {cmp.max_abs_err:.2e}"
                            + (f", {cmp.nonfinite} non-finite" if cmp.nonfinite else ""))
    figure = (f"max |err| {worst.max_abs_err:.1e}, {worst.worst_ratio:.0%} of tol {tol}; "
              f"{len(CASES)} cases; {sources}")
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(MOE, Outcome.FAIL, name, failures[0] + more, figure)
    return CheckResult(MOE, Outcome.PASS, name, figure=figure)


def _routing_problem(weights: torch.Tensor, ids: torch.Tensor, ref_weights: torch.Tensor,
                     ref_ids: torch.Tensor) -> str:
    """What is wrong with a platform's routing, or ``""``. The order of a token's experts
    is free (sorted before comparing); their set and weights are not."""
    if weights.dtype != torch.float32 or ids.dtype != torch.int64:
        return f"returned {weights.dtype} weights and {ids.dtype} ids; expected float32, int64"
    if weights.shape != ref_weights.shape or ids.shape != ref_ids.shape:
        return f"returned shapes {tuple(weights.shape)}, {tuple(ids.shape)}; expected " \
               f"{tuple(ref_weights.shape)}"
    ids, order = ids.cpu().sort(dim=-1)
    ref_ids, ref_order = ref_ids.sort(dim=-1)
    if not torch.equal(ids, ref_ids):
        return "chose other experts than the reference"
    got = weights.cpu().gather(-1, order)
    cmp = compare(got, ref_weights.gather(-1, ref_order), TOLERANCE[torch.float32])
    return "" if cmp.ok else f"weights off by {cmp.max_abs_err:.2e}"
