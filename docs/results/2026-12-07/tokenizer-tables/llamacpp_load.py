"""``PEER_PYTHON llamacpp_load.py QUIRE_CORE FILE...``: llama.cpp's load of each file as
``quire bench``'s llama.cpp peer times it ("loaded in": one sequence, 264 positions, F16
KV, 2 threads, no repacked weights), twice each; PEER_PYTHON is the peer's virtual
environment (``~/.cache/quire/peers/llamacpp/bin/python``)."""
import os
import sys
import time

sys.path.insert(0, os.path.join(sys.argv[1], "quire", "bench", "peers"))
import llamacpp_worker as worker  # noqa: E402

for path in sys.argv[2:]:
    for _ in range(2):
        started = time.perf_counter()
        runner = worker._Runner(path, 1, 264, worker._DEFAULT_BATCH, 2, "f16", False)
        print(f"{os.path.basename(path)} load {time.perf_counter() - started:.3f} s")
        del runner
