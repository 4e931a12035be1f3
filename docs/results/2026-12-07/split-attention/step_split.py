"""Where a lone stream's decode step goes: the engine's step against the model runner's
execute, prepare and LM head (timers around ModelRunner's methods), 100 steps a round,
a new 128-token request whenever one ends.

``ROUNDS=N python step_split.py --model FILE [engine options]``
"""

import argparse
import collections
import os
import time

import torch
from quire.engine import LLMEngine
from quire.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args
from quire.executor import model_runner
from quire.plugins.registry import PlatformRegistry
from quire.sampling_params import SamplingParams

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_engine_options(parser)
args = parser.parse_args()
spent: dict[str, float] = collections.defaultdict(float)


def timed(name: str, key: str) -> None:
    inner = getattr(model_runner.ModelRunner, name)

    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent[key] += time.perf_counter() - start

    setattr(model_runner.ModelRunner, name, wrapper)


timed("execute", "execute")
timed("prepare", "prepare")
timed("_logits", "logits")
engine = LLMEngine(engine_config_from_args(args), PlatformRegistry())
gen = torch.Generator().manual_seed(0)
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)


def add() -> None:
    prompt = torch.randint(10, engine.vocab_size, (128,), generator=gen).tolist()
    engine.add_request(prompt, params)


add()
for _ in range(20):
    engine.step()
for _ in range(int(os.environ.get("ROUNDS", "3"))):
    spent.clear()
    steps = 100
    start = time.perf_counter()
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            add()
            engine.step()  # its prompt
        engine.step()
    wall = time.perf_counter() - start
    parts = ", ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in spent.items())
    print(f"step {wall / steps * 1e3:.3f} ms: {parts}", flush=True)
