"""Decode attention alone at W1's shape, pages cold: 64 sequences of CTX positions,
SmolLM2's heads (9 query, 3 KV, 64 dims), 16-slot blocks scattered over a pool per
layer, 30 layers' pools, so that every step reads its pages from memory as a W1 step
does. Prints ms per 30-layer step and the KV bytes read per second.

``python attention_cold.py bf16|int8|f32 [CTX]``
"""
import sys
import time

import torch
from quire.ops import kv_quant
from quire.platforms.cpu.native import load_native_kernels

torch.manual_seed(0)
nk = load_native_kernels()
kind = sys.argv[1]
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 192
B, hq, hkv, d, bs, pool, layers = 64, 9, 3, 64, 16, 4096, 30
per_seq = -(-ctx // bs)
tables = torch.randperm(pool)[: B * per_seq].reshape(B, per_seq).contiguous()
caches = []
for _ in range(layers):
    pages = torch.randn(2, pool, bs, hkv, d)
    if kind == "int8":
        caches.append(kv_quant.quantize(pages, torch.int8).view(torch.int8))
    else:
        caches.append(pages.to(torch.bfloat16 if kind == "bf16" else torch.float32))
q = torch.randn(B, hq, d)
lens = torch.full((B,), ctx, dtype=torch.int64)
for _ in range(3):
    for c in caches:
        nk.paged_decode(q, c, tables, lens, 0.125, None)
steps = 10
start = time.perf_counter()
for _ in range(steps):
    for c in caches:
        nk.paged_decode(q, c, tables, lens, 0.125, None)
dt = (time.perf_counter() - start) / steps
read = B * ctx * hkv * caches[0].shape[-1] * caches[0].element_size() * 2 * layers
print(f"{kind} ctx={ctx}: {dt * 1e3:.2f} ms per 30-layer step, {read / dt / 1e9:.1f} GB/s")
