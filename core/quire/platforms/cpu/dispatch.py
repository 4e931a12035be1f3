"""Which implementation runs each linear product: ours or oneDNN, measured.

Neither wins everywhere. On an AVX2 host our panel kernel (``csrc/panel_gemm.c``) beat
oneDNN's packed product on every layer of a small model; on an AVX-512 host oneDNN runs
Gemma 3's 262,144-row LM head 1.4x faster than our panels at 64 rows (docs/bench.md).
Which one is faster is a property of the CPU, the shape and the thread count, so it
is measured: at first start, each product that no fused decoder layer claims (the LM
head, an encoder's layers) is timed on both at one row (a lone sequence's latency) and
at 8 and 64 (a batch's throughput). Each regime gets its winner; the layer keeps one
layout when both regimes pick the same, two (one more copy of that weight) when ours
is clearly faster for one row and oneDNN for batches, as it is for SmolLM2's LM head
on an AVX-512 host. The timings are cached per host (:func:`host_key`) in
``<quire cache>/dispatch/``, so later starts only read them; timings taken while other
processes loaded the cores are cached too, so delete that folder to time again.

float32 linears inside a fused decoder layer (:mod:`~quire.platforms.cpu.fused_decode`)
stay on panels: the C layer reads them in place, and its fusion is worth more than the
product's choice. bfloat16 linears (our pair panels, ``csrc/panel_bf16.c``, against
oneDNN's bfloat16 product) are chosen for everywhere, fused layers' included, and
timed apart from float32 products of the same shape: a fused layer runs either (a
decode batch whole in C when all four of its products stayed on pair panels).

The choice itself (:func:`choose`, :func:`split_choice`) is a pure function of the
candidates (from the CPU's features: :func:`candidates`) and the timings, so tests feed
it made-up hosts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quire.platforms.cpu.isa import CpuFeatures, detect

logger = logging.getLogger(__name__)

#: Our register-blocked panel kernel (``csrc/panel_gemm.c``).
PANELS = "panels"
#: oneDNN's product on its own packed layout (``torch.ops.mkldnn``).
ONEDNN = "onednn"
#: Rows a product is timed at: a lone sequence, a small and a full decode batch
#: (prompts' LM head rows are one per sequence too).
ROWS = (1, 8, 64)
#: The two regimes chosen for apart: one row (a lone sequence's latency) and several
#: (a batch's throughput). When they pick different implementations, the layer keeps
#: both layouts (one more copy of that weight) rather than lose either.
ONE_ROW, SEVERAL_ROWS = (1,), (8, 64)
#: Another implementation replaces the incumbent (ours) only when its summed time over
#: a regime's rows is at least this fraction lower: timing noise must not flip a choice.
MARGIN = 0.05
#: Timed calls per (implementation, rows); the fastest counts.
REPEATS = 3


@dataclass(frozen=True)
class Decision:
    """One product's choice, what it was made from, and whether it was measured now."""

    site: str
    shape: tuple[int, int]
    #: the implementation of products of several rows
    chosen: str
    #: implementation -> rows -> seconds (the fastest of :data:`REPEATS` calls)
    timings: Mapping[str, Mapping[int, float]]
    cached: bool
    #: the implementation of one-row products (may differ from :attr:`chosen`)
    one_row: str = PANELS

    def describe(self) -> str:
        n, k = self.shape
        parts = "; ".join(
            f"{impl} " + ", ".join(f"{1e3 * t:.2f}" for _, t in sorted(times.items()))
            for impl, times in self.timings.items())
        rows = "/".join(str(r) for r in ROWS)
        route = (self.chosen if self.one_row == self.chosen
                 else f"{self.one_row} for one row, {self.chosen} for more")
        return (f"{self.site} [{n}x{k}] -> {route} (ms at {rows} rows: {parts}; "
                f"{'cached' if self.cached else 'measured'})")


def candidates(features: CpuFeatures, *, has_panels: bool, onednn: bool) -> tuple[str, ...]:
    """The implementations a float32 product may run on here, the incumbent first.

    Ours is the incumbent where it exists (it needs the native build's panel kernel,
    AVX2 and FMA or NEON); oneDNN is a candidate wherever torch has it. ``features``
    says what the panel kernel can use: below AVX2 on x86 there is none.
    """
    ours = has_panels and (features.machine != "x86_64" or (features.avx2 and features.fma))
    found = ((PANELS,) if ours else ()) + ((ONEDNN,) if onednn else ())
    return found


