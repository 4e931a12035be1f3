"""Where a self-drafting step's time goes: SmolLM2 drafting for itself, k = 3, one
greedy request of 128 tokens; prints the wall time, the model runner's, the drafter's,
and the draft forwards (count, mean).

    python split.py [DRAFT_PATH]
"""

import sys
import time
from pathlib import Path

from quire import LLM, SamplingParams
from quire.executor import drafter, model_runner
from quire.model_store import BUILTIN_MODELS, fetch

target = str(fetch(BUILTIN_MODELS["SmolLM2-135M-Instruct"]))
draft = sys.argv[1] if len(sys.argv) > 1 else target
spent = {"propose": 0.0, "execute": 0.0, "forward": 0.0, "forwards": 0}


def timed(fn, key, count=None):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[key] += time.perf_counter() - start
        if count:
            spent[count] += 1
        return out
    return wrapper


drafter.Drafter.propose = timed(drafter.Drafter.propose, "propose")
drafter.Drafter._forward = timed(drafter.Drafter._forward, "forward", "forwards")
model_runner.ModelRunner.execute = timed(model_runner.ModelRunner.execute, "execute")
text = (Path(__file__).resolve().parents[4] / "README.md").read_text()[:600]
with LLM(target, device="cpu",
         speculative_config={"model": draft, "num_speculative_tokens": 3}) as llm:
    llm.generate([text], SamplingParams(temperature=0, max_tokens=8))
    spent.update(propose=0.0, execute=0.0, forward=0.0, forwards=0)
    start = time.perf_counter()
    llm.generate([text], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    wall = time.perf_counter() - start
    stats = llm.engine.core.stats()
print(f"wall {wall:.2f} s; runner {spent['execute']:.2f} s, of which drafter "
      f"{spent['propose']:.2f} s: {spent['forwards']} draft forwards, "
      f"{1000 * spent['forward'] / max(1, spent['forwards']):.1f} ms each; "
      f"{stats.spec_num_drafts} verifications, {stats.spec_num_accepted_tokens}/"
      f"{stats.spec_num_draft_tokens} drafts accepted")
