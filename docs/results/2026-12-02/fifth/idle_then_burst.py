"""Bursts with idle time between them, as a server sees traffic: W1-shaped bursts
(64 x 128 prompt tokens, 128 output tokens, SmolLM2, bfloat16), each on new prompts and
so on KV blocks no burst used before, after ``idle_s`` seconds of nothing; prints the
resident set before the first burst and after the last, and each burst's seconds,
under one ``kv_prefault`` mode.

Run: ``python docs/results/2026-12-02/fifth/idle_then_burst.py background|start|off
[idle_s] [bursts]``
"""

import sys
import time
from pathlib import Path

from quire import LLM, SamplingParams


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


MODEL = Path.home() / ".cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"
mode = sys.argv[1]
idle = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
bursts = int(sys.argv[3]) if len(sys.argv) > 3 else 5
llm = LLM(model=str(MODEL), dtype="bfloat16", seed=0, platform_options={"kv_prefault": mode})
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))  # warm the code
first = rss_mib()
took = []
for r in range(bursts):
    time.sleep(idle)
    prompts = [{"prompt_token_ids": [(i * 13 + j * 3 + r * 1000 + 5) % 30000 + 100
                                     for j in range(128)]} for i in range(64)]
    begin = time.perf_counter()
    llm.generate(prompts, params)
    took.append(time.perf_counter() - begin)
print(f"{mode:10s} RSS {first:.0f} -> {rss_mib():.0f} MiB, bursts after {idle:.0f} s idle: "
      + " ".join(f"{t:.2f}" for t in took), flush=True)
