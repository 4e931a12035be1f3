/* Decode attention of two builds alternated in one process: quire_paged_decode_bf16 of
 * each library over 30 layers' bfloat16 pools (SmolLM2's heads: 9 query, 3 KV, 64 dims,
 * 16-slot blocks scattered), 40 rounds, best and mean ms a layer of each. Runs on this
 * VM drift by more than the builds differ, so the builds share a process and alternate.
 *
 *   ./build_level.sh BEFORE_TREE before.so && ./build_level.sh AFTER_TREE after.so
 *   gcc -O2 -fopenmp attention_ab.c -o attention_ab -ldl
 *   OMP_NUM_THREADS=2 ./attention_ab ./before.so ./after.so B CTX [BS1 BS2]
 *
 * BS1 and BS2 (16 unless given): each side's slots a block, to compare page sizes with
 * one build given twice.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*pd_fn)(const float *, const uint16_t *, const uint16_t *, const int64_t *, int64_t,
                     const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float *);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
  pd_fn fs[2];
  for (int i = 0; i < 2; i++) { void *h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL); fs[i] = (pd_fn)dlsym(h, "quire_paged_decode_bf16"); }
  int64_t B = atoi(argv[3]), ctx = atoi(argv[4]), hq = 9, hkv = 3, d = 64, L = 30;
  int64_t bss[2] = {argc > 6 ? atoi(argv[5]) : 16, argc > 6 ? atoi(argv[6]) : 16};
  uint16_t *caches[2][30]; int64_t *tabs[2], pers[2]; size_t halves[2];
  for (int side = 0; side < 2; side++) { int64_t bs = bss[side];
  int64_t per = (ctx + bs - 1) / bs, pool = B * per + 8; if (pool < 4096) pool = 4096;
  size_t half = (size_t)pool * bs * hkv * d;
  uint16_t **cache = caches[side]; for (int l = 0; l < L; l++) { cache[l] = malloc(2 * half * 2); for (size_t i = 0; i < 2 * half; i++) cache[l][i] = 0x3f80 + (rand() & 0x7f) - 0x40; }
  int64_t *perm = malloc(sizeof(int64_t) * pool); for (int64_t i = 0; i < pool; i++) perm[i] = i;
  for (int64_t i = pool - 1; i > 0; i--) { int64_t j = rand() % (i + 1), t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
  tabs[side] = perm; pers[side] = per; halves[side] = half; }
  int64_t *lens = malloc(8 * B); for (int64_t s = 0; s < B; s++) lens[s] = ctx;
  float *q = malloc(sizeof(float) * (size_t)(B * hq * d));
  float *out = malloc(sizeof(float) * (size_t)(B * hq * d)); for (int64_t i = 0; i < B * hq * d; i++) q[i] = (rand() % 100) * 0.01f;
  double best[2] = {1e9, 1e9}, sum[2] = {0, 0};
  for (int rep = 0; rep < 40; rep++) {
    pd_fn f = fs[rep & 1]; double t0 = now();
    int sd = rep & 1; for (int l = 0; l < L; l++) f(q, caches[sd][l], caches[sd][l] + halves[sd], tabs[sd], pers[sd], lens, B, hq, hkv, d, bss[sd], 0.125f, 0, out);
    double dt = (now() - t0) / L; if (dt < best[rep & 1]) best[rep & 1] = dt; sum[rep & 1] += dt;
  }
  for (int i = 0; i < 2; i++) printf("%s bs=%ld B=%ld ctx=%ld: best %.3f mean %.3f ms a layer\n", argv[1 + i], bss[i], B, ctx, best[i] * 1e3, sum[i] / 20 * 1e3);
}
