"""What loading a LoRA adapter costs the step that first uses it: SmolLM2-135M (Q4_1)
with four rank-16 adapters on every product (made by make_adapters.py), two device
slots and two host copies; each adapter's first one-token request against the next.

    python load_cost.py ADAPTERS_DIR
"""

import sys
import time

from quire import LLM, LoRARequest, SamplingParams
from quire.model_store import BUILTIN_MODELS, fetch

model = str(fetch(BUILTIN_MODELS["SmolLM2-135M-Instruct"]))
adapters = sys.argv[1]
params = SamplingParams(temperature=0, max_tokens=1)
with LLM(model, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=2) as llm:
    llm.generate(["Hello there"], params)
    for i in range(4):
        lora = LoRARequest(f"a{i}", i + 1, f"{adapters}/a{i}")
        t0 = time.perf_counter()
        llm.generate(["Hello there"], params, lora_request=lora)
        t1 = time.perf_counter()
        llm.generate(["Hello there"], params, lora_request=lora)
        t2 = time.perf_counter()
        print(f"adapter a{i}: first request {1000 * (t1 - t0):.1f} ms (reads and slots it), "
              f"again {1000 * (t2 - t1):.1f} ms")
    manager = llm.engine.core.executor.worker.lora
    t0 = time.perf_counter()
    adapter = manager._adapter(1)  # a0: evicted from host memory by now, read again
    t1 = time.perf_counter()
    manager._write(0, adapter)
    t2 = time.perf_counter()
    print(f"read from disk {1000 * (t1 - t0):.1f} ms, slot write {1000 * (t2 - t1):.1f} ms")
