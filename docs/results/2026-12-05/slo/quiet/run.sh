#!/usr/bin/env bash
# Capacity under an SLO on an idle host: levels up to where p95 TTFT misses 1 s.
set -euo pipefail
cd "$(dirname "$0")"
quire serve --model SmolLM2-135M-Instruct --port 8391 --slo-ttft 1 --slo-e2e 10 > server.log 2>&1 &
server=$!
trap 'kill $server; wait $server || true' EXIT
until curl -sf http://127.0.0.1:8391/health > /dev/null; do sleep 1; done
quire bench serve --url http://127.0.0.1:8391 --model SmolLM2-135M-Instruct --workload W5 \
  --num-requests 32 --input-len 256 --output-len 64 --concurrency 1,2,4,8,16,32 \
  --slo-ttft 1 --slo-e2e 10 --repeats 1 --warmup 1 --output capacity.json > capacity.txt 2>&1
curl -s http://127.0.0.1:8391/metrics | grep -E "slo_missed|by_prompt_len" > metrics_after.txt
