"""One-row products, float32 rows against bfloat16 rows, on the platform's entries
(NativeKernels.quant_linear, NativeKernels.quant_rows_bf16), random blocks from the
kernel tests' maker, alternated twice. Run from the repository root with this file's
path; it finds tests/unit from its own place in the tree."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests" / "unit"))
from quire.platforms.cpu.native import load_native_kernels  # noqa: E402
from test_cpu_quant_gemm import make_weight  # noqa: E402

SHAPES = [("q4_k", 8192, 2048), ("q6_k", 2048, 8192), ("q4_0", 8192, 2048),
          ("q5_0", 2048, 640), ("q4_1", 1536, 576), ("q4_1", 576, 1536)]

kernels = load_native_kernels()
gen = torch.Generator().manual_seed(0)
for round_ in range(2):
    for name, rows, cols in SHAPES:
        weight = make_weight(name, rows, cols, gen)
        x = torch.randn(1, cols, generator=gen)
        for entry, label in ((kernels.quant_linear, "float32"),
                             (kernels.quant_rows_bf16, "bfloat16")):
            for _ in range(5):
                entry(x, weight)
            n = 200 if rows * cols < 4 << 20 else 40
            start = time.perf_counter()
            for _ in range(n):
                entry(x, weight)
            seconds = (time.perf_counter() - start) / n
            print(f"{name} {rows}x{cols} {label}: {seconds * 1e3:.4f} ms, "
                  f"{weight.data.numel() / seconds / 1e9:.1f} GB/s of blocks", flush=True)
