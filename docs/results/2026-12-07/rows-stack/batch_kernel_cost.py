"""What FusedDecodeStack's per-step choice of kernel costs: every layer's
``batch_kernel`` for each decode batch step of 16 sequences, timed over 100 calls,
the median step printed.

``python batch_kernel_cost.py MODEL``
"""
import sys, time
from quire import LLM, SamplingParams
from quire.platforms.cpu import fused_stack
cost = []
orig = fused_stack.FusedDecodeStack._batch
def spy(self, start, end, hidden, residual, rotaries, ctx):
    t = time.perf_counter()
    for _ in range(100):
        {self._fused[i].batch_kernel(hidden.shape[0], ctx) for i in range(start, end)}
    cost.append((time.perf_counter() - t) / 100)
    return orig(self, start, end, hidden, residual, rotaries, ctx)
fused_stack.FusedDecodeStack._batch = spy
llm = LLM(model=sys.argv[1])
llm.generate([f"Tell me about {w}." for w in range(16)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(f"batch_kernel for all layers: {1e6 * sorted(cost)[len(cost)//2]:.0f} us a step")
