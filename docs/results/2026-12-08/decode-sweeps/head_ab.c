/* The output layer's one-row product (SmolLM2: Q8_0, 49152 x 576, 30 MB, more than the
 * L3) of two builds alternated in one process, against two threads reading the same
 * bytes: OMP_NUM_THREADS=2 ./head_ab a.so b.so */
#include <dlfcn.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*f32_fn)(int32_t, const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t,
                      const float *, const float *, float *, int64_t);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
  f32_fn fs[2];
  for (int i = 0; i < 2; i++) { void *h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL); fs[i] = (f32_fn)dlsym(h, "quire_quant_gemm_f32"); }
  const int64_t n = 49152, k = 576, bpr = k / 32 * 34; size_t bytes = n * bpr;
  uint8_t *w = aligned_alloc(64, (bytes + 63) / 64 * 64); for (size_t i = 0; i < bytes; i++) w[i] = rand();
  for (int64_t b = 0; b < n * k / 32; b++) { w[b * 34] = 0; w[b * 34 + 1] = 0x20; }
  /* a second copy so each round's read misses the L3 */
  uint8_t *w2 = aligned_alloc(64, (bytes + 63) / 64 * 64); for (size_t i = 0; i < bytes; i++) w2[i] = w[i];
  static float x[576], y[49152]; for (int i = 0; i < 576; i++) x[i] = (i % 7) * 0.1f;
  double best[3] = {1e9, 1e9, 1e9};
  for (int rep = 0; rep < 60; rep++) {
    int s = rep % 3; const uint8_t *wr = (rep & 1) ? w2 : w; double t0 = now();
    if (s < 2) fs[s](8, x, 1, k, wr, bpr, n, NULL, NULL, y, n);
    else {
      #pragma omp parallel
      { int t = omp_get_thread_num(), nt = omp_get_num_threads(); size_t lo = bytes * t / nt / 64 * 64, hi = bytes * (t + 1) / nt / 64 * 64; __m512 a = _mm512_setzero_ps();
        for (size_t i = lo; i < hi; i += 64) { __builtin_prefetch(wr + i + 4096); a = _mm512_add_ps(a, _mm512_loadu_ps((const float *)(wr + i))); }
        y[t] += _mm512_reduce_add_ps(a); }
    }
    double dt = now() - t0; if (dt < best[s]) best[s] = dt;
  }
  printf("%s %.3f ms, %s %.3f ms, reading %.3f ms (%.1f MB)\n", argv[1], best[0] * 1e3, argv[2], best[1] * 1e3, best[2] * 1e3, bytes / 1e6);
}
