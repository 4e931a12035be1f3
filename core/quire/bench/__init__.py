"""``quire bench``: benchmarks of Quire, alone or against peer engines (docs/bench.md).

- ``corpus.py``: the prose prompts are cut from, and exact-length prompts (text + ids)
- ``workloads.py``: the presets W1..W5, custom shapes, the seeded requests they expand to
- ``stats.py``: percentiles, medians over repeats, SLOs and goodput
- ``quire_engine.py``: building and warming Quire's engine; greedy fixed-length requests
- ``throughput.py``: offline throughput of one pass (Quire's run; the run record)
- ``latency.py``: one request at a time: TTFT, inter-token latency
- ``serve.py``: streaming load on an OpenAI-compatible server (concurrency or Poisson)
- ``sweep.py``: throughput over values of one engine option, and its plot
- ``memory.py``: paged vs contiguous KV allocation, simulated on our ``BlockManager``
- ``accuracy.py``: next-token distributions against a reference on a fixed text: KL,
  top-1 agreement, perplexity (and llama.cpp's, against the same reference)
- ``report.py``: tables for stdout, the JSON record of a run
- ``peers/``: the peer engines (hf, vllm, llamacpp), their installs and workers
"""
