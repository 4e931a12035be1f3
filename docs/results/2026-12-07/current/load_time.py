"""``python load_time.py FILE KV_MIB``: ``LLM(model=FILE, kv_cache_memory=KV_MIB MiB)``
timed in-process, after the imports (timed apart)."""
import os
import sys
import time

started = time.perf_counter()
from quire import LLM  # noqa: E402

imported = time.perf_counter()
path = os.path.expanduser(sys.argv[1])
llm = LLM(model=path, kv_cache_memory=int(sys.argv[2]) << 20)
print(f"{os.path.basename(path)}: import {imported - started:.2f} s, "
      f"LLM() {time.perf_counter() - imported:.2f} s")
