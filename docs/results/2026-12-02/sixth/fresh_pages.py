"""How far into the KV pool W1-shaped runs reach (64 x 128 prompt tokens, 128 output
tokens, bfloat16, new text each run): the highest page id handed out so far, + 1, is
the pool's touched part (never-used pages are handed out in id order), after each of
five runs, with the process's resident set.

Run: ``python docs/results/2026-12-02/sixth/fresh_pages.py`` (the tree to measure on
PYTHONPATH).
"""
import time

from quire import LLM, SamplingParams

llm = LLM(model="SmolLM2-135M-Instruct", dtype="bfloat16", seed=0)
bm = llm.engine.core.block_manager
highest = [-1]
take = bm._take_new


def taking() -> int:
    block = take()
    highest[0] = max(highest[0], block)
    return block


bm._take_new = taking
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)


def rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20


before = highest[0] + 1
for r in range(5):
    prompts = [{"prompt_token_ids": [(i * 13 + j * 3 + r * 1000 + 5) % 30000 + 100
                                     for j in range(128)]} for i in range(64)]
    start = time.perf_counter()
    llm.generate(prompts, params)
    took = time.perf_counter() - start
    reach = highest[0] + 1
    print(f"run {r}: {took:.2f} s, pages touched {reach} (+{reach - before}), "
          f"cached {bm.num_cached_blocks}, RSS {rss_mib()} MiB", flush=True)
    before = reach
