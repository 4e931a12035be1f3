"""Where a lone stream's decode step goes, per call in the engine: each named method is
wrapped with a timer, and one greedy request of TOKENS tokens gives its time per step
(an outer method's time includes its callees').

    python w2_parts.py [TOKENS] [MODEL]

TOKENS defaults to 256; MODEL to the SmolLM2 Q4_1 file in quire's model cache."""

import collections
import os
import sys
import time

from quire import LLM, SamplingParams
from quire.engine.core import EngineCore
from quire.executor.input_batch import InputBatch
from quire.executor.model_runner import ModelRunner
from quire.models.layers.embedding import VocabParallelEmbedding
from quire.models.layers.norm import RMSNorm
from quire.platforms.cpu.fused_stack import FusedDecodeStack
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from quire.sampler import Sampler

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 256
MODEL = sys.argv[2] if len(sys.argv) > 2 else os.path.expanduser(
    "~/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf")
seconds: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()


def timed(owner: type, name: str) -> None:
    """Replace ``owner.name`` by a wrapper adding each call's time to ``seconds``."""
    inner, label = getattr(owner, name), f"{owner.__name__}.{name}"

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


for owner, name in ((EngineCore, "step"), (ModelRunner, "execute"),
                    (FusedDecodeStack, "__call__"), (ModelRunner, "_logits"),
                    (InputBatch, "prepare"), (CpuSdpaAttentionBackend, "build_metadata"),
                    (Sampler, "sample"), (VocabParallelEmbedding, "forward"),
                    (RMSNorm, "forward")):
    timed(owner, name)

llm = LLM(model=MODEL)
params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
llm.generate(["Hello there"], params)  # warm-up
seconds.clear()
calls.clear()
start = time.perf_counter()
llm.generate(["Hello there, tell me a story about a dragon and a knight"], params)
print("ms per token", (time.perf_counter() - start) * 1000 / TOKENS)
steps = calls["EngineCore.step"]
for label in sorted(seconds, key=lambda k: -seconds[k]):
    print(f"{label:45s} {calls[label]:5d} {seconds[label] / steps * 1e6:8.1f} us/step")
