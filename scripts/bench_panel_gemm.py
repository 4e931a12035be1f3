"""The float32 panel GEMM (csrc/panel_gemm.c) on SmolLM2's products, A/B against a
baseline revision of that file, in GFLOP/s.

``OMP_WAIT_POLICY=PASSIVE python scripts/bench_panel_gemm.py --baseline-rev REV`` builds
two libraries of one ISA level (default: the best this CPU runs) from this checkout's
``csrc/``, one with ``panel_gemm.c`` as it is and one with ``git show REV:...`` in its
place, then times both on every shape, row count and thread count, the two interleaved
round after round (a shared host's load hits both alike); each cell keeps its best round.
Times the library's ``quire_panel_gemm_f32`` entry itself (output allocated once),
threads set as the platform's ``threads`` option sets them.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch
from kernel_ab import add_arguments, best_seconds, level_of, libraries
from quire.platforms.cpu.native import NativeKernels
from quire.platforms.cpu.threads import configure_threads

#: SmolLM2-135M's float32 products, (name, K, N)
SHAPES = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576))
ROWS = (1, 8, 64, 256, 2048)


def _entry(library: ctypes.CDLL):
    entry = library.quire_panel_gemm_f32
    entry.restype = ctypes.c_int
    entry.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return entry


def _time(entry, x, panels, n, y, budget_s: float) -> float:
    args = (x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), n, None, y.data_ptr())
    return best_seconds(lambda: entry(*args), budget_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, "panel_gemm.c", rounds=3)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = parser.parse_args()
    level = level_of(args)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, k, n in SHAPES:
        panels = NativeKernels.pack_panels(torch.randn(n, k, generator=gen))
        for rows in args.rows:
            cases.append((name, k, n, rows, panels, torch.randn(rows, k, generator=gen),
                          torch.empty(rows, n)))
    best: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {which: _entry(lib) for which, lib in
                libraries(args.baseline_rev, ["panel_gemm.c"], level, Path(tmp)).items()}
        for _ in range(args.rounds):
            for threads in args.threads:
                configure_threads(threads)
                for name, k, n, rows, panels, x, y in cases:
                    for which, entry in libs.items():
                        took = _time(entry, x, panels, n, y, args.budget)
                        key = (threads, name, rows, which)
                        best[key] = min(best.get(key, float("inf")), took)
    print(f"level {level.name}, baseline {args.baseline_rev}, best of {args.rounds} rounds")
    print("threads  product       K     N  rows   base GF/s  new GF/s  new/base")
    for threads in args.threads:
        for name, k, n, rows, *_ in cases:
            flops = 2.0 * rows * k * n
            base = flops / best[(threads, name, rows, "base")] / 1e9
            new = flops / best[(threads, name, rows, "new")] / 1e9
            print(f"{threads:7d}  {name:8s} {k:6d} {n:5d} {rows:5d} {base:11.1f} "
                  f"{new:9.1f} {new / base:9.2f}")


if __name__ == "__main__":
    main()
