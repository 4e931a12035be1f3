#!/bin/bash
# This stop's figures for docs/bench.md's "Quantized weights" table, one run each,
# nothing else running (the W1/vLLM and 1B rows ran first, at the stop's start).
set -x
R=docs/results/2026-12-07/current
M=~/.cache/quire/models
quire bench throughput --workload W1 --repeats 1 --warmup 1 --peer vllm --vllm-dtype bfloat16 --output $R/w1_vllm.json
quire bench throughput --workload W1 --repeats 1 --warmup 1 --kv-cache-dtype int8 --output $R/w1_int8kv.json
quire bench latency --model $M/llama1b-q4km.gguf --workload W2 --repeats 1 --warmup 1 --kv-cache-memory 8MiB --peer llamacpp --llamacpp-variant native --llamacpp-repack off --output $R/w2_1b_llamacpp.json
quire bench latency --workload W2 --repeats 3 --warmup 1 --peer llamacpp --llamacpp-variant native --llamacpp-repack off --output $R/w2_smollm2_llamacpp.json
quire bench throughput --workload W1 --repeats 1 --warmup 0 --kv-cache-dtype bfloat16 --kv-cache-memory 389MiB --output $R/w1_llamacpp_kv_bytes.json
quire bench latency --model $M/llama8b-q4km.gguf --workload W2 --repeats 1 --warmup 0 --kv-cache-memory 512MiB --peer llamacpp --llamacpp-variant native --llamacpp-repack off --output $R/w2_8b_llamacpp.json
# load: LLM(model=...) timed in-process (load_time.py); llama.cpp's "loaded in" from the
# W2 runs above (page cache warm)
python $R/load_time.py $M/llama1b-q4km.gguf 8
python $R/load_time.py $M/llama8b-q4km.gguf 512
for i in 1 2 3; do /usr/bin/time -f "%e s %M KB" quire generate --prompt "Hi" --max-tokens 1; done
