"""Batched products on quantised blocks with bfloat16 activations (csrc/quant_gemm.c's
pair-panel path, on AMX tiles where the CPU has them: a prompt step's and a large
decode batch's products), A/B against a baseline revision, in GFLOP/s, beside oneDNN's
bfloat16 product on the same weights dequantised (what a bfloat16 checkpoint runs).

``OMP_WAIT_POLICY=PASSIVE python scripts/bench_quant_batch.py --baseline-rev REV``
builds two libraries of one ISA level (default: the best this CPU runs; it needs
avx512_bf16) from this checkout's ``csrc/``, one with ``quant_gemm.c`` and
``amx_tiles.c`` as they are and one with ``git show REV:...`` in their place, then times
``quire_quant_gemm_bf16_f32`` (float32 rows rounded in the call, as a model's layers
call it) of both on every format, shape, row count and thread count, interleaved round
after round; each cell keeps its best round. The weights are random blocks
(``quire.quantization.random``); the shapes are SmolLM2-135M's and Llama-3.2-1B's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_quant_rows import quant_entry, time_ab, weights
from kernel_ab import add_arguments, best_seconds, level_of, libraries
from quire.platforms.cpu.threads import configure_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, "quant_gemm.c and amx_tiles.c", rounds=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--formats", nargs="+", default=["q4_1", "q4_k", "q6_k", "q8_0"])
    parser.add_argument("--shapes", nargs="+",
                        default=["qkv", "o", "gate_up", "down", "1b_qkv", "1b_down"])
    args = parser.parse_args()
    level = level_of(args)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for fmt, name, k, n, w in weights(args.formats, args.shapes, gen):
        dense = w.dequantize().to(torch.bfloat16)
        for rows in args.rows:
            cases.append((fmt, name, k, n, rows, w, dense,
                          torch.randn(rows, k, generator=gen), torch.empty(rows, n)))
    best: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {which: quant_entry(lib, "quire_quant_gemm_bf16_f32") for which, lib in
                libraries(args.baseline_rev, ["quant_gemm.c", "amx_tiles.c"], level,
                          Path(tmp)).items()}
        for _ in range(args.rounds):
            for threads in args.threads:
                configure_threads(threads)
                for fmt, name, k, n, rows, w, dense, x, y in cases:
                    time_ab(libs, w, x, y, args.budget, best, (threads, fmt, name, rows))
                    xb = x.to(torch.bfloat16)
                    took = best_seconds(lambda a=xb, b=dense: F.linear(a, b), args.budget)
                    key = (threads, fmt, name, rows, "onednn")
                    best[key] = min(best.get(key, float("inf")), took)
    print(f"level {level.name}, baseline {args.baseline_rev}, best of {args.rounds} rounds, "
          "GFLOP/s")
    print("threads  format  product        K      N  rows    base     new  new/base  oneDNN")
    for threads in args.threads:
        for fmt, name, k, n, rows, *_ in cases:
            flops = 2 * rows * k * n / 1e9
            base, new, onednn = (flops / best[(threads, fmt, name, rows, which)]
                                 for which in ("base", "new", "onednn"))
            print(f"{threads:7d}  {fmt:6s}  {name:11s} {k:6d} {n:6d} {rows:5d} {base:7.0f} "
                  f"{new:7.0f} {new / base:9.2f} {onednn:7.0f}")


if __name__ == "__main__":
    main()
