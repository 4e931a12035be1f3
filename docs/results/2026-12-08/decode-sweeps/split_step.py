"""Where a lone stream's decode step goes: timers around the engine's calls (the model
runner's execute, prepare, attention metadata and LM head; the model's forward; the
C stack and its native call; the quantised product's native call; the sampler; the
engine core's step), five rounds of 100 steps of one request of 128 random tokens.

``python split_step.py --model FILE [engine options]``
"""

import argparse
import collections
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

spent: dict[str, float] = collections.defaultdict(float)


def timed(inner, key):
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
                       (model_runner.ModelRunner, "_logits", "head"),
                       (llama.LlamaModel, "forward", "model"),
                       (fused_stack.FusedDecodeStack, "__call__", "stack"),
                       (native.NativeKernels, "_quant_call", "head_c"),
                       (Sampler, "sample", "sample"),
                       (engine_core.EngineCore, "step", "core_step")):
    setattr(cls, name, timed(getattr(cls, name), key))
init = native.NativeKernels.__init__


def timed_init(self, *a, **k):
    init(self, *a, **k)
    self.decode_stack_f32 = timed(self.decode_stack_f32, "stack_c")


native.NativeKernels.__init__ = timed_init
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_engine_options(parser)
engine = LLMEngine(engine_config_from_args(parser.parse_args()), PlatformRegistry())
prompt = torch.randint(10, engine.vocab_size, (128,), generator=torch.Generator().manual_seed(0))
engine.add_request(prompt.tolist(), SamplingParams(max_tokens=1000, ignore_eos=True,
                                                   temperature=0.0))
for _ in range(20):
    engine.step()
for _ in range(5):
    spent.clear()
    start = time.perf_counter()
    for _ in range(100):
        engine.step()
    step = (time.perf_counter() - start) * 10
    print(f"step {step:.3f} ms: " + ", ".join(f"{k} {v * 10:.3f}" for k, v in spent.items()))
