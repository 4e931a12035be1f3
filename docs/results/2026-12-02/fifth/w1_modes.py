"""A W1-shaped bfloat16 run in one process (64 x 128 prompt tokens, 128 output tokens,
SmolLM2) under one ``kv_prefault`` mode: the seconds the engine took to start, then one
untimed generate and four timed ones on new prompts, then the peak resident set.

Run: ``python docs/results/2026-12-02/fifth/w1_modes.py background|start|off``
"""

import resource
import sys
import time
from pathlib import Path

from quire import LLM, SamplingParams

MODEL = Path.home() / ".cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"
start = time.perf_counter()
llm = LLM(model=str(MODEL), dtype="bfloat16", seed=0,
          platform_options={"kv_prefault": sys.argv[1]})
started = time.perf_counter() - start
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate([{"prompt_token_ids": [(i * 7 + j) % 30000 + 100 for j in range(128)]}
              for i in range(64)], params)
took = []
for r in range(4):
    prompts = [{"prompt_token_ids": [(i * 13 + j * 3 + r * 1000 + 5) % 30000 + 100
                                     for j in range(128)]} for i in range(64)]
    begin = time.perf_counter()
    llm.generate(prompts, params)
    took.append(time.perf_counter() - begin)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{sys.argv[1]:10s} start {started:5.1f} s  runs " + " ".join(f"{t:.2f}" for t in took)
      + f"  peak RSS {peak:.0f} MiB", flush=True)
