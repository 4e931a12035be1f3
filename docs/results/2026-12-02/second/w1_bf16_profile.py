"""Where a W1-shaped bfloat16 run (64 x 128 prompt tokens, 128 output tokens, SmolLM2)
spends its time: cProfile of ``LLM.generate``, sorted by own time (C calls through ctypes
count in their Python caller).

Run: ``python docs/results/2026-12-02/second/w1_bf16_profile.py [model.gguf]``
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

from quire import LLM, SamplingParams

MODEL = Path.home() / ".cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"

llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else str(MODEL), dtype="bfloat16", seed=0)
prompts = [{"prompt_token_ids": [(i * 7 + j) % 30000 + 100 for j in range(128)]}
           for i in range(64)]
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate(prompts[:8], SamplingParams(max_tokens=8))  # warm
profile = cProfile.Profile()
started = time.perf_counter()
profile.runcall(llm.generate, prompts, params)
print(f"elapsed {time.perf_counter() - started:.2f} s")
pstats.Stats(profile).sort_stats("tottime").print_stats(14)
