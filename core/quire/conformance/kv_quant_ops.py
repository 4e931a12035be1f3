"""Quantised KV pages (``kv_cache_dtype`` int8 / fp8) of a platform's attention backend
against the reference attention reading the same quantised pages.

One row per quantised KV dtype and model dtype. A KV dtype the backend does not declare
(``AttentionBackend.kv_cache_dtypes``) is reported "not run" with that reason, never
as passed. Per row, the cases of :mod:`quire.conformance.cases` (decode, prefill and
mixed batches, a cached prefix written in an earlier step, with and without a sliding
window and a soft cap, GQA groups 1 and 4, head sizes 64 and 128), each:

- *attention*: the backend writes its pages (its own ``write_kv``, the cache from its own
  allocator, poisoned so a slot read unwritten shows NaN) and attends; the oracle is
  :class:`~quire.ops.attention.ReferenceAttentionBackend` writing and reading int8/fp8
  pages (:mod:`quire.ops.kv_quant`) from the float32 copy of the same rounded inputs. The
  quantisation is deterministic, so both read the same pages: the tolerance is the
  float one of the model dtype (``quire.conformance.tolerances.ATTENTION``), with atol at
  least 2e-3 (a value rounding to the other side of a quantisation step, where the
  backend scales in another order, moves an output by well under that);
- *pages*: where the backend's cache has the reference layout, the written rows read back
  (:func:`~quire.ops.kv_quant.dequantize`) within the quantisation bound of the float
  K/V: half a step (``absmax / 254`` for int8, in the Hadamard basis its groups are
  stored in; ``2**-4`` of the value, or half the smallest subnormal step, for fp8), plus
  1%.
"""

from __future__ import annotations

import torch

from quire.conformance.cases import SHAPES, NUM_KV_HEADS, batch_to, make_case
from quire.conformance.checks import make_backend
from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.conformance.tolerances import ATTENTION, Comparison, Tolerance, compare
from quire.ops import kv_quant
from quire.ops.attention import ReferenceAttentionBackend

KV_QUANT = "quantised kv"
#: (kv dtype name, batch kind, head size, GQA group, window, soft cap) per case.
CASES = tuple(
    (kind, head, group, window, cap)
    for i, kind in enumerate(SHAPES)
    for head, group, window, cap in (
        (64, 1 + 3 * (i % 2), None, None),
        (128, 4 - 3 * (i % 2), 5, None),
        (64, 4, None, 30.0),
    )
)
BLOCK_SIZE = 16


def check_quantized_kv(ctx: CheckContext) -> list[CheckResult]:
    """One row per quantised KV dtype and model dtype (see the module doc)."""
    backend = make_backend(ctx, KV_QUANT)
    if isinstance(backend, CheckResult):
        return [backend]
    declared = tuple(getattr(backend, "kv_cache_dtypes", ()))
    rows = []
    for name, kv_dtype in kv_quant.QUANTIZED_KV_DTYPES.items():
        if name not in declared:
            rows.append(CheckResult(
                KV_QUANT, Outcome.NOT_RUN, name,
                f"the backend ({backend.name}) declares no {name} pages "
                f"(kv_cache_dtypes: {', '.join(declared) or 'none'})"))
            continue
        if name == "int8" and not getattr(backend, "kv_int8_hadamard", False):
            rows.append(CheckResult(
                KV_QUANT, Outcome.NOT_RUN, name,
                f"the backend ({backend.name}) declares int8 pages of the layout before "
                f"plugin API 1.6 (kv_int8_hadamard not set), which the engine refuses"))
            continue
        rows.extend(_row(ctx, backend, name, kv_dtype, dtype) for dtype in ctx.dtypes)
    return rows


def _tolerance(dtype: torch.dtype) -> Tolerance | None:
    tol = ATTENTION.get(dtype)
    return None if tol is None else Tolerance(max(tol.atol, 2e-3), max(tol.rtol, 2e-3))


