"""Decode attention alone (NativeKernels.paged_decode, bfloat16 pages, SmolLM2's heads: 9
query, 3 KV, 64 dims, 16-slot blocks scattered over the pool): B sequences of CTX
positions. "hot": one layer's pages read again and again (from cache); "cold": 30
layers' pools in turn, as a step reads them. Prints the best ms a layer of each over
rounds.

``python attention_alone.py B CTX``
"""
import sys
import time

import torch
from quire.platforms.cpu.native import load_native_kernels

torch.manual_seed(0)
kernels = load_native_kernels()
B, ctx = int(sys.argv[1]), int(sys.argv[2])
hq, hkv, d, bs = 9, 3, 64, 16
scale = d**-0.5
per_seq = -(-ctx // bs)


def best_ms(layers: int, pool: int, steps: int, rounds: int) -> float:
    tables = torch.randperm(pool)[: B * per_seq].reshape(B, per_seq).contiguous()
    caches = [torch.randn(2, pool, bs, hkv, d).bfloat16() for _ in range(layers)]
    q = torch.randn(B, hq, d)
    lens = torch.full((B,), ctx, dtype=torch.int64)
    for cache in caches:
        kernels.paged_decode(q, cache, tables, lens, scale, None)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            for cache in caches:
                kernels.paged_decode(q, cache, tables, lens, scale, None)
        best = min(best, (time.perf_counter() - start) / steps / layers)
    return best * 1e3


hot = best_ms(1, B * per_seq + 8, 20, 15)
cold = best_ms(30, max(4096, B * per_seq + 8), 3, 5)
print(f"B={B} ctx={ctx}: hot {hot:.3f} ms a layer, cold {cold:.3f} ms a layer")
