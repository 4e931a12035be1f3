/* One-row bfloat16 products of two builds alternated in one process, as the decode
 * stack runs them: SmolLM2's 30 layers of qkv, o, gate/up and down (BIG=1: a 1B model's
 * 16) in one parallel region, quire_quant_rows_bf16_team then a barrier each, random
 * blocks of format FMT (quant_gemm.c's ids: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 12 Q4_K,
 * 14 Q6_K; every one more than the L3, so read from memory), 80 rounds. FMT -1: no
 * product, each thread reading its share of 24 bytes a 32-weight block of the same
 * shapes (the reading alone; scale it by a format's bytes a block to compare).
 *
 *   ./build_level.sh TREE base.so; git apply gather_scales.patch; ./build_level.sh TREE new.so
 *   gcc -O2 -mavx512f -fopenmp products_stack_ab.c -o products_stack_ab -ldl
 *   OMP_NUM_THREADS=2 ./products_stack_ab ./base.so ./new.so FMT
 */
#include <dlfcn.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef void (*team_fn)(int32_t, const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t,
                        const float *, float *, int64_t);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
  team_fn fs[2];
  for (int i = 0; i < 2; i++) { void *h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL); if (!h) { printf("%s\n", dlerror()); return 1; }
    fs[i] = (team_fn)dlsym(h, "quire_quant_rows_bf16_team"); }
  int fmt = atoi(argv[3]);
  int L = 30; int64_t shapes[4][2] = {{960,576},{576,576},{3072,576},{576,1536}};
  if (getenv("BIG")) { L = 16; int64_t b[4][2] = {{3072,2048},{2048,2048},{16384,2048},{2048,8192}}; memcpy(shapes, b, sizeof b); }
  const int BBY = fmt == 2 ? 18 : fmt == 3 ? 20 : fmt == 6 ? 22 : fmt == 12 ? 144 : fmt == 14 ? 210 : 24;
  const int BV = fmt >= 12 ? 256 : 32; /* weights a block */
  uint8_t *w[30][4]; size_t total = 0;
  for (int l = 0; l < L; l++) for (int p = 0; p < 4; p++) {
    size_t bytes = shapes[p][0] * (shapes[p][1] / BV) * BBY; w[l][p] = aligned_alloc(64, (bytes + 63) / 64 * 64);
    for (size_t i = 0; i < bytes; i++) w[l][p][i] = rand();
    for (int64_t r = 0; r < shapes[p][0] * shapes[p][1] / BV; r++) { uint8_t *b = w[l][p] + r*BBY + (fmt == 14 ? 208 : 0); b[0] = 0x00; b[1] = 0x30; if (fmt != 14) { b[2]=0; b[3]=0x30; } } /* finite scales */
    total += bytes; }
  static float x[16384], y[16384]; for (int i = 0; i < 16384; i++) x[i] = (i % 7) * 0.1f;
  double best[2] = {1e9, 1e9}, sum[2] = {0, 0};
  for (int rep = 0; rep < 80; rep++) {
    team_fn f = fs[rep & 1];
    double t0 = now();
    #pragma omp parallel
    for (int l = 0; l < L; l++) for (int p = 0; p < 4; p++) {
      if (fmt >= 0) f(fmt, x, 1, shapes[p][1], w[l][p], shapes[p][1] / BV * BBY, shapes[p][0], NULL, y, shapes[p][0]);
      else { size_t bytes = shapes[p][0] * (shapes[p][1] / BV) * BBY; int t = omp_get_thread_num(), n = omp_get_num_threads();
        size_t lo = bytes * t / n / 64 * 64, hi = bytes * (t + 1) / n / 64 * 64; __m512 a = _mm512_setzero_ps();
        for (size_t i = lo; i < hi; i += 64) { __builtin_prefetch(w[l][p] + i + 4096); a = _mm512_add_ps(a, _mm512_loadu_ps((float *)(w[l][p] + i))); }
        y[t] += _mm512_reduce_add_ps(a); }
      #pragma omp barrier
    }
    double dt = now() - t0; if (dt < best[rep & 1]) best[rep & 1] = dt; sum[rep & 1] += dt;
  }
  for (int i = 0; i < 2; i++) printf("%s: best %.3f ms, mean %.3f ms, %.1f GB/s at best\n", argv[1 + i], best[i] * 1e3, sum[i] / 40 * 1e3, total / best[i] / 1e9);
}
