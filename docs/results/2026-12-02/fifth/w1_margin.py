"""W1-shaped runs (as ``w1_modes.py``) after the background thread has made ``GIB`` GiB
of the pool resident (its margin raised from 512 MiB for this one-off, then the script
waits until the resident set stops growing): shows that the pages, not anything else the
``start`` mode does, are what made the runs of ``w1_modes.py off`` slow.

Run: ``python docs/results/2026-12-02/fifth/w1_margin.py GIB``
"""
import sys
import time
from pathlib import Path

import quire.platforms.cpu.kv_prefault as kp

kp.BackgroundPrefault.__init__.__defaults__ = (int(float(sys.argv[1]) * 2**30), kp.CHUNK_BYTES)
from quire import LLM, SamplingParams

MODEL = Path.home() / ".cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"
llm = LLM(model=str(MODEL), dtype="bfloat16", seed=0, platform_options={"kv_prefault": "background"})
t = time.perf_counter()
while True:
    rss = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")][0] >> 10
    time.sleep(2)
    rss2 = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")][0] >> 10
    if rss2 == rss: break
print(f"populated to RSS {rss2} MiB in {time.perf_counter()-t:.0f} s", flush=True)
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate([{"prompt_token_ids": [(i * 7 + j) % 30000 + 100 for j in range(128)]} for i in range(64)], params)
took = []
for r in range(4):
    prompts = [{"prompt_token_ids": [(i * 13 + j * 3 + r * 1000 + 5) % 30000 + 100 for j in range(128)]} for i in range(64)]
    b = time.perf_counter(); llm.generate(prompts, params); took.append(time.perf_counter() - b)
print(sys.argv[1], "GiB margin, runs", " ".join(f"{x:.2f}" for x in took), flush=True)
