"""Tokens each mode computes (the scheduler's scheduled tokens, summed over steps) for
4 beams and 4 samples of one prompt, 64 tokens, on one SmolLM2 engine; run it by its
path from the repository root (the README beside it gives the figures)."""

import time

from quire import LLM, BeamSearchParams, SamplingParams
from quire.engine.scheduler import Scheduler

counts = {"tokens": 0, "steps": 0}
orig = Scheduler.schedule
def sched(self):
    out = orig(self)
    if out.scheduled:
        counts["steps"] += 1
        counts["tokens"] += sum(s.num_tokens for s in out.scheduled)
    return out
Scheduler.schedule = sched
g = "/root/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"
with LLM(g, device="cpu") as llm:
    llm.beam_search(["The capital of France is"], BeamSearchParams(4, 64, ignore_eos=True))
    counts.update(tokens=0, steps=0)
    t = time.perf_counter(); llm.beam_search(["The capital of France is"], BeamSearchParams(4, 64, ignore_eos=True))
    print("beam", counts, time.perf_counter() - t)
    counts.update(tokens=0, steps=0)
    t = time.perf_counter(); llm.generate(["The capital of France is"], SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=64, ignore_eos=True))
    print("samples", counts, time.perf_counter() - t)
