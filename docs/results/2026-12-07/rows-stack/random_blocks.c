/*
 * What two threads read of blocks scattered over a 2 GB pool: a W1 step's KV bytes
 * (64 sequences x 12 blocks x keys and values x 30 layers) as blocks of BS bytes at
 * random places, each widened from bfloat16 and summed; AHEAD blocks prefetched ahead
 * with locality HINT (0: none). HUGE=1 in the environment backs the pool with
 * transparent huge pages (madvise MADV_HUGEPAGE) before it is first written.
 *
 *   gcc -O3 -march=native -fopenmp random_blocks.c -o random_blocks
 *   OMP_NUM_THREADS=2 ./random_blocks BS AHEAD HINT      (e.g. 6144 0 3)
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
/* Reads nb random blocks of `bs` bytes (e.g. 6144), summing as bf16->f32; prefetching
   `ahead` blocks ahead (0 = none), with hint `hint`. */
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    size_t pool = 1ull << 31; /* 2 GB */
    int bs = atoi(argv[1]), ahead = atoi(argv[2]), hint = atoi(argv[3]);
    size_t nblocks = pool / bs;
    char *mem = aligned_alloc(1 << 21, pool); if (getenv("HUGE")) madvise(mem, pool, 14);
    memset(mem, 1, pool);
    int per = 64 * 12 * 2 * 30; /* a step: 64 seqs x 12 blocks x K,V x 30 layers */
    int64_t *idx = malloc(sizeof(int64_t) * per);
    for (int i = 0; i < per; i++) idx[i] = ((int64_t)rand() * 7919 + rand()) % nblocks;
    float total = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        #pragma omp parallel for schedule(static) reduction(+:total)
        for (int i = 0; i < per; i++) {
            const char *b = mem + idx[i] * bs;
            if (ahead && i + ahead < per) {
                const char *p = mem + idx[i + ahead] * bs;
                for (int c = 0; c < bs; c += 64) {
                    if (hint == 3) __builtin_prefetch(p + c, 0, 3);
                    else if (hint == 2) __builtin_prefetch(p + c, 0, 2);
                    else __builtin_prefetch(p + c, 0, 1);
                }
            }
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < bs; c += 32)
                acc = _mm512_add_ps(acc, (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(b + c))), 16));
            total += _mm512_reduce_add_ps(acc);
        }
        double dt = now() - t0;
        if (rep >= 2) printf("bs=%d ahead=%d hint=%d: %.2f ms, %.1f GB/s\n", bs, ahead, hint, dt * 1e3, (double)per * bs / dt / 1e9);
    }
    return total == 12345;
}
