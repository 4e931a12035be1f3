"""A lone greedy stream, W2-like, timed in one process after a warm-up: milliseconds per
output token (prompt included, as a long stream makes it negligible); prints its pid
once warm, for ``perf record -p`` or ``py-spy``.

    python w2_loop.py [TOKENS] [REQUESTS] [MODEL]

TOKENS (default 512) per request, REQUESTS (default 3) one after another; MODEL defaults
to the SmolLM2 Q4_1 file in quire's model cache."""

import os
import sys
import time

from quire import LLM, SamplingParams

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 512
REQUESTS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
MODEL = sys.argv[3] if len(sys.argv) > 3 else os.path.expanduser(
    "~/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf")

llm = LLM(model=MODEL)
params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
llm.generate(["Hello there, tell me a story"], params)
print("ready", os.getpid(), flush=True)
start = time.perf_counter()
for _ in range(REQUESTS):
    llm.generate(["Hello there, tell me a story about a dragon and a knight"], params)
print("ms per token", (time.perf_counter() - start) * 1000 / (REQUESTS * TOKENS))
