"""row_argmax with chunks of 512 and 1024 logits, interleaved, one thread: the second pass of docs/bench.md (2026-12-02)."""
import statistics
import time

import torch

torch.set_num_threads(1)
from quire.sampling import argmax as am

x = torch.randn(256, 49152); x64 = torch.randn(64, 49152)
res = {c: [] for c in (512, 1024)}
res64 = {c: [] for c in (512, 1024)}
for r in range(6):
    for c in (512, 1024):
        am.CHUNK = c
        for data, store in ((x, res), (x64, res64)):
            best = 1e9
            for _ in range(20):
                t = time.perf_counter(); am.row_argmax(data); best = min(best, time.perf_counter() - t)
            store[c].append(best * 1e3)
for c in res:
    print(c, "256 rows: median %.3f best %.3f" % (statistics.median(res[c]), min(res[c])),
          "| 64 rows: median %.3f best %.3f" % (statistics.median(res64[c]), min(res64[c])))
