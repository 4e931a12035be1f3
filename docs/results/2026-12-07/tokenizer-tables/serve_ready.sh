#!/bin/bash
# quire serve MODEL (64 MiB of KV) from a worktree CORE_DIR: seconds until GET /v1/models answers, then one completion
# $1: PYTHONPATH core dir, $2: model
PORT=$((8100 + RANDOM % 500))
start=$(date +%s.%N)
PYTHONPATH=$1 quire serve --model $2 --port $PORT --kv-cache-memory 64MiB > /tmp/serve.log 2>&1 &
PID=$!
for i in $(seq 1 600); do
  if curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$PORT/v1/models 2>/dev/null | grep -q 200; then break; fi
  sleep 0.05
done
end=$(date +%s.%N)
out=$(curl -s http://127.0.0.1:$PORT/v1/completions -H 'Content-Type: application/json' -d '{"model":"'$2'","prompt":"Hello","max_tokens":3}' | head -c 300)
kill -INT $PID; wait $PID 2>/dev/null
echo "ready $(echo "$end - $start" | bc) s | $out"
