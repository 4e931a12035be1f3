"""The embedding-model ops of a platform's ``make_ops()`` against the reference.

Per dtype the platform declares, one row: ``pool`` (mean, CLS and last token, with and
without normalisation) and ``bidirectional_attention`` (sequences of one token, of
several, and one longer than a kernel's block) on random inputs rounded to the dtype. The
oracle is :mod:`quire.ops.pooling` run in float32 on the host from the same rounded
inputs, so only the platform's own arithmetic is measured.

Tolerances (``|out - ref| <= atol + rtol * |ref|``; outputs of order 1): float32 1e-4
(a TF32 product errs by about 1e-3, and fails); float16 5e-3; bfloat16 3e-2. ``pool``
returns float32 whatever the input dtype, so its error is the reference's own.
"""

from __future__ import annotations

import torch

from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.conformance.tolerances import Comparison, Tolerance, compare
from quire.ops import pooling

EMBEDDING = "embedding ops"
TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
}
#: (sequence lengths, heads, head size): one token alone; a batch of mixed lengths; one
#: sequence longer than a kernel's block.
CASES = (((1,), 2, 32), ((5, 1, 9, 3), 4, 64), ((150, 7), 2, 64))


def check_embedding_ops(ctx: CheckContext) -> list[CheckResult]:
    """One row per dtype: the platform's ``pool`` and ``bidirectional_attention``."""
    try:
        ops = ctx.platform.make_ops()
    except Exception as exc:  # reported, not raised: the table names the check
        return [CheckResult(EMBEDDING, Outcome.FAIL, reason=f"make_ops() raised "
                            f"{type(exc).__name__}: {exc}")]
    return [_row(ctx, ops, dtype) for dtype in ctx.dtypes]


def _row(ctx: CheckContext, ops: object, dtype: torch.dtype) -> CheckResult:
    name = str(dtype).removeprefix("torch.")
    tol = TOLERANCE.get(dtype)
    if tol is None:
        return CheckResult(EMBEDDING, Outcome.FAIL, name, f"no tolerance for {name}")
    sources = f"pool: {ops.source_of('pool')}, " \
              f"bidirectional_attention: {ops.source_of('bidirectional_attention')}"
    worst, failures = Comparison(0.0, 0.0, 0), []
    for n, (lens, heads, size) in enumerate(CASES):
        label = f"lengths={list(lens)}, H={heads}, D={size}"
        g = torch.Generator().manual_seed(ctx.seed * 1000 + n)
        total = sum(lens)
        loc = torch.zeros(len(lens) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(lens), 0, out=loc[1:])
        q, k, v = (torch.randn(total, heads, size, generator=g).to(dtype) for _ in range(3))
        hidden = torch.randn(total, heads * size, generator=g).to(dtype)
        dev = ctx.device
        results: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        try:
            out = ops.bidirectional_attention(q.to(dev), k.to(dev), v.to(dev), loc.to(dev),
                                              lens, scale=size ** -0.5)
            ref = pooling.bidirectional_attention(q.float(), k.float(), v.float(), loc, lens,
                                                  scale=size ** -0.5)
            results.append(("bidirectional_attention", out, ref))
            for method in pooling.POOLING_METHODS:
                for normalize in (False, True):
                    got = ops.pool(hidden.to(dev), loc.to(dev), method, normalize)
                    want = pooling.pool(hidden.float(), loc, method, normalize)
                    results.append((f"pool {method}{' normalized' if normalize else ''}",
                                    got, want))
        except Exception as exc:  # one broken case must not hide the others
            failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
            continue
        for op, got, want in results:
            if got.shape != want.shape:
                failures.append(f"{op}, {label}: returned {tuple(got.shape)}, expected "
                                f"{tuple(want.shape)}")
                continue
            cmp = compare(got.float(), want, tol)
            worst = max(worst, cmp, key=lambda c: c.worst_ratio)
            if not cmp.ok:
                failures.append(f"{op}, {label}: max |err| {cmp.max_abs_err:.2e}"
                                + (f", {cmp.nonfinite} non-finite" if cmp.nonfinite else ""))
    figure = (f"max |err| {worst.max_abs_err:.1e}, {worst.worst_ratio:.0%} of tol {tol}; "
              f"{len(CASES)} cases; {sources}")
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(EMBEDDING, Outcome.FAIL, name, failures[0] + more, figure)
    return CheckResult(EMBEDDING, Outcome.PASS, name, figure=figure)
