"""64-row products at SmolLM2-135M's shapes on Q4_1 blocks (Q8_0 for the 49152-row
embedding): int8 activations (the batch kernel, and the tiles of up to four rows)
against float32 rows and bfloat16 rows on the blocks, and bfloat16 panels of the
dequantised weight. The fastest of 30 timed calls after a warm one. Run from the repository
root, with this file's path; the ISA level as the first argument (default: the best)."""
import sys
import time

import torch
from quire.platforms.cpu.native import load_native_kernels
from quire.quantization.random import random_quantized

k = load_native_kernels(isa=sys.argv[1] if len(sys.argv) > 1 else None)
gen = torch.Generator().manual_seed(0)


def ms(f, n=30):
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def row(fmt: str, n: int, kk: int, m: int = 64) -> str:
    w = random_quantized(fmt, n, kk, gen)
    x = torch.randn(m, kk, generator=gen)
    xb = x.to(torch.bfloat16)
    out = [f"{fmt} {n}x{kk} m={m}:",
           f"int8 batch {ms(lambda: k.quant_linear_q8(x, w, batch=True)):.3f} ms",
           f"int8 tiles {ms(lambda: k.quant_linear_q8(x, w)):.3f}",
           f"f32 blocks {ms(lambda: k.quant_linear(x, w)):.3f}"]
    if k.has_quant_bf16:
        out.append(f"bf16 blocks {ms(lambda: k.quant_linear_bf16(xb, w)):.3f}")
        panels = k.pack_bf16_panels(w.dequantize().to(torch.bfloat16))
        out.append(f"bf16 panels {ms(lambda: k.bf16_linear(xb, panels, n, None)):.3f}")
    return ", ".join(out)


print(f"level {k.level}, {torch.get_num_threads()} threads")
for fmt, (n, kk) in [("q4_1", (576, 576)), ("q4_1", (1536, 576)), ("q4_1", (576, 1536)),
                     ("q8_0", (49152, 576))]:
    print(row(fmt, n, kk), flush=True)
