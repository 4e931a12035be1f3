#!/usr/bin/env bash
# W5 over HTTP and gRPC against one quire serve (see README.md), in ABBA order.
set -euo pipefail
for pass in ${PASSES:-1_http 2_grpc 3_grpc 4_http}; do
  t=${pass#*_}; extra=()
  [ "$t" = grpc ] && extra=(--transport grpc --grpc-url 127.0.0.1:8392)
  uptime >> load.txt
  quire bench serve --url http://127.0.0.1:8391 --workload W5 --num-requests 60 \
    --concurrency 30 --repeats 1 "${extra[@]}" --output "w5_$pass.json" > "w5_$pass.txt" 2>&1
done
uptime >> load.txt
