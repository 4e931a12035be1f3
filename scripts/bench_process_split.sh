#!/usr/bin/env bash
# W5 through `quire serve` in each process layout, one after another on this machine:
# the engine core in the API server's process (--engine-in-process), in its own process
# (the default), and behind two API servers. Writes one JSON per layout to $OUT_DIR.
# usage: scripts/bench_process_split.sh OUT_DIR [extra `quire bench serve` flags]
set -euo pipefail
out=${1:?OUT_DIR}; shift
mkdir -p "$out"
port=8391
run_layout() {
  local name=$1; shift
  quire serve --port $port --log-level warning "$@" &
  local pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 0.5
  done
  quire bench serve --url "http://127.0.0.1:$port" --workload W5 --repeats 1 \
    --output "$out/w5-$name.json" "${EXTRA[@]}"
  kill -TERM $pid
  wait $pid || true
}
EXTRA=("$@")
run_layout in-process --engine-in-process
run_layout core-process
run_layout two-api-servers --api-server-count 2
