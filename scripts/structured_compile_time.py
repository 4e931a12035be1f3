"""Time to first token of a request under a new, large JSON schema against the same
schema cached, on SmolLM2 in this process: ``python scripts/structured_compile_time.py``.
The schema: 200 properties of mixed types, nested objects and enums (each run makes its
own, so the first request always compiles). Figures in docs/bench.md."""

import json
import random
import time

from quire import SamplingParams
from quire.config import EngineConfig
from quire.engine import LLMEngine
from quire.model_store import resolve_model


def schema(seed: int) -> dict:
    rng = random.Random(seed)
    kinds = [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "boolean"},
             {"type": "string", "maxLength": 12},
             {"enum": [f"v{seed}_{i}" for i in range(8)]},
             {"type": "object", "properties": {"x": {"type": "number"},
                                               "y": {"type": "string", "maxLength": 4}},
              "required": ["x"]}]
    props = {f"field_{seed}_{i}": rng.choice(kinds) for i in range(200)}
    return {"type": "object", "properties": props, "required": list(props)[:20]}


def ttft(engine: LLMEngine, spec: dict) -> float:
    started = time.perf_counter()
    engine.add_request(engine.tokenizer.encode("JSON:"), SamplingParams(
        max_tokens=1, temperature=0, structured_outputs={"json": spec}))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


engine = LLMEngine(EngineConfig.from_kwargs(resolve_model("SmolLM2-135M-Instruct"),
                                            device="cpu"))
ttft(engine, {"type": "object"})  # warm: the grammar engine's tokenizer, the model
free = min(ttft(engine, {"type": "object"}) for _ in range(3))
new = [ttft(engine, schema(seed)) for seed in range(1, 6)]
cached = [ttft(engine, schema(seed)) for seed in range(1, 6)]
print(json.dumps({"schema_bytes": len(json.dumps(schema(1))),
                  "ttft_small_cached_s": round(free, 4),
                  "ttft_new_schema_s": [round(t, 4) for t in new],
                  "ttft_same_schema_cached_s": [round(t, 4) for t in cached]}))
engine.shutdown()
