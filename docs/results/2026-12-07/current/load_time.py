"""LLM(model=PATH, kv_cache_memory=MIB MiB) timed in-process, after the imports."""
import time, os, sys, gc
t0 = time.perf_counter()
from quire import LLM
t1 = time.perf_counter()
path = os.path.expanduser(sys.argv[1])
kv = int(sys.argv[2]) << 20
llm = LLM(model=path, kv_cache_memory=kv)
t2 = time.perf_counter()
print(f"{os.path.basename(path)}: import {t1-t0:.2f} s, LLM() {t2-t1:.2f} s")
