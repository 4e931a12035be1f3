"""Products of 1 to 4 float32 rows on quantised blocks (csrc/quant_gemm.c's direct path,
a decode step's products) at SmolLM2-135M's and Llama-3.2-1B's shapes, A/B against a
baseline revision of that file, in giga-weights read per second.

``OMP_WAIT_POLICY=PASSIVE python scripts/bench_quant_rows.py --baseline-rev REV`` builds
two libraries of one ISA level (default: the best this CPU runs) from this checkout's
``csrc/``, one with ``quant_gemm.c`` as it is and one with ``git show REV:...`` in its
place, then times ``quire_quant_gemm_f32`` of both on every format, shape, row count and
thread count, interleaved round after round; each cell keeps its best round. The
weights are random blocks (``quire.quantization.random``); ``lm_head`` is SmolLM2's
tied embedding, Q8_0 in its GGUF file.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch
from kernel_ab import add_arguments, best_seconds, level_of, libraries
from quire.platforms.cpu.threads import configure_threads
from quire.quantization.random import random_quantized

#: (name, K, N): SmolLM2-135M's products, then Llama-3.2-1B's MLP
SHAPES = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("lm_head", 576, 49152), ("1b_qkv", 2048, 3072), ("1b_gate_up", 2048, 16384),
          ("1b_down", 8192, 2048))
FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
FORMATS_BLOCK = {"q4_k": 256, "q5_k": 256, "q6_k": 256}


def quant_entry(library: ctypes.CDLL, name: str = "quire_quant_gemm_f32"):
    """A product entry of quant_gemm.c taking float32 rows (``quire_quant_gemm_f32``,
    ``quire_quant_gemm_bf16_f32``): (format, x, m, k, w, w_stride, n, row_scales, bias,
    y, ldy)."""
    entry = getattr(library, name)
    entry.restype = ctypes.c_int
    entry.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return entry


def time_ab(libs: dict, w, x: torch.Tensor, y: torch.Tensor, budget_s: float, best: dict,
            key: tuple) -> None:
    """Each library's entry (:func:`quant_entry`) on ``y = x W^T``, its best seconds kept
    in ``best[(*key, which)]``."""
    rows, k = x.shape
    n = y.shape[1]
    call = (w.format.id, x.data_ptr(), rows, k, w.data.data_ptr(), w.data.stride(0), n, None,
            None, y.data_ptr(), n)
    for which, entry in libs.items():
        took = best_seconds(lambda e=entry: e(*call), budget_s)
        best[(*key, which)] = min(best.get((*key, which), float("inf")), took)


def weights(formats: list[str], shapes: list[str], gen: torch.Generator):
    """(format, shape name, K, N, random weight) for each format and named shape whose
    K is whole blocks of it (SmolLM2's widths are not whole K-format blocks)."""
    for fmt in formats:
        for name, k, n in SHAPES:
            if name in shapes and k % FORMATS_BLOCK.get(fmt, 32) == 0:
                yield fmt, name, k, n, random_quantized(fmt, n, k, gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, "quant_gemm.c", rounds=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    args = parser.parse_args()
    level = level_of(args)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for fmt, name, k, n, w in weights(args.formats, args.shapes, gen):
        for rows in args.rows:
            cases.append((fmt, name, k, n, rows, w, torch.randn(rows, k, generator=gen),
                          torch.empty(rows, n)))
    best: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {which: quant_entry(lib) for which, lib in
                libraries(args.baseline_rev, ["quant_gemm.c"], level, Path(tmp)).items()}
        for _ in range(args.rounds):
            for threads in args.threads:
                configure_threads(threads)
                for fmt, name, k, n, rows, w, x, y in cases:
                    time_ab(libs, w, x, y, args.budget, best, (threads, fmt, name, rows))
    print(f"level {level.name}, baseline {args.baseline_rev}, best of {args.rounds} rounds")
    print("threads  format  product        K      N  rows  base Gw/s  new Gw/s  new/base")
    for threads in args.threads:
        for fmt, name, k, n, rows, *_ in cases:
            base = k * n / best[(threads, fmt, name, rows, "base")] / 1e9
            new = k * n / best[(threads, fmt, name, rows, "new")] / 1e9
            print(f"{threads:7d}  {fmt:6s}  {name:11s} {k:6d} {n:6d} {rows:5d} {base:10.2f} "
                  f"{new:9.2f} {new / base:9.2f}")


if __name__ == "__main__":
    main()
