#!/usr/bin/env bash
# The A/B workload (W7) against one `quire serve` holding both models under one KV
# budget, and against two `quire serve` processes splitting the same budget in halves;
# each with requests alternating between the models and with traffic that shifts from
# one to the other halfway. The two servers' OpenMP threads wait passively, as the one
# server's cores do (spinning, two servers on one host slow each other 2.5x).
# Usage: run.sh OUT_DIR [BUDGET_MIB] [REPEATS]
set -euo pipefail
out=${1:?OUT_DIR}; budget=${2:-512}; repeats=${3:-1}
mkdir -p "$out"
model=${MODEL:-$HOME/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf}
common=(--device cpu --max-num-seqs 64 --max-model-len 1024 --log-level warning)
bench=(quire bench serve --workload W7 --model "$model" --repeats "$repeats")

wait_up() { until curl -sf "$1/health" >/dev/null; do sleep 1; done; }
rss_mib() {  # resident memory of process trees (threads not counted twice), MiB
  local total=0
  for root in "$@"; do
    for pid in $(pstree -p -T "$root" | grep -o '([0-9]*)' | tr -d '()'); do
      total=$((total + $(awk '/VmRSS/ {print $2}' /proc/$pid/status 2>/dev/null || echo 0)))
    done
  done
  echo $((total / 1024))
}
peak_rss() {  # the highest rss_mib of the trees while the pass runs: peak_rss FILE PIDS...
  local file=$1; shift
  echo 0 > "$file"
  while true; do
    local now; now=$(rss_mib "$@")
    [ "$now" -gt "$(cat "$file")" ] && echo "$now" > "$file"
    sleep 1
  done
}

# one server, two models, one budget
quire serve --model "$model" --model "$model" --served-model-name a b --port 8100 \
  --kv-cache-memory "${budget}MiB" "${common[@]}" 2>"$out/one.log" &
one=$!
wait_up http://127.0.0.1:8100
for split in alternate halves; do
  peak_rss "$out/.peak" $one & sampler=$!
  "${bench[@]}" --url http://127.0.0.1:8100 --served-model-name a --served-model-name b \
    --split "$split" --output "$out/one-$split.json" > "$out/one-$split.txt"
  kill $sampler
  echo "one server, $split: peak $(cat "$out/.peak") MiB resident (all processes)" >> "$out/rss.txt"
done
kill -TERM $one; wait $one || true

# two servers, half the budget each
quire serve --model "$model" --served-model-name a --port 8101 \
  --kv-cache-memory "$((budget / 2))MiB" "${common[@]}" \
  --platform-options wait_policy=passive 2>"$out/two-a.log" &
a=$!
quire serve --model "$model" --served-model-name b --port 8102 \
  --kv-cache-memory "$((budget / 2))MiB" "${common[@]}" \
  --platform-options wait_policy=passive 2>"$out/two-b.log" &
b=$!
wait_up http://127.0.0.1:8101; wait_up http://127.0.0.1:8102
for split in alternate halves; do
  peak_rss "$out/.peak" $a $b & sampler=$!
  "${bench[@]}" --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 \
    --served-model-name a --served-model-name b \
    --split "$split" --output "$out/two-$split.json" > "$out/two-$split.txt"
  kill $sampler
  echo "two servers, $split: peak $(cat "$out/.peak") MiB resident (all processes)" >> "$out/rss.txt"
done
rm -f "$out/.peak"
kill -TERM $a $b; wait $a $b || true
