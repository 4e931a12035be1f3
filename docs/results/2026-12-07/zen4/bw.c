/* Sequential read bandwidth over a 512 MB buffer, with the OpenMP threads given. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(void) {
    const size_t n = (size_t)512 << 20;
    char *buf = aligned_alloc(64, n);
    memset(buf, 1, n);
    double best = 0;
    for (int rep = 0; rep < 8; rep++) {
        double t0 = omp_get_wtime();
        __m512i total = _mm512_setzero_si512();
#pragma omp parallel
        {
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static)
            for (size_t i = 0; i < n; i += 256) {
                a0 = _mm512_add_epi64(a0, _mm512_load_si512(buf + i));
                a1 = _mm512_add_epi64(a1, _mm512_load_si512(buf + i + 64));
                a2 = _mm512_add_epi64(a2, _mm512_load_si512(buf + i + 128));
                a3 = _mm512_add_epi64(a3, _mm512_load_si512(buf + i + 192));
            }
#pragma omp critical
            total = _mm512_add_epi64(total, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
        }
        double dt = omp_get_wtime() - t0, gbs = n / dt / 1e9;
        if (gbs > best) best = gbs;
        if (_mm512_reduce_add_epi64(total) == 42) printf("x");
    }
    printf("%d threads: %.1f GB/s sequential read\n", omp_get_max_threads(), best);
    return 0;
}
