#!/bin/bash
# NEW: a checkout of this stop; BASE: one of da1569e (git worktree add BASE da1569e); OUT: where results go
OUT=${OUT:-.}; NEW=${NEW:?}; BASE=${BASE:?}
HF=$HOME/.cache/quire/peers/models/SmolLM2-135M-Instruct.Q4_1-98362432-hf
GG=$HOME/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf
run() { local tree=$1 tag=$2; shift 2
  (cd $tree && PYTHONPATH=$tree/core quire bench throughput --workload W1 --repeats 1 --warmup 1 --output $OUT/$tag.json "$@" > $OUT/$tag.txt 2>&1)
  echo "$tag $(grep 'total tokens/s' $OUT/$tag.txt)"; }
Q='{"group_size": -1}'
run $NEW new_rows_f32 --model $HF --quantization w8a8 --quantization-config "$Q"
run $BASE base_rows_f32 --model $HF --quantization w8a8 --quantization-config "$Q"
run $NEW new_rows_bf16 --model $HF --quantization w8a8 --quantization-config "$Q" --dtype bfloat16
run $BASE base_rows_bf16 --model $HF --quantization w8a8 --quantization-config "$Q" --dtype bfloat16
run $NEW new_w8a8_f32 --model $HF --quantization w8a8
run $BASE base_w8a8_f32 --model $HF --quantization w8a8
run $NEW new_int8act --model $GG --platform-options activations=int8
run $BASE base_int8act --model $GG --platform-options activations=int8
run $NEW gguf_default --model $GG
echo DONE
