/* Throughput of vdpbf16ps and vpdpbusd on 512-bit registers, one thread: 12 independent
 * accumulators, so the loop is bound by issue, not latency. Prints GFLOP/s (bf16: 64
 * FLOP an instruction; int8: 128 ops) and instructions a nanosecond.
 * gcc -O3 -mavx512f -mavx512bf16 -mavx512vnni -o dot_peak dot_peak.c (at -O2 the
 * accumulators live on the stack and the figures halve) */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define N 12
int main(void) {
    const long iters = 100000000;
    for (int kind = 0; kind < 2; kind++) {
        double best = 0;
        for (int rep = 0; rep < 5; rep++) {
            __m512 a[N]; __m512i b[N];
            for (int i = 0; i < N; i++) { a[i] = _mm512_set1_ps(i); b[i] = _mm512_set1_epi32(i); }
            __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f803f81);
            __m512i u = _mm512_set1_epi32(0x01010101), v = _mm512_set1_epi32(0x02020202);
            double t0 = now();
            if (kind == 0) {
                for (long it = 0; it < iters / N; it++)
                    for (int i = 0; i < N; i++) { a[i] = _mm512_dpbf16_ps(a[i], x, y); __asm__ volatile("" : "+v"(a[i])); }
            } else {
                for (long it = 0; it < iters / N; it++)
                    for (int i = 0; i < N; i++) { b[i] = _mm512_dpbusd_epi32(b[i], u, v); __asm__ volatile("" : "+v"(b[i])); }
            }
            double dt = now() - t0, rate = iters / dt / 1e9;
            if (rate > best) best = rate;
            float s = 0; int si = 0;
            for (int i = 0; i < N; i++) { s += _mm512_reduce_add_ps(a[i]); si += _mm512_reduce_add_epi32(b[i]); }
            if (s == 1.2345f && si == 7) printf("x");
        }
        printf("%s: %.2f instructions/ns, %.0f GFLOP/s (ops/s)\n", kind ? "vpdpbusd zmm" : "vdpbf16ps zmm", best, best * (kind ? 128 : 64));
    }
    return 0;
}
