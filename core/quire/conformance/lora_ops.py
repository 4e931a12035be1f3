"""A platform's ``lora_linear`` op (:mod:`quire.ops.lora`) against the reference.

Per dtype the platform declares, one row over several batches: one token; a fused q/k/v
product (offsets ``(0, 64, 80)``) and a gate/up one (two slices); a single slice;
tokens of several slots with base-model tokens (slot -1) among them, and a batch of
base-model tokens only. The slots hold adapters of ranks 1, 8 and 16, zero-padded to the
stack's rank (16, or 20 in one case); input and output widths are not multiples of a
kernel's block. Inputs are random, rounded to the dtype; the op gets a copy of ``y``
(it may update it in place). The oracle is :func:`quire.ops.lora.lora_linear` on the
host in float32 from the same rounded inputs, so only the platform's own arithmetic is
measured.

Checked: the returned tensor's shape and dtype (``y``'s); every base-model token's row
equal to ``y``'s, bit for bit (the contract leaves them alone); the rest within
``|out - ref| <= atol + rtol * |ref|`` (outputs of order 1 to 5): float32 1e-4 (float32
sums in another order cost about 1e-6; a TF32 product errs by about 1e-3, and fails);
float16 5e-3 and bfloat16 3e-2 (the output rounded to the dtype; the reference itself,
run in the dtype, also rounds ``A x`` and the update, and stays well inside them).
"""

from __future__ import annotations

from typing import Any

import torch

from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.conformance.tolerances import Comparison, Tolerance, compare
from quire.ops import lora

LORA = "lora linear"
TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
}
#: (tokens, in features, offsets, out features, each slot's rank, stacked rank,
#: base-model tokens only).
CASES = (
    (1, 70, (0,), 50, (8,), 16, False),
    (7, 96, (0, 64, 80), 100, (1, 8, 16), 16, False),
    (23, 130, (0, 48), 96, (16, 1, 8, 8), 16, False),
    (40, 200, (0,), 136, (8, 16, 1), 16, False),
    (33, 72, (0, 64, 80), 112, (20, 3), 20, False),
    (5, 70, (0, 64, 80), 100, (8, 16), 16, True),
)


def check_lora_linear(ctx: CheckContext) -> list[CheckResult]:
    """One row per dtype: the platform's ``lora_linear``."""
    try:
        ops = ctx.platform.make_ops()
    except Exception as exc:  # reported, not raised: the table names the check
        return [CheckResult(LORA, Outcome.FAIL, reason=f"make_ops() raised "
                            f"{type(exc).__name__}: {exc}")]
    return [_row(ctx, ops, dtype) for dtype in ctx.dtypes]


def make_case(n: int, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Case ``n`` of :data:`CASES`: the op's arguments, rounded to ``dtype``, on the host.

    Every slot's A and B are zero past its rank; A is scaled by ``1/sqrt(in)`` and B by
    ``1/sqrt(rank)``, so the update is of order 1, as ``y`` is. Slots are drawn from -1
    up, then the first ones set so that every slot and -1 occur, in that order of
    preference (a single token has slot 0)."""
    t, d_in, offsets, d_out, ranks, r, base_only = CASES[n]
    g = torch.Generator().manual_seed(seed * 1000 + n)
    a = torch.zeros(len(ranks), len(offsets), r, d_in)
    b = torch.zeros(len(ranks), d_out, r)
    for s, rank in enumerate(ranks):
        a[s, :, :rank] = torch.randn(len(offsets), rank, d_in, generator=g) / d_in ** 0.5
        b[s, :, :rank] = torch.randn(d_out, rank, generator=g) / rank ** 0.5
    slots = torch.randint(-1, len(ranks), (t,), generator=g)
    present = torch.tensor([*range(len(ranks)), -1])[:t]
    slots[:len(present)] = present[torch.randperm(len(present), generator=g)]
    if base_only:
        slots.fill_(-1)
    return {"y": torch.randn(t, d_out, generator=g).to(dtype),
            "x": torch.randn(t, d_in, generator=g).to(dtype),
            "a": a.to(dtype), "b": b.to(dtype), "offsets": offsets, "token_slots": slots}


def _row(ctx: CheckContext, ops: Any, dtype: torch.dtype) -> CheckResult:
    name = str(dtype).removeprefix("torch.")
    tol = TOLERANCE.get(dtype)
    if tol is None:
        return CheckResult(LORA, Outcome.FAIL, name, f"no tolerance for {name}")
    worst, failures = Comparison(0.0, 0.0, 0), []
    for n, (t, d_in, offsets, d_out, ranks, r, _) in enumerate(CASES):
        label = f"T={t}, in={d_in}, offsets={offsets}, out={d_out}, ranks={ranks}, R={r}"
        case = make_case(n, dtype, ctx.seed)
        floats = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point()
                  else v for k, v in case.items()}
        ref = lora.lora_linear(**floats)
        dev = {k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v
               for k, v in case.items()}
        dev["y"] = case["y"].to(ctx.device, copy=True)  # the op may update it in place
        try:
            out = ops.lora_linear(**dev)
        except Exception as exc:  # one broken case must not hide the others
            failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
            continue
        if tuple(out.shape) != (t, d_out) or out.dtype != dtype:
            failures.append(f"{label}: returned {tuple(out.shape)} {out.dtype}, expected "
                            f"{(t, d_out)} {dtype}")
            continue
        base = case["token_slots"] < 0
        if not torch.equal(out.cpu()[base], case["y"][base]):
            failures.append(f"{label}: changed the row of a token with slot -1")
        cmp = compare(out, ref, tol)
        worst = max(worst, cmp, key=lambda c: c.worst_ratio)
        if not cmp.ok:
            failures.append(f"{label}: max |err| {cmp.max_abs_err:.2e}"
                            + (f", {cmp.nonfinite} non-finite" if cmp.nonfinite else ""))
    figure = (f"max |err| {worst.max_abs_err:.1e}, {worst.worst_ratio:.0%} of tol {tol}; "
              f"{len(CASES)} cases; lora_linear: {ops.source_of('lora_linear')}")
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(LORA, Outcome.FAIL, name, failures[0] + more, figure)
    return CheckResult(LORA, Outcome.PASS, name, figure=figure)
