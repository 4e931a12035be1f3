"""The checks that need no second process: platform contract, KV write, paged attention,
memory profiler. (The communicator check is in :mod:`~quire.conformance.collectives`, the
end-to-end check in :mod:`~quire.conformance.end_to_end`.)

Each check is a function ``(CheckContext) -> list[CheckResult]``. It reports what it
measured; an exception escaping it is turned into a FAIL by the runner. The reference for
every comparison is the cpu platform's backend, run on the host in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from quire.conformance.cases import (
    NUM_KV_HEADS,
    SHAPES,
    Case,
    batch_to,
    make_case,
    new_cache,
    run_case,
)
from quire.conformance.context import CheckContext
from quire.conformance.report import CheckResult, Outcome
from quire.conformance.tolerances import Comparison, attention_tolerance, compare
from quire.interfaces.attention import AttentionBackend
from quire.interfaces.memory import MemoryProfiler
from quire.interfaces.platform import Availability
from quire.ops.attention import ReferenceAttentionBackend

PLATFORM = "platform contract"
KV_WRITE = "kv write"
ATTENTION = "paged attention"
MEMORY = "memory profiler"

#: Head sizes every backend must handle, and the small one it may refuse.
REQUIRED_HEAD_SIZES = (64, 128)
OPTIONAL_HEAD_SIZES = (16,)
GQA_GROUPS = (1, 2, 4)
#: (sliding window on, soft cap on): every batch kind meets each, in every row.
FEATURES = ((False, False), (True, False), (False, True), (True, True))
SOFT_CAP = 2.0
#: The tensor the memory check allocates (smaller when little memory is free).
PROBE_BYTES = 64 << 20

_MIB = 1 << 20
_MISSING = object()
#: Records one property: ``expect(holds, problem_if_not)``.
Expect = Callable[[bool, str], None]


# -- platform contract ---------------------------------------------------------------------


def check_platform_contract(ctx: CheckContext) -> list[CheckResult]:
    """Attributes present and typed, name as requested, availability well-formed,
    check_dtype accepting what is declared and rejecting what is not."""
    p = ctx.platform
    problems: list[str] = []
    checked = 0

    def expect(ok: bool, problem: str) -> None:
        nonlocal checked
        checked += 1
        if not ok:
            problems.append(problem)

    name = getattr(p, "name", _MISSING)
    expect(isinstance(name, str) and bool(name) and name == name.lower(),
           f"name {name!r} is not a non-empty lower-case string")
    expect(name == ctx.expected_name, f"name {name!r} is not the requested {ctx.expected_name!r}")
    device_type = getattr(p, "device_type", _MISSING)
    expect(isinstance(device_type, str) and bool(device_type),
           f"device_type {device_type!r} is not a non-empty string")
    env = getattr(p, "visible_devices_env", _MISSING)
    expect(env is None or (isinstance(env, str) and env.isidentifier()),
           f"visible_devices_env {env!r} is neither None nor a variable name")
    backend = getattr(p, "distributed_backend", _MISSING)
    expect(isinstance(backend, str) and bool(backend),
           f"distributed_backend {backend!r} is not a non-empty string")
    dtypes: Any = getattr(p, "supported_dtypes", _MISSING)
    dtypes_ok = (isinstance(dtypes, tuple) and len(dtypes) > 0 and len(set(dtypes)) == len(dtypes)
                 and all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes))
    expect(dtypes_ok, f"supported_dtypes {dtypes!r} is not a non-empty tuple of distinct "
                      "floating torch dtypes")
    block = getattr(p, "default_block_size", _MISSING)
    expect(type(block) is int and block >= 1, f"default_block_size {block!r} is not an int >= 1")
    priority = getattr(p, "priority", _MISSING)
    expect(type(priority) is int, f"priority {priority!r} is not an int")
    available = _check_availability(p, expect)
    if dtypes_ok:
        _check_dtype_rule(p, dtypes, expect)
    if available and not ctx.kernels_only:
        device = p.device(0)
        expect(isinstance(device, torch.device) and device.type == device_type,
               f"device(0) returned {device!r}, not a torch.device of type {device_type!r}")
    if problems:
        return [CheckResult(PLATFORM, Outcome.FAIL, reason="; ".join(problems),
                            figure=f"{len(problems)} of {checked} properties wrong")]
    return [CheckResult(PLATFORM, Outcome.PASS, figure=f"{checked} properties")]


def _check_availability(p: Any, expect: Expect) -> bool:
    try:
        first = p.availability()
        second = p.is_available()
    except Exception as exc:  # the contract says never raise; that is the finding
        expect(False, f"availability() raised {type(exc).__name__}: {exc}")
        return False
    expect(isinstance(first, Availability), f"availability() returned {first!r}, "
                                            "not an Availability")
    if not isinstance(first, Availability):
        return False
    expect(first.available or bool(first.reason), "availability() is false without a reason")
    expect(bool(second) == bool(first), "is_available() disagrees with availability()")
    return first.available


def _check_dtype_rule(p: Any, dtypes: tuple[torch.dtype, ...], expect: Expect) -> None:
    for dtype in dtypes:
        try:
            p.check_dtype(dtype)
        except ValueError as exc:
            expect(False, f"check_dtype rejects its own supported {dtype}: {exc}")
    candidates = (torch.float64, torch.float16, torch.bfloat16, torch.float32, torch.int8)
    unsupported = next(d for d in candidates if d not in dtypes)
    try:
        p.check_dtype(unsupported)
    except ValueError:
        expect(True, "")
    else:
        expect(False, f"check_dtype accepts {unsupported}, which is not declared")


# -- shared by the kernel checks -----------------------------------------------------------


def make_backend(ctx: CheckContext, check: str) -> AttentionBackend | CheckResult:
    """The platform's backend, or the row that explains why there is none."""
    try:
        backend = ctx.platform.make_attention_backend()
    except Exception as exc:  # reported, not raised: the table names the check
        error = f"make_attention_backend() raised {type(exc).__name__}: {exc}"
        if ctx.kernels_only:  # the kernels may need what is absent; not a contract breach
            return CheckResult(check, Outcome.NOT_AVAILABLE, reason=error)
        return CheckResult(check, Outcome.FAIL, reason=error)
    if not isinstance(backend, AttentionBackend):
        return CheckResult(check, Outcome.FAIL, reason=f"make_attention_backend() returned "
                           f"{type(backend).__name__}, not an AttentionBackend")
    return backend


