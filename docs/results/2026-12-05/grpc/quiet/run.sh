#!/usr/bin/env bash
# The same comparison as ../README.md on an otherwise idle host: one quire serve with HTTP
# and gRPC, W2 (HTTP, gRPC, gRPC, HTTP) and W5 shortened to 60 requests from 30 clients
# (ABBA), each pass's load average in load.txt.
set -euo pipefail
cd "$(dirname "$0")"
quire serve --model SmolLM2-135M-Instruct --port 8391 --grpc-port 8392 \
  --enable-prefix-caching false > server.log 2>&1 &
server=$!
trap 'kill $server; wait $server || true' EXIT
until curl -sf http://127.0.0.1:8391/health > /dev/null; do sleep 1; done
grpc=(--transport grpc --grpc-url 127.0.0.1:8392)
for pass in 1_http 2_grpc 3_grpc 4_http; do
  extra=(); [ "${pass#*_}" = grpc ] && extra=("${grpc[@]}")
  uptime >> load.txt
  quire bench serve --url http://127.0.0.1:8391 --workload W2 --repeats 3 --warmup 1 \
    "${extra[@]}" --output "w2_$pass.json" > "w2_$pass.txt" 2>&1
done
for pass in 1_http 2_grpc 3_grpc 4_http; do
  extra=(); [ "${pass#*_}" = grpc ] && extra=("${grpc[@]}")
  uptime >> load.txt
  quire bench serve --url http://127.0.0.1:8391 --workload W5 --num-requests 60 \
    --concurrency 30 --repeats 1 "${extra[@]}" --output "w5_$pass.json" > "w5_$pass.txt" 2>&1
done
uptime >> load.txt
