#!/usr/bin/env bash
# The cuda platform on a real NVIDIA GPU, in one call of the workplace's device tool:
# the conformance suite in full mode, then `quire bench` W1 and W2 with the hf peer on
# the same GPU. Everything is logged to $OUT/log.txt; the bench JSON lands in $OUT.
#
# Prepared here (the device machine has no network and starts bare):
#   pip wheel --no-deps --no-build-isolation . plugins/cuda -w .whl
#   pip download --no-deps ... gguf starlette uvicorn -d .whl   (see the device README)
#   .devdata/smol: SmolLM2-135M-Instruct's config and tokenizer files (no weights: the
#   GGUF is over the tool's 64 MiB limit, so the benchmark runs random weights of the
#   same shapes; with ignore_eos and fixed lengths the work is the same).
# Run with: device run, carry [".whl", ".devdata"], command
#   bash scripts/device_cuda_check.sh [conformance] [bench] [profile] [graphs]
# (default: conformance bench; profile: scripts/profile_steps.py on W1's and W2's shapes;
# graphs: decode graphs on and off: greedy outputs compared, W1 and W2 against the hf
# peer, launches per step and the device's busy share; then async scheduling on and off
# with graphs on: greedy outputs compared, W1 and W2 ITL with it on. `conformance graphs`
# fitted one call of about 450 s before the async part (about 150 s more, unmeasured):
# give `graphs` a call of its own.)
set -u
parts=${*:-conformance bench}
wants() { [[ " $parts " == *" $1 "* ]]; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 QUIRE_CACHE_DIR=/tmp/qcache
step() { echo; echo "== $1 ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"

step "install (wheels, no network)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
# `python3 -m quire.entrypoints.cli`, not a shell function: `timeout` below runs commands, not functions
python3 -m quire.entrypoints.cli plugins

if wants conformance; then
  step "conformance, full mode"
  timeout 240 python3 -m quire.entrypoints.cli conformance --device cuda --require-available
  echo "conformance exit: $?"
fi

step "random-weight SmolLM2-135M-shaped checkpoint"
python3 - <<'EOF'
import shutil, torch, transformers
from pathlib import Path
torch.manual_seed(0)
cfg = transformers.AutoConfig.from_pretrained(".devdata/smol")
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.save_pretrained("/tmp/smol")
for f in Path(".devdata/smol").iterdir():
    if f.name != "config.json":
        shutil.copy(f, "/tmp/smol")
print("saved", sum(p.numel() for p in model.parameters()), "parameters")
EOF

# The hf peer's "venv": the image's own Python, which has torch and transformers.
mkdir -p /tmp/qcache/peers/hf/bin
printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/qcache/peers/hf/bin/python
chmod +x /tmp/qcache/peers/hf/bin/python

bench() {  # name, then quire bench arguments
  local name=$1; shift
  step "bench $name"
  timeout 150 python3 -m quire.entrypoints.cli bench "$@" --model /tmp/smol --device cuda \
    --kv-cache-memory 16GiB --output "$OUT/$name.json"
  echo "bench $name exit: $?"
}
if wants bench; then
  bench w1_bf16 throughput --workload W1 --dtype bfloat16 --peer hf
  bench w2_bf16 latency --workload W2 --dtype bfloat16 --peer hf
  bench w1_f32 throughput --workload W1 --dtype float32 --peer hf
fi
if wants profile; then
  for batch in 1 64; do
    step "profile: $batch sequences, bfloat16"
    timeout 120 python3 scripts/profile_steps.py --model /tmp/smol --device cuda \
      --dtype bfloat16 --kv-cache-memory 16GiB --batch $batch --prompt-len 128 --steps 20 \
      --top 12 2>&1 | grep -v "^USDT\|STAGE:" | tee "$OUT/profile_b$batch.txt"
  done
fi
if wants graphs; then
  step "graphs: greedy outputs with and without decode graphs (preemption included)"
  timeout 180 python3 - <<'EOF'
import logging, torch, transformers
from quire import LLM, SamplingParams
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
cfg = transformers.AutoConfig.from_pretrained("/tmp/smol")
head = cfg.hidden_size // cfg.num_attention_heads
prompts = [[(7 * i + 13 * j) % 40000 + 10 for j in range(8 + 9 * i)] for i in range(24)]
params = [SamplingParams(temperature=0, max_tokens=16 + 8 * (i % 5), ignore_eos=True)
          for i in range(24)]
for dtype, size in (("float32", 4), ("bfloat16", 2)):
    page = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head * size
    for pages in (4096, 40):  # plenty, and few enough to preempt
        outs = {}
        for eager in (True, False):
            llm = LLM("/tmp/smol", device="cuda", dtype=dtype, max_model_len=320,
                      max_num_seqs=16, kv_cache_memory=pages * page, enforce_eager=eager)
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            outs[eager] = [o.outputs[0].token_ids for o in got]
            preempted = llm.engine.core.scheduler.stats.num_preemptions
            del llm, got
            torch.cuda.empty_cache()
        same = sum(a == b for a, b in zip(outs[True], outs[False]))
        parted = [next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
                  for a, b in zip(outs[True], outs[False]) if a != b]
        print(f"{dtype}, {pages} pages ({preempted} preemptions with graphs): {same}/"
              f"{len(prompts)} sequences identical with and without graphs; diverging at "
              f"tokens {parted}")
EOF
  echo "graphs outputs exit: $?"
  bench w1_graphs throughput --workload W1 --dtype bfloat16 --peer hf
  bench w1_eager throughput --workload W1 --dtype bfloat16 --enforce-eager true
  bench w2_graphs latency --workload W2 --dtype bfloat16 --peer hf
  bench w2_eager latency --workload W2 --dtype bfloat16 --enforce-eager true
  step "graphs + async scheduling: greedy outputs with it on and off (preemption included)"
  timeout 150 python3 - <<'EOF'
import torch, transformers
from quire import LLM, SamplingParams
cfg = transformers.AutoConfig.from_pretrained("/tmp/smol")
head = cfg.hidden_size // cfg.num_attention_heads
prompts = [[(7 * i + 13 * j) % 40000 + 10 for j in range(8 + 9 * i)] for i in range(24)]
params = [SamplingParams(temperature=0, max_tokens=16 + 8 * (i % 5), ignore_eos=True)
          for i in range(24)]
page = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head * 2
for pages in (4096, 40):  # plenty, and few enough to preempt
    outs = {}
    for on in (False, True):
        llm = LLM("/tmp/smol", device="cuda", dtype="bfloat16", max_model_len=320,
                  max_num_seqs=16, kv_cache_memory=pages * page, async_scheduling=on)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outs[on] = [o.outputs[0].token_ids for o in got]
        preempted = llm.engine.core.scheduler.stats.num_preemptions
        del llm, got
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outs[False], outs[True]))
    parted = [next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
              for a, b in zip(outs[False], outs[True]) if a != b]
    print(f"bfloat16, graphs on, {pages} pages ({preempted} preemptions with async): {same}/"
          f"{len(prompts)} sequences identical with async scheduling on and off; diverging "
          f"at tokens {parted}")
EOF
  echo "async outputs exit: $?"
  bench w1_graphs_async throughput --workload W1 --dtype bfloat16 --async-scheduling true
  bench w2_graphs_async latency --workload W2 --dtype bfloat16 --async-scheduling true
  for eager in false true; do
    step "profile: 64 sequences, bfloat16, enforce_eager=$eager (launches per step, busy share)"
    timeout 90 python3 scripts/profile_steps.py --model /tmp/smol --device cuda \
      --dtype bfloat16 --kv-cache-memory 16GiB --batch 64 --prompt-len 128 --steps 20 \
      --top 8 --enforce-eager $eager 2>&1 | grep -v "^USDT\|STAGE:" \
      | tee "$OUT/profile_graphs_eager_$eager.txt"
  done
fi
nvidia-smi --query-gpu=memory.used,clocks.sm --format=csv
step "done"
