"""A W1-shaped bfloat16 run in one process (64 x 128 prompt tokens, 128 output tokens,
SmolLM2): one untimed generate, then four timed ones on new prompts; prints the seconds
of each. The A/B against the previous head ran it alternately on a worktree of that
head (``PYTHONPATH=<worktree>/core``) and on this checkout (w1-ab-runs.txt: five pairs,
each process timing two runs then). ``prefault`` passes the cpu option kv_prefault.

Run: ``python docs/results/2026-12-02/fourth/w1_runs.py LABEL [prefault]``
"""

import sys
import time
from pathlib import Path

from quire import LLM, SamplingParams

MODEL = Path.home() / ".cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"
options = {"kv_prefault": True} if "prefault" in sys.argv[2:] else None
llm = LLM(model=str(MODEL), dtype="bfloat16", seed=0, platform_options=options)
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate([{"prompt_token_ids": [(i * 7 + j) % 30000 + 100 for j in range(128)]}
              for i in range(64)], params)
took = []
for r in range(4):
    prompts = [{"prompt_token_ids": [(i * 13 + j * 3 + r * 1000 + 5) % 30000 + 100
                                     for j in range(128)]} for i in range(64)]
    start = time.perf_counter()
    llm.generate(prompts, params)
    took.append(time.perf_counter() - start)
print(sys.argv[1], " ".join(f"{t:.2f}" for t in took), flush=True)
