"""How close a backend's attention must come to the reference's, per dtype, and why.

A comparison passes when, element-wise, ``|out - ref| <= atol + rtol * |ref|`` and every
output is finite. ``ref`` is the cpu reference backend run in float32 on the *same*
rounded inputs (the test's K/V/queries are drawn in float32, rounded to the dtype under
test, and handed to both sides), so input rounding cancels; what is left is the
backend's own arithmetic:

- the final rounding of the output to the dtype: half a unit in the last place, i.e.
  ``u * |out|`` with ``u = 2**-24`` (float32), ``2**-11`` (float16), ``2**-8`` (bfloat16);
- the probabilities rounded to the dtype before the ``P @ V`` product, as flash-style
  kernels do: at most ``u`` relative per term, so ``u * max|v|`` absolute;
- exp approximations and a different summation order (online softmax across blocks).

Outputs are convex combinations of values drawn from N(0, 1), so ``|out|`` and ``|v|``
stay below about 4. A kernel that rounds both P and the output can thus err by up to
about 4e-3 (float16) or 3e-2 (bfloat16), though errors partly cancel in the sum. Measured
worst errors: the cpu reference (output rounding only) 9.7e-4 / 7.8e-3, the core's Triton
kernels (P rounded too) 1.5e-2 in bfloat16. The tolerances leave that headroom, while the
failures that matter (a wrong mask, head, slot, window or scale) err by 0.5 to 6, or NaN.

float32 allows 1e-4: fast exp and reordering cost about 1e-6 (Triton measures 7e-7 to
1e-6), while a kernel that silently computes ``q @ k`` in TF32 (10-bit mantissa) errs by
about 1e-3 and fails, on purpose: a platform that declares float32 promises float32
results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def __str__(self) -> str:
        return f"{self.atol:.0e} + {self.rtol:.0e}·|ref|"


#: Attention (and read-back through attention) tolerances, by the dtype under test.
ATTENTION: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
}


def attention_tolerance(dtype: torch.dtype) -> Tolerance:
    """:raises ValueError: for a dtype the suite states no tolerance for."""
    try:
        return ATTENTION[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in ATTENTION)
        raise ValueError(
            f"no conformance tolerance for {str(dtype).removeprefix('torch.')}; "
            f"the suite knows {known}"
        ) from None


@dataclass(frozen=True)
class Comparison:
    """How far one output is from its reference."""

    max_abs_err: float
    #: Largest ``|out - ref| / (atol + rtol * |ref|)``: <= 1 passes; NaN/inf count as inf.
    worst_ratio: float
    nonfinite: int

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.worst_ratio <= 1.0


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Comparison:
    """Compare ``out`` (any device, any float dtype) with ``ref`` (float32, host)."""
    got = out.detach().float().cpu()
    if got.shape != ref.shape:
        raise ValueError(f"output shape {tuple(got.shape)} != expected {tuple(ref.shape)}")
    err = (got - ref).abs()
    finite = torch.isfinite(got)
    nonfinite = int((~finite).sum())
    allowed = tol.atol + tol.rtol * ref.abs()
    ratio = torch.where(finite, err / allowed, torch.full_like(err, float("inf")))
    max_err = float(err[finite].max()) if bool(finite.any()) else float("nan")
    return Comparison(max_err, float(ratio.max()) if ratio.numel() else 0.0, nonfinite)