def _row(ctx: CheckContext, backend, name: str, kv_dtype: torch.dtype,
         dtype: torch.dtype) -> CheckResult:
    label = f"{name} pages, {str(dtype).removeprefix('torch.')}"
    tol = _tolerance(dtype)
    if tol is None:
        return CheckResult(KV_QUANT, Outcome.FAIL, label, "no tolerance for this dtype")
    worst, failures = Comparison(0.0, 0.0, 0), []
    for n, (kind, head, group, window, cap) in enumerate(CASES):
        what = f"{kind}, D={head}, G={group}" + (f", window {window}" if window else "") \
            + (f", cap {cap}" if cap else "")
        case = make_case(SHAPES[kind](BLOCK_SIZE), BLOCK_SIZE, head, group, dtype,
                         ctx.seed + n)
        try:
            out, cache = _run(backend, case, kv_dtype, dtype, ctx.device, window, cap)
        except Exception as exc:  # one broken case must not hide the others
            failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
            continue
        ref, _ = _run(ReferenceAttentionBackend(), case, kv_dtype, torch.float32,
                      torch.device("cpu"), window, cap)
        got = compare(out, ref.float(), tol)
        worst = max(worst, got, key=lambda c: c.worst_ratio)
        if not got.ok:
            failures.append(f"{what}: attention off by {got.max_abs_err:.2e} "
                            f"({got.nonfinite} non-finite)")
        page_error = _page_error(cache, case, kv_dtype)
        if page_error:
            failures.append(f"{what}: {page_error}")
    figure = f"max |err| {worst.max_abs_err:.1e}, tol {tol}, {len(CASES)} cases"
    if failures:
        return CheckResult(KV_QUANT, Outcome.FAIL, label, "; ".join(failures[:3]), figure)
    return CheckResult(KV_QUANT, Outcome.PASS, label, figure=figure)


def _run(backend, case, kv_dtype: torch.dtype, dtype: torch.dtype, device: torch.device,
         window: int | None, cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the prefix, then this step's forward, on ``kv_dtype`` pages."""
    cache = backend.allocate_kv_cache(case.num_blocks, case.block_size, NUM_KV_HEADS,
                                      case.head_size, kv_dtype, device)
    cache.view(torch.uint8).fill_(0x7F)  # fp8 NaN; an int8 scale of 3.4e38
    if case.prefix_batch is not None:
        meta = backend.build_metadata(batch_to(case.prefix_batch, device))
        backend.write_kv(case.prefix_key.to(device, dtype), case.prefix_value.to(device, dtype),
                         cache, meta)
    meta = backend.build_metadata(batch_to(case.batch, device))
    out = backend.forward(case.query.to(device, dtype), case.key.to(device, dtype),
                          case.value.to(device, dtype), cache, meta,
                          scale=case.head_size ** -0.5, sliding_window=window,
                          logits_soft_cap=cap)
    return out, cache


def _page_error(cache: torch.Tensor, case, kv_dtype: torch.dtype) -> str:
    """Why the written rows do not read back within the quantisation bound; '' if they do
    (or the cache is not the reference layout, which only attention can then judge)."""
    d = case.head_size
    row = kv_quant.row_size(d, kv_dtype)
    if cache.dim() != 5 or cache.shape[3:] != (NUM_KV_HEADS, row) or cache.dtype != kv_dtype:
        return ""
    slots = [case.batch.slot_mapping]
    keys, values = [case.key], [case.value]
    if case.prefix_batch is not None:
        slots.append(case.prefix_batch.slot_mapping)
        keys.append(case.prefix_key)
        values.append(case.prefix_value)
    slot = torch.cat(slots).long()
    rows = cache.cpu().view(2, -1, NUM_KV_HEADS, row)[:, slot]
    for half, x in ((0, torch.cat(keys)), (1, torch.cat(values))):
        x = x.float()
        got = kv_quant.dequantize(rows[half])
        groups = x.unflatten(-1, (d // kv_quant.GROUP, kv_quant.GROUP))  # a scale each
        if kv_dtype == torch.int8:  # the grid is the Hadamard basis's: compared there
            groups = kv_quant.hadamard16(groups)
            x = groups.flatten(-2)
            got = kv_quant.hadamard16(got.unflatten(-1, groups.shape[-2:])).flatten(-2)
        absmax = groups.abs().amax(-1, keepdim=True).expand_as(groups).flatten(-2)
        if kv_dtype == torch.int8:
            bound = absmax / 254
        else:
            bound = torch.maximum(x.abs() * 2.0**-4, absmax / 448 * 2.0**-10)
        bad = (got - x).abs() > bound * 1.01 + 1e-12
        if bad.any():
            part = "keys" if half == 0 else "values"
            return (f"{int(bad.sum())} {part} elements read back outside the "
                    f"quantisation bound (max |err| {float((got - x).abs().max()):.2e})")
    return ""
