#!/bin/bash
# sweep_split.sh TREE: paged_decode.c's SPLIT_MIN / SPLIT_ITEMS as build flags (a copy of
# TREE's C sources with the two #defines wrapped in #ifndef), one library per pair,
# each alternated in one process with the 64 / 4 build by attention_ab.c
# (../../2026-12-07/split-attention) at four shapes.
set -e
here=$(cd "$(dirname "$0")" && pwd); ab=$here/../../2026-12-07/split-attention
tree=$1 work=$(mktemp -d)
mkdir -p "$work/core/quire/platforms/cpu"
cp -r "$tree/core/quire/platforms/cpu/csrc" "$work/core/quire/platforms/cpu/"
sed -i -e 's/^#define SPLIT_MIN \(.*\)/#ifndef SPLIT_MIN\n#define SPLIT_MIN \1\n#endif/' \
       -e 's/^#define SPLIT_ITEMS \(.*\)/#ifndef SPLIT_ITEMS\n#define SPLIT_ITEMS \1\n#endif/' \
       "$work/core/quire/platforms/cpu/csrc/paged_decode.c"
gcc -O2 -fopenmp "$ab/attention_ab.c" -o "$work/attention_ab" -ldl
for v in 64_4 32_4 128_4 64_2 64_8 64_1; do
    "$ab/build_level.sh" "$work" "$work/sw_$v.so" -DSPLIT_MIN=${v%_*} -DSPLIT_ITEMS=${v#*_}
done
for v in 32_4 128_4 64_2 64_8 64_1; do
    for shape in "1 4000" "1 300" "2 1000" "4 200"; do
        OMP_NUM_THREADS=2 "$work/attention_ab" "$work/sw_64_4.so" "$work/sw_$v.so" $shape
    done
done
