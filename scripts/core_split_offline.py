"""The engine core in this process or in its own, without HTTP: 48 greedy requests of
32-511 random prompt tokens and 64 output tokens on SmolLM2, timed from the first step to
the last. ``python scripts/core_split_offline.py {inproc,proc}``; figures in docs/bench.md
(the process split's probes)."""

import random
import sys
import time

from quire import SamplingParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.engine.core_proc import ProcCoreClient
from quire.model_store import resolve_model

mode = sys.argv[1]
config = EngineConfig.from_kwargs(resolve_model("SmolLM2-135M-Instruct"), device="cpu")
engine = LLMEngine(config, client=ProcCoreClient.start(config) if mode == "proc" else None)
rng = random.Random(0)
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
for _ in range(48):
    engine.add_request([rng.randrange(100, 40000) for _ in range(rng.randrange(32, 512))],
                       params)
started = time.perf_counter()
while engine.has_unfinished_requests():
    engine.step()
print(f"{mode}: {time.perf_counter() - started:.2f} s")
engine.shutdown()