def choose(candidates: Sequence[str], timings: Mapping[str, Mapping[int, float]],
           rows: Sequence[int] = ROWS, margin: float = MARGIN) -> str:
    """The implementation to run: the first candidate, unless another's total time over
    ``rows`` is lower by at least ``margin`` (then the fastest such one). Candidates
    missing a timing at any of ``rows`` are not considered.

    :raises ValueError: when there are no candidates.
    """
    if not candidates:
        raise ValueError("no implementation to choose from")
    incumbent = candidates[0]

    def total(impl: str) -> float | None:
        times = timings.get(impl, {})
        if not all(r in times for r in rows):
            return None
        return sum(times[r] for r in rows)

    base = total(incumbent)
    if base is None:
        return incumbent
    best, best_time = incumbent, base * (1 - margin)
    for impl in candidates[1:]:
        t = total(impl)
        if t is not None and t < best_time:
            best, best_time = impl, t
    return best


def split_choice(candidates: Sequence[str],
                 timings: Mapping[str, Mapping[int, float]]) -> tuple[str, str]:
    """(several rows, one row): :func:`choose` over :data:`SEVERAL_ROWS`, then over
    :data:`ONE_ROW` with that winner as the incumbent, so one-row products move to
    another layout (a second copy of the weight) only when it is clearly faster there."""
    several = choose(candidates, timings, SEVERAL_ROWS)
    ordered = (several, *(c for c in candidates if c != several))
    return several, choose(ordered, timings, ONE_ROW)


