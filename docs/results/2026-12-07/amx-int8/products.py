"""The int8 products at the amx level (AMX-INT8 tiles for whole 16 rows) against the
avx512_bf16 level (vpdpbusd), in one process: the batch kernel on GGUF blocks
(csrc/quant_q8.c, quire_quant_gemm_q8_batch: int8 activations per 32 values, w8a8's
default) and the per-row kernel (csrc/quant_gemm.c, quire_quant_gemm_i8: w8a8 with
group_size -1). The fastest of 5 rounds of 5 calls each, 2 threads, random weights.

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 python products.py
"""

from __future__ import annotations

import time

import torch
from quire.platforms.cpu.native import load_native_kernels
from quire.quantization.random import random_quantized

SHAPES = (  # format, n, k: SmolLM2-135M's qkv, gate_up and down, a 1B model's gate_up half
    ("q8_0", 960, 576), ("q8_0", 3072, 576), ("q8_0", 576, 1536),
    ("q4_1", 3072, 576), ("q4_k", 8192, 2048), ("q8_0", 8192, 2048),
    ("int8", 960, 576), ("int8", 3072, 576), ("int8", 576, 1536), ("int8", 8192, 2048),
)


def best_ms(kernels, x, w) -> float:
    def call():
        if w.format.name == "int8":
            return kernels.quant_linear_i8(x, w)
        return kernels.quant_linear_q8(x, w, batch=True)

    call()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(5):
            call()
        best = min(best, (time.perf_counter() - start) / 5)
    return best * 1e3


def main() -> None:
    amx = load_native_kernels(isa="amx")
    vnni = load_native_kernels(isa="avx512_bf16")
    assert amx is not None and amx.has_amx, "needs a CPU and a kernel with AMX granted"
    g = torch.Generator().manual_seed(0)
    print("format n k m | avx512_bf16 ms | amx ms | speed-up")
    for fmt, n, k in SHAPES:
        w = random_quantized(fmt, n, k, g)
        for m in (16, 64, 512):
            x = torch.randn(m, k, generator=g)
            v, a = best_ms(vnni, x, w), best_ms(amx, x, w)
            print(f"{fmt} {n} {k} {m} | {v:.3f} | {a:.3f} | {v / a:.2f}x", flush=True)


if __name__ == "__main__":
    main()
