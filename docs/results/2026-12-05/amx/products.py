"""bfloat16 products on GGUF blocks at SmolLM2-135M's shapes (Q4_1; Q8_0 for the 49152-row
embedding), 64 rows (and one 2048-row prompt product), at one ISA level: the blocks kernel (quire_quant_gemm_bf16), the
same at 16 rows (to split dequantisation from product: t(m) ~ D + m P; 16 rows are
one AMX tile), the pair-panel
kernel on the weight dequantised beforehand (product only, vdpbf16ps) and oneDNN's
F.linear on that bfloat16 weight (AMX where the CPU has it). The fastest of 20 timed
calls after a warm one. Run from the repository root with this file's path; the ISA
level as the first argument (default: the best)."""
import sys
import time

import torch
import torch.nn.functional as F
from quire.platforms.cpu.native import load_native_kernels
from quire.quantization.random import random_quantized

k = load_native_kernels(isa=sys.argv[1] if len(sys.argv) > 1 else None)
gen = torch.Generator().manual_seed(0)


def ms(f, n=20):
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def row(fmt: str, n: int, kk: int, m: int = 64) -> str:
    w = random_quantized(fmt, n, kk, gen)
    xb = torch.randn(m, kk, generator=gen).to(torch.bfloat16)
    wb = w.dequantize().to(torch.bfloat16)
    t64 = ms(lambda: k.quant_linear_bf16(xb, w))
    t16 = ms(lambda: k.quant_linear_bf16(xb[:16].contiguous(), w))
    per_row = (t64 - t16) / (m - 16)
    out = [f"{fmt} {n}x{kk} m={m}: blocks {t64:.3f} ms",
           f"m=16 {t16:.3f}",
           f"fit: dequant {t16 - 16 * per_row:.3f} + product {m * per_row:.3f}"]
    if k.has_bf16_gemm:
        panels = k.pack_bf16_panels(wb)
        out.append(f"pair panels {ms(lambda: k.bf16_linear(xb, panels, n, None)):.3f}")
    out.append(f"oneDNN {ms(lambda: F.linear(xb, wb)):.3f}")
    return ", ".join(out)


print(f"level {k.level}, {torch.get_num_threads()} threads")
for fmt, (n, kk) in [("q4_1", (576, 576)), ("q4_1", (1536, 576)), ("q4_1", (576, 1536)),
                     ("q8_0", (49152, 576))]:
    print(row(fmt, n, kk), flush=True)
print(row("q4_1", 1536, 576, m=2048), flush=True)  # a prompt step's product
