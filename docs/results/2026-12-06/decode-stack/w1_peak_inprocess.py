"""W1's shape in one process (64 prompts of 128 random token ids, greedy), at llama.cpp's
KV bytes (bfloat16 pages, 389 MiB): the process's memory before and after the run, its
high-water mark reset at the start (as ``quire bench`` does), and tokens/s.

    python w1_peak_inprocess.py [MODEL] [OUTPUT_TOKENS]

MODEL defaults to the SmolLM2 Q4_1 file in quire's model cache; OUTPUT_TOKENS (default
128) at 1 times the prompt phase alone."""

import os
import random
import sys
import time

from quire import LLM, SamplingParams

MODEL = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser(
    "~/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf")
OUTPUT_TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 128
PROMPTS, PROMPT_LEN = 64, 128


def status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon and RssFile of this process, MiB."""
    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    with open("/proc/self/status") as f:
        return {k: int(line.split()[1]) // 1024 for line in f
                for k in keys if line.startswith(k + ":")}


llm = LLM(model=MODEL, kv_cache_dtype="bfloat16", kv_cache_memory=389 << 20)
random.seed(0)
prompts = [{"prompt_token_ids": [random.randrange(100, 40000) for _ in range(PROMPT_LEN)]}
           for _ in range(PROMPTS)]
params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
print("before", status())
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM
start = time.perf_counter()
llm.generate(prompts, params)
elapsed = time.perf_counter() - start
print("after", status(), "total tokens/s",
      round(PROMPTS * (PROMPT_LEN + OUTPUT_TOKENS) / elapsed, 1))