def reference(case: Case, *, scale: float, sliding_window: int | None = None,
              logits_soft_cap: float | None = None) -> torch.Tensor:
    """The cpu reference's output for ``case``, float32 on the host."""
    return run_case(ReferenceAttentionBackend(), case, torch.float32, torch.device("cpu"),
                    scale=scale, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap).float()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- KV write ------------------------------------------------------------------------------


def check_kv_write(ctx: CheckContext) -> list[CheckResult]:
    """Per dtype: two steps of ``write_kv`` change exactly the written elements, to exactly
    the written values; every slot reads back through the backend's own ``attend`` (with
    ``sliding_window=1`` a query sees only its own slot, so the output *is* that slot's
    value); ``attend`` changes nothing; attention over the written cache matches the
    reference. Nothing here depends on the layout.
    """
    backend = make_backend(ctx, KV_WRITE)
    if isinstance(backend, CheckResult):
        return [backend]
    return [_kv_write_row(ctx, backend, dtype) for dtype in ctx.dtypes]


def _kv_write_row(ctx: CheckContext, backend: AttentionBackend, dtype: torch.dtype) -> CheckResult:
    bs, group, head = ctx.block_sizes[0], 2, 64
    case_name = f"{_dtype_name(dtype)}, block {bs}"
    # step A writes three prompts; step B continues each (decode, chunk, two tokens)
    shapes = [(bs + 3, 1), (2, bs), (2 * bs, 2)]
    case = make_case(shapes, bs, head, group, dtype, seed=ctx.seed + 17)
    if case.prefix_batch is None:  # every shape above has a cached part
        raise RuntimeError("the kv write case lost its first step")
    dev, tol, scale = ctx.device, attention_tolerance(dtype), head**-0.5
    cache = new_cache(backend, case, dtype, dev)
    steps = (
        (batch_to(case.prefix_batch, dev), case.prefix_key.to(dev), case.prefix_value.to(dev)),
        (batch_to(case.batch, dev), case.key.to(dev), case.value.to(dev)),
    )
    problems: list[str] = []
    for name, (batch, key, value) in zip("AB", steps):
        before, inputs = _bits(cache), (key.clone(), value.clone())
        backend.write_kv(key, value, cache, backend.build_metadata(batch))
        problem = _changed_exactly(before, cache, key, value)
        if problem:
            problems.append(f"step {name}: {problem}")
        if not (torch.equal(key, inputs[0]) and torch.equal(value, inputs[1])):
            problems.append(f"step {name}: write_kv changed its key/value inputs")

    gen = torch.Generator().manual_seed(ctx.seed + 18)
    read_back = Comparison(0.0, 0.0, 0)
    before = _bits(cache)
    for name, (batch, _, value) in zip("AB", steps):
        query = torch.randn(batch.num_tokens, NUM_KV_HEADS * group, head, generator=gen)
        # metadata belongs to one step, so each read is a step of its own
        md = backend.build_metadata(batch)
        out = backend.attend(query.to(dev, dtype), cache, md, scale=scale, sliding_window=1)
        expected = value.float().cpu().repeat_interleave(group, dim=1)  # head h reads h // G
        cmp = compare(out, expected, tol)
        read_back = max(read_back, cmp, key=lambda c: c.worst_ratio)
        if not cmp.ok:
            problems.append(f"step {name}: reading the written values back (sliding_window=1) "
                            f"is off by up to {cmp.max_abs_err:.2e} ({cmp.nonfinite} non-finite)")
    out = backend.attend(case.query.to(dev), cache, backend.build_metadata(steps[1][0]),
                         scale=scale)
    if not torch.equal(_bits(cache), before):
        problems.append("attend changed the cache")
    attn = compare(out, reference(case, scale=scale), tol)
    if not attn.ok:
        problems.append(f"attention over the written cache is off by up to "
                        f"{attn.max_abs_err:.2e} ({attn.nonfinite} non-finite)")
    figure = (f"{2 * (case.prefix_key.numel() + case.key.numel())} elements written; "
              f"read-back max |err| {read_back.max_abs_err:.1e}, attention "
              f"{attn.max_abs_err:.1e} ({attn.worst_ratio:.0%} of tol {tol})")
    if problems:
        return CheckResult(KV_WRITE, Outcome.FAIL, case_name, "; ".join(problems), figure)
    return CheckResult(KV_WRITE, Outcome.PASS, case_name, figure=figure)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """The cache's raw bits as integers: NaN equals NaN, so "unchanged" is exact."""
    return cache.detach().contiguous().view(_INT_OF_SIZE[cache.element_size()]).clone()


