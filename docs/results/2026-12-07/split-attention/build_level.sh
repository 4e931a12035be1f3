#!/bin/bash
# build_level.sh TREE OUT.so [cflags...]: the avx512_bf16 level's library from TREE's
# C sources, with the flags quire's kernel_build gives that level (see the prebuilt
# library's .json beside it), for the A/B harnesses here.
tree=$1 out=$2; shift 2
gcc -O3 -fopenmp -shared -fPIC -std=c11 -march=x86-64 -mavx2 -mfma -mavx512f -mavx512bw \
    -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni "$@" -o "$out" \
    "$tree"/core/quire/platforms/cpu/csrc/*.c -lm
