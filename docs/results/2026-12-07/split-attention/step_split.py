"""Where a lone stream's decode step goes: the engine's step against the model runner's
execute, prepare, attention metadata and LM head (timers around ModelRunner's methods),
and within them the model's forward, the C stack (its call and its native call), the
LM head's native call, the sampler and the engine core's step; 100 steps a round, a new
request of 128 prompt tokens whenever one ends, each MAX_TOKENS long (128 unless set;
more than the rounds' steps keeps every step a decode step).

``ROUNDS=N [MAX_TOKENS=M] python step_split.py --model FILE [engine options]``
"""

import argparse
import collections
import os
import time

import torch
from quire.engine import LLMEngine
from quire.engine import core as engine_core
from quire.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args
from quire.executor import model_runner
from quire.models import llama
from quire.platforms.cpu import fused_stack, native
from quire.plugins.registry import PlatformRegistry
from quire.sampler import Sampler
from quire.sampling_params import SamplingParams

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_engine_options(parser)
args = parser.parse_args()
spent: dict[str, float] = collections.defaultdict(float)


def wrap(inner, key: str):
    """inner with its time added to spent[key]."""
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent[key] += time.perf_counter() - start

    return wrapper


for cls, name, key in ((model_runner.ModelRunner, "execute", "execute"),
                       (model_runner.ModelRunner, "prepare", "prepare"),
                       (model_runner.ModelRunner, "_context", "metadata"),
                       (model_runner.ModelRunner, "_logits", "logits"),
                       (llama.LlamaModel, "forward", "model"),
                       (fused_stack.FusedDecodeStack, "__call__", "stack"),
                       (native.NativeKernels, "_quant_call", "head_c"),
                       (Sampler, "sample", "sample"),
                       (engine_core.EngineCore, "step", "core_step")):
    setattr(cls, name, wrap(getattr(cls, name), key))
native_init = native.NativeKernels.__init__


def timed_init(self, *a, **k):
    native_init(self, *a, **k)
    self.decode_stack_f32 = wrap(self.decode_stack_f32, "stack_c")


native.NativeKernels.__init__ = timed_init
engine = LLMEngine(engine_config_from_args(args), PlatformRegistry())
gen = torch.Generator().manual_seed(0)
params = SamplingParams(max_tokens=int(os.environ.get("MAX_TOKENS", "128")), ignore_eos=True,
                        temperature=0.0)


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