def _changed_exactly(
    before: torch.Tensor, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> str | None:
    """Whether exactly ``2 * key.numel()`` elements changed, to exactly the K and V values
    (as a multiset: the layout decides where, the read-back decides whether correctly)."""
    changed = (_bits(cache) != before).flatten()
    expected = 2 * key.numel()
    if int(changed.sum()) != expected:
        return (f"write_kv changed {int(changed.sum())} cache elements, expected {expected} "
                "(2 x tokens x kv heads x head size)")
    stored = cache.detach().contiguous().flatten()[changed].float().cpu().sort().values
    written = torch.cat([key.flatten(), value.flatten()]).float().cpu().sort().values
    if not torch.equal(stored, written):
        return "the changed cache elements are not the written key/value values"
    return None


# -- paged attention -----------------------------------------------------------------------


def check_paged_attention(ctx: CheckContext) -> list[CheckResult]:
    """Per dtype and block size, 20 cases (:func:`attention_cases`): decode-only,
    prefill-only, mixed and verification (a few query tokens after a cached context:
    speculative decoding's drafts) batches, each with every combination of sliding window and
    soft cap, at head sizes 64 and 128 and GQA groups 1, 2 and 4, plus one case per
    batch kind at the small head size 16."""
    backend = make_backend(ctx, ATTENTION)
    if isinstance(backend, CheckResult):
        return [backend]
    return [
        _attention_row(ctx, backend, dtype, block_index)
        for dtype in ctx.dtypes
        for block_index in range(len(ctx.block_sizes))
    ]


def attention_cases(block_index: int) -> list[tuple[str, int, int, bool, bool]]:
    """``(batch kind, head size, GQA group, window on, soft cap on)`` for one row.

    Every (kind, feature) pair appears in every row, so a backend that refuses the extra
    block sizes and the small head size is still tested on every feature; head sizes and
    groups rotate so every kind meets each of them too.
    """
    cases = []
    for k, kind in enumerate(SHAPES):
        for f, (window, cap) in enumerate(FEATURES):
            head = REQUIRED_HEAD_SIZES[(k + f) % len(REQUIRED_HEAD_SIZES)]
            group = GQA_GROUPS[(k + f + block_index) % len(GQA_GROUPS)]
            cases.append((kind, head, group, window, cap))
        for head in OPTIONAL_HEAD_SIZES:
            window, cap = FEATURES[(k + block_index) % len(FEATURES)]
            cases.append((kind, head, GQA_GROUPS[k % len(GQA_GROUPS)], window, cap))
    return cases


def _attention_row(
    ctx: CheckContext, backend: AttentionBackend, dtype: torch.dtype, block_index: int
) -> CheckResult:
    bs = ctx.block_sizes[block_index]
    tol = attention_tolerance(dtype)
    case_name = f"{_dtype_name(dtype)}, block {bs}"
    worst, ran, refused, failures = Comparison(0.0, 0.0, 0), 0, [], []
    for n, (kind, head, group, window_on, cap_on) in enumerate(attention_cases(block_index)):
        window = bs // 2 + 3 if window_on else None
        cap = SOFT_CAP if cap_on else None
        label = f"{kind}, head {head}, gqa {group}" + (f", window {window}" if window else "") \
            + (f", softcap {cap}" if cap else "")
        case = make_case(SHAPES[kind](bs), bs, head, group, dtype,
                         seed=ctx.seed * 1000 + block_index * 100 + n)
        options = {"scale": head**-0.5, "sliding_window": window, "logits_soft_cap": cap}
        try:
            out = run_case(backend, case, dtype, ctx.device, **options)
        except ValueError as exc:
            if block_index > 0 or head in OPTIONAL_HEAD_SIZES:
                refused.append(f"{label}: {exc}")
            else:
                failures.append(f"{label}: refused ({exc}), but the default block size "
                                "and head sizes 64 and 128 are required")
            continue
        except Exception as exc:  # one broken case must not hide the others
            failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
            continue
        ran += 1
        if out.shape != case.query.shape or out.dtype != dtype:
            failures.append(f"{label}: returned {tuple(out.shape)} {out.dtype}, expected "
                            f"{tuple(case.query.shape)} {dtype}")
            continue
        cmp = compare(out, reference(case, **options), tol)
        worst = max(worst, cmp, key=lambda c: c.worst_ratio)
        if not cmp.ok:
            failures.append(f"{label}: max |err| {cmp.max_abs_err:.2e}"
                            + (f", {cmp.nonfinite} non-finite" if cmp.nonfinite else ""))
    figure = (f"max |err| {worst.max_abs_err:.1e}, {worst.worst_ratio:.0%} of tol {tol}; "
              f"{ran} cases")
    if refused:
        figure += f", {len(refused)} refused"
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(ATTENTION, Outcome.FAIL, case_name, failures[0] + more, figure)
    if ran == 0:
        return CheckResult(ATTENTION, Outcome.NOT_RUN, case_name,
                           f"the backend refused every case: {refused[0]}")
    return CheckResult(ATTENTION, Outcome.PASS, case_name, figure=figure)


# -- memory profiler -----------------------------------------------------------------------


def check_memory_profiler(ctx: CheckContext) -> list[CheckResult]:
    """Readings consistent (0 < free <= total), the peak rises by an allocation made on the
    platform's device, and the KV budget and page count respect what they were given."""
    profiler = ctx.platform.make_memory_profiler(0)
    if not isinstance(profiler, MemoryProfiler):
        return [CheckResult(MEMORY, Outcome.FAIL, reason=f"make_memory_profiler() returned "
                            f"{type(profiler).__name__}, not a MemoryProfiler")]
    problems: list[str] = []
    total, free = profiler.total_memory(), profiler.free_memory()
    if not (isinstance(total, int) and isinstance(free, int) and 0 < free <= total):
        problems.append(f"readings violate 0 < free <= total: free={free!r}, total={total!r}")
        return [CheckResult(MEMORY, Outcome.FAIL, reason=problems[0])]
    size = min(PROBE_BYTES, free // 8)
    held: list[torch.Tensor] = []  # kept until the peak is read: some peaks see only live memory
    rise = profiler.profile(lambda: held.append(_touched(size, ctx)))
    if rise < 0.9 * size:
        problems.append(f"the peak rose by {rise} bytes after {size} bytes were allocated "
                        f"on {ctx.device}")
    held.clear()
    problems += _budget_problems(profiler, ctx, free)
    figure = (f"free {free / _MIB:.0f} of {total / _MIB:.0f} MiB; peak +{rise / _MIB:.1f} MiB "
              f"for {size / _MIB:.1f} MiB")
    if problems:
        return [CheckResult(MEMORY, Outcome.FAIL, reason="; ".join(problems), figure=figure)]
    return [CheckResult(MEMORY, Outcome.PASS, figure=figure)]


def _touched(size: int, ctx: CheckContext) -> torch.Tensor:
    tensor = torch.ones(size // 4, dtype=torch.float32, device=ctx.device)  # written: resident
    ctx.platform.synchronize()
    return tensor


def _with_most_free(profiler: MemoryProfiler, call: Callable[[], int],
                    free: int) -> tuple[int, int]:
    """``call()`` and the largest free-memory reading taken around it (and ``free``)."""
    before = profiler.free_memory()
    result = call()
    return result, max(free, before, profiler.free_memory())


def _budget_problems(profiler: MemoryProfiler, ctx: CheckContext, free: int) -> list[str]:
    problems = []
    # Free memory moves with other processes, also between the readings taken around a
    # call and the one the call takes itself (a CI run failed on 30 KiB of that). So
    # compare against the largest reading around each call, plus 1%: a platform that
    # ignores the fraction or over-grants is off by far more than that.
    default, free_default = _with_most_free(profiler, lambda: profiler.kv_budget(None), free)
    half, free_half = _with_most_free(profiler, lambda: profiler.kv_budget(0.5), free)
    if not 0 < default <= free_default + free_default // 100:
        problems.append(f"kv_budget(None)={default} is not within (0, free={free_default}]")
    if not 0 < half <= (free_half + free_half // 100) // 2 + 1:
        problems.append(f"kv_budget(0.5)={half} exceeds half of free={free_half}")
    if profiler.kv_budget(_MIB) != _MIB:
        problems.append(f"kv_budget({_MIB}) did not grant exactly {_MIB} bytes")
    try:
        profiler.kv_budget(4 * profiler.total_memory())
        problems.append("kv_budget accepted four times the device's memory")
    except ValueError:
        pass
    # a page of a Llama-8B-sized model: 32 layers, 8 KV heads of 128
    per_block = 2 * ctx.block_sizes[0] * 8 * 128 * ctx.dtypes[0].itemsize * 32
    n = profiler.num_kv_blocks(default, per_block)
    if not n * per_block <= default < (n + 1) * per_block:
        problems.append(f"num_kv_blocks gave {n} pages of {per_block} bytes for {default} bytes")
    try:
        profiler.num_kv_blocks(per_block - 1, per_block)
        problems.append("num_kv_blocks granted a page that does not fit the budget")
    except ValueError:
        pass
    return problems