def host_key(features: CpuFeatures, level: str, threads: int, model_name: str) -> str:
    """What the timings depend on besides the shape: the CPU (model name and features),
    the kernels' ISA level, torch's version and the thread count."""
    text = "|".join((model_name, features.machine, " ".join(sorted(features.present)), level,
                     torch.__version__, str(threads)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux), or an empty string."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in ("model name", "CPU part"):
                return value.strip()
    except OSError:
        pass
    return ""


class TimingCache:
    """Measured timings of one host, by shape, in a JSON file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, dict[str, dict[int, float]]] = {}
        try:
            raw = json.loads(path.read_text())
            self._entries = {
                shape: {impl: {int(r): float(s) for r, s in times.items()}
                        for impl, times in impls.items()}
                for shape, impls in raw.items()}
        except (OSError, ValueError, AttributeError, TypeError):
            pass  # absent or unreadable: measure again

    @staticmethod
    def shape_key(shape: tuple[int, int], dtype: str = "f32") -> str:
        return f"linear-{dtype}-{shape[0]}x{shape[1]}"

    def get(self, shape: tuple[int, int],
            dtype: str = "f32") -> dict[str, dict[int, float]] | None:
        return self._entries.get(self.shape_key(shape, dtype))

    def shapes(self, dtype: str = "f32") -> list[tuple[int, int]]:
        """The shapes with timings for ``dtype`` products, in the file's order."""
        prefix = f"linear-{dtype}-"
        return [tuple(int(n) for n in key.removeprefix(prefix).split("x"))
                for key in self._entries if key.startswith(prefix)]

    def put(self, shape: tuple[int, int], timings: Mapping[str, Mapping[int, float]],
            dtype: str = "f32") -> None:
        self._entries[self.shape_key(shape, dtype)] = {i: dict(t) for i, t in timings.items()}

    def save(self) -> None:
        """Write atomically (a concurrent start reads all or nothing); failures only
        cost a measurement next time."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._entries, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.info("cpu platform: dispatch timings not cached (%s)", exc)


def time_product(run: Callable[[torch.Tensor], object], in_features: int,
                 rows: Sequence[int] = ROWS, repeats: int = REPEATS,
                 dtype: torch.dtype = torch.float32) -> dict[int, float]:
    """The fastest of ``repeats`` calls of ``run`` on random rows of ``dtype``, per row
    count (after one warm-up call each)."""
    result: dict[int, float] = {}
    for r in rows:
        x = torch.randn(r, in_features).to(dtype)
        run(x)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            run(x)
            best = min(best, time.perf_counter() - start)
        result[r] = best
    return result


def dispatch_linears(model: nn.Module, cache: TimingCache | None,
                     features: CpuFeatures | None = None,
                     forced: str | None = None, *, bfloat16: bool = False) -> list[Decision]:
    """Choose, for every packed float32 linear of ``model`` outside a fused decoder
    layer (with ``bfloat16``: every packed bfloat16 linear, fused layers' included),
    between our panels and oneDNN, and keep only the winner's layout.

    bfloat16 products are chosen for everywhere, and before the fused layers are
    installed (:mod:`~quire.platforms.cpu.fused_decode` then runs a decode batch's layer
    in one C call where all four of its products stay on our pair panels, and each
    product on its own kernel otherwise): neither implementation of them is the C
    layer's only way, and on a host with AMX oneDNN's tiles should beat our vdpbf16ps.

    :param cache: timings measured earlier on this host (read, then updated); None to
        measure without caching.
    :param forced: ``panels`` or ``onednn`` to skip measuring (the ``linear_impl``
        option); a forced implementation the layer cannot run is ignored.
    :returns: one decision per product considered, also logged.
    """
    from quire.platforms.cpu.packed_linear import PackedLinear, onednn_available

    features = features if features is not None else detect()
    has_onednn = onednn_available()
    dtype = torch.bfloat16 if bfloat16 else torch.float32
    tag = "bf16" if bfloat16 else "f32"
    decisions: list[Decision] = []
    sites = _all_linears(model) if bfloat16 else _unfused_linears(model)
    for name, module in sites:
        kernel = module.kernel
        if (not isinstance(kernel, PackedLinear) or kernel.panels is None
                or kernel.dtype != dtype):
            continue
        found = candidates(features, has_panels=True, onednn=has_onednn)
        if len(found) < 2:
            continue
        shape = (kernel.out_features, kernel.in_features)
        timings = cache.get(shape, tag) if cache is not None else None
        cached = timings is not None and all(set(ROWS) <= set(timings.get(i, ())) for i in found)
        if forced in found:
            chosen = one_row = forced
            timings = timings or {}
        else:
            if not cached:
                timings = _measure(kernel, found)
                if cache is not None:
                    cache.put(shape, timings, tag)
            chosen, one_row = split_choice(found, timings)
        if chosen == ONEDNN:
            kernel.use_onednn(keep_panels=one_row == PANELS)
        decisions.append(Decision(name, shape, chosen, timings, cached, one_row))
    if cache is not None and any(not d.cached for d in decisions):
        cache.save()
    for decision in decisions:
        logger.info("cpu platform: linear %s", decision.describe())
    return decisions


def _measure(kernel: object, found: Sequence[str]) -> dict[str, dict[int, float]]:
    """Time each implementation of ``kernel``'s product (oneDNN on a temporary packed
    copy, released before returning)."""
    timings: dict[str, dict[int, float]] = {}
    for impl in found:
        run = kernel.runner(impl)
        timings[impl] = time_product(run, kernel.in_features, dtype=kernel.dtype)
        del run
    return timings


def _all_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every linear site of ``model``."""
    return [(name, m) for name, m in model.named_modules()
            if getattr(m, "op_site", None) == "linear"]


def _unfused_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Linear sites not inside a module whose kernel is a fused decoder layer."""
    from quire.platforms.cpu.fused_decode import FusedDecodeLayer

    fused = [name for name, m in model.named_modules()
             if isinstance(getattr(m, "kernel", None), FusedDecodeLayer)]
    return [(name, m) for name, m in model.named_modules()
            if getattr(m, "op_site", None) == "linear"
            and not any(name.startswith(prefix + ".") for prefix in fused)]


def describe_cache(cache: TimingCache, features: CpuFeatures, has_panels: bool,
                   onednn: bool, limit: int = 6) -> list[str]:
    """What a start on this host would choose for each shape already timed here (for
    ``quire plugins``); one line when nothing was timed yet."""
    found = candidates(features, has_panels=has_panels, onednn=onednn)
    if len(found) < 2:
        return [f"linear products: {found[0] if found else 'torch'} (nothing to choose "
                f"between on this host)"]
    shapes = [(tag, shape) for tag in ("f32", "bf16") for shape in cache.shapes(tag)]
    if not shapes:
        return [f"linear products (float32 outside fused layers, bfloat16 everywhere): "
                f"{' or '.join(found)}, timed at the first start ({cache.path})"]
    shapes.sort(key=lambda item: -item[1][0] * item[1][1])  # the costliest first
    lines = []
    for tag, (n, k) in shapes[:limit]:
        timings = cache.get((n, k), tag)
        several, one = split_choice(found, timings)
        route = several if one == several else f"{one} for one row, {several} for more"
        name = "linear" if tag == "f32" else "linear bf16"
        lines.append(f"{name} [{n}x{k}]: {route} (timed here)")
    if len(shapes) > limit:
        lines.append(f"... and {len(shapes) - limit} smaller shapes ({cache.path})")
    return lines
