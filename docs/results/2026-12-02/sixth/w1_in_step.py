"""W1-shaped bfloat16 runs in one process (as ../fifth/w1_modes.py) under a kv_prefault
mode, or ``sync2``: an experiment, not in the engine, that populates the pool ahead of
the highest block reached inside each step's ``build_metadata`` (when fewer than LOW MiB
remain populated, the next CHUNK MiB of every layer) from two threads, the main one and
a helper, instead of letting the step fault pages in.

Run: ``python docs/results/2026-12-02/sixth/w1_in_step.py off|start|background|sync2 [LOW CHUNK]``
"""
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from quire import LLM, SamplingParams
from quire.platforms.cpu import sdpa_attention as sa
from quire.platforms.cpu.kv_prefault import populate_write

mode = sys.argv[1]
LOW = int(sys.argv[2]) << 20 if len(sys.argv) > 2 else 64 << 20
CHUNK = int(sys.argv[3]) << 20 if len(sys.argv) > 3 else 128 << 20
pools = []
state = {"done": 0, "secs": 0.0, "bytes": 0}
ex = ThreadPoolExecutor(1)
if mode == "sync2":
    orig_alloc = sa.CpuSdpaAttentionBackend.allocate_kv_cache
    def alloc(self, *a, **k):
        c = orig_alloc(self, *a, **k)
        if pools and pools[0].shape[1] != c.shape[1]:
            pools.clear(); state["done"] = 0
        pools.append(c); return c
    sa.CpuSdpaAttentionBackend.allocate_kv_cache = alloc
    orig_bm = sa.CpuSdpaAttentionBackend.build_metadata
    def pop_ranges(ranges):
        for a, n in ranges:
            populate_write(a, n)
    def bm(self, batch):
        if batch.num_tokens and pools:
            blk = int(batch.slot_mapping.max()) // batch.block_size
            per_block = sum(c[0, 0].numel() * c.element_size() * 2 for c in pools)
            nb = pools[0].shape[1]
            if (state["done"] - blk) * per_block < LOW and state["done"] < nb:
                t = time.perf_counter()
                end = min(nb, max(blk + 1, state["done"]) + CHUNK // per_block)
                ranges = []
                for c in pools:
                    size = c[0, 0].numel() * c.element_size()
                    for half in (0, 1):
                        base = c.data_ptr() + half * nb * size
                        ranges.append((base + state["done"] * size, (end - state["done"]) * size))
                # split every range in two halves: one per thread
                a, b = [], []
                for addr, n in ranges:
                    h = n // 2 // 4096 * 4096
                    a.append((addr, h)); b.append((addr + h, n - h))
                f = ex.submit(pop_ranges, b); pop_ranges(a); f.result()
                state["bytes"] += (end - state["done"]) * per_block
                state["done"] = end
                state["secs"] += time.perf_counter() - t
        return orig_bm(self, batch)
    sa.CpuSdpaAttentionBackend.build_metadata = bm
    opt = "off"
else:
    opt = mode

start = time.perf_counter()
llm = LLM(model="SmolLM2-135M-Instruct", dtype="bfloat16", seed=0, platform_options={"kv_prefault": opt})
started = time.perf_counter() - start
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate([{"prompt_token_ids": [(i * 7 + j) % 30000 + 100 for j in range(128)]} for i in range(64)], params)
took = []
for r in range(4):
    prompts = [{"prompt_token_ids": [(i * 13 + j * 3 + r * 1000 + 5) % 30000 + 100 for j in range(128)]} for i in range(64)]
    begin = time.perf_counter(); llm.generate(prompts, params); took.append(time.perf_counter() - begin)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{mode:10s} start {started:5.1f} s runs " + " ".join(f"{t:.2f}" for t in took)
      + f" peak {peak:.0f} MiB populated {state['bytes']>>20} MiB in {state['secs']:.2f} s", flush=True)
