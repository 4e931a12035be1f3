"""The bfloat16 pair-panel GEMM (csrc/panel_bf16.c) against oneDNN's bfloat16 product on
SmolLM2's shapes, in GFLOP/s.

``python scripts/bench_bf16_gemm.py [--threads 1 2] [--rounds 3]`` loads the kernels
at the best ISA level this CPU runs (it needs avx512_bf16), packs random bfloat16
weights both ways (our pair panels; oneDNN's layout for 64 rows, as
packed_linear.py packs them) and times both entries on every shape, row count and
thread count, interleaved round after round; each cell keeps its best round. Ours is
timed through the library's ``quire_bf16_linear`` (bfloat16 out, output allocated
once), oneDNN through ``torch.ops.mkldnn._linear_pointwise``.
"""

from __future__ import annotations

import argparse

import torch
from kernel_ab import best_seconds
from quire.platforms.cpu.native import load_native_kernels
from quire.platforms.cpu.threads import configure_threads

#: SmolLM2-135M's products, (name, K, N)
SHAPES = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("lm_head", 576, 49152))
ROWS = (1, 8, 64, 256, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.2,
                        help="seconds of calls per cell and round")
    args = parser.parse_args()
    native = load_native_kernels()
    if native is None or not native.has_bf16_gemm:
        raise SystemExit("this CPU's kernels have no bfloat16 pair-panel GEMM "
                         "(it needs the avx512_bf16 level)")
    entry = native._bf16_linear
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, k, n in SHAPES:
        weight = torch.randn(n, k, generator=gen).bfloat16()
        panels = native.pack_bf16_panels(weight)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        for rows in args.rows:
            if name == "lm_head" and rows > 64:  # prompts' LM head rows are one each
                continue
            x = torch.randn(rows, k, generator=gen).bfloat16()
            cases.append((name, k, n, rows, x, panels, packed,
                          torch.empty(rows, n, dtype=torch.bfloat16)))
    best: dict = {}
    for _ in range(args.rounds):
        for threads in args.threads:
            configure_threads(threads)
            for name, k, n, rows, x, panels, packed, y in cases:
                ours = (x.data_ptr(), rows, k, panels.data_ptr(), n, None, y.data_ptr(), 1)
                calls = {
                    "ours": lambda: entry(*ours),
                    "onednn": lambda: torch.ops.mkldnn._linear_pointwise(
                        x, packed, None, "none", [], ""),
                }
                for which, call in calls.items():
                    key = (threads, name, rows, which)
                    best[key] = min(best.get(key, float("inf")),
                                    best_seconds(call, args.budget))
    print(f"level {native.level}, best of {args.rounds} rounds")
    print("threads  product       K      N  rows  oneDNN GF/s  ours GF/s  ours/oneDNN")
    for threads in args.threads:
        for name, k, n, rows, *_ in cases:
            flops = 2.0 * rows * k * n
            theirs = flops / best[(threads, name, rows, "onednn")] / 1e9
            ours = flops / best[(threads, name, rows, "ours")] / 1e9
            print(f"{threads:7d}  {name:8s} {k:6d} {n:6d} {rows:5d} {theirs:12.1f} "
                  f"{ours:10.1f} {ours / theirs:12.2f}")


if __name__ == "__main__":
    main()
