"""Products at SmolLM2 and Llama shapes: the blocks (float32 and bfloat16 rows) against
float32 and bfloat16 panels of the dequantised weight. Run from the repository root,
with this file's path."""
import sys, time, torch
sys.path.insert(0, "tests/unit")
from test_cpu_quant_gemm import make_weight
from quire.platforms.cpu.native import load_native_kernels
k = load_native_kernels(isa="avx512_bf16")
gen = torch.Generator().manual_seed(0)
def t(f, n=20):
    f(); t0=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t0)/n*1e3
for name, (n, kk) in [("q4_1",(1536,576)), ("q4_1",(576,1536)), ("q4_k",(4096,2048)), ("q6_k",(2048,4096))]:
    w = make_weight(name, n, kk, gen)
    wb = w.dequantize().to(torch.bfloat16)
    panels = k.pack_bf16_panels(wb)
    wf = w.dequantize(); pf = k.pack_panels(wf)
    for m in (64, 256):
        x = torch.randn(m, kk, generator=gen)
        xb = x.to(torch.bfloat16)
        a = t(lambda: k.quant_linear(x, w)); b = t(lambda: k.quant_linear_bf16(xb, w))
        c = t(lambda: k.bf16_linear(xb, panels, n, None)); d = t(lambda: k.panel_linear(x, pf, n, None))
        print(f"{name} {n}x{kk} m={m}: blocks f32 {a:.2f} ms, blocks bf16 {b:.2f}, bf16 panels {c:.2f}, f32 panels {d:.2f}")
