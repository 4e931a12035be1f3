/*
 * bfloat16 products on weights packed in column panels of bf16 pairs (cpu platform,
 * hosts with AVX512_BF16): a bfloat16 model's decode batches run their four products
 * per layer here, inside the fused layer's one parallel region (decode_layer.c),
 * instead of four oneDNN calls with Python and a parallel region per gap between them.
 *
 * y = x W^T (+ bias), x bfloat16 rows (or float32 rows rounded to bfloat16, to nearest
 * even, as oneDNN's bfloat16 product takes them), W bfloat16, sums in float32: each
 * vdpbf16ps adds two products per column to a float32 accumulator. Outputs float32 or
 * bfloat16 (rounded once, at the end). Results agree with a float32 product of the
 * same bfloat16 values to float32 rounding of sums of K terms.
 *
 * Weight layout ("pair panels", NativeKernels.pack_bf16_panels): panel p holds
 * columns 16p .. 16p + 15 as [K2][16][2] bfloat16, K2 = ceil(K / 2), element (i, c, e)
 * = W[16p + c][2i + e], zero past N and K: one 64-byte load is 16 columns by two K
 * steps, multiplied by one row's pair of inputs broadcast.
 *
 * Tile: 6 rows by 4 adjacent panels (64 columns) in 24 accumulators, 4 weight loads and
 * 6 broadcasts per two K steps, the float32 panel kernel's blocking (panel_gemm.c);
 * rows are read in place (a pair is one 32-bit broadcast), so they need no packing.
 * Threads take contiguous shares of the panels, as there. A decode batch's weights
 * come from memory (a model's layers do not fit in cache), so each tile prefetches a
 * share of the next group of panels while it walks K (what that gains, and the kernel
 * against oneDNN: docs/bench.md, "fourth pass").
 *
 * Without AVX512_BF16 (levels below avx512_bf16) the entry points return 1 and no
 * linear keeps pair panels (quire/platforms/cpu/packed_linear.py).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#define BT_ROWS 6
#define BT_PANELS 4

int quire_bf16_gemm_available(void) { return 1; }

/* k float32 values rounded to bfloat16 (nearest even), then kp - k zeros. */
static void round_pairs(const float *src, int64_t k, int64_t kp, uint16_t *dst) {
    int64_t i = 0;
    for (; i + 16 <= k; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < k) {
        const __mmask16 m = (__mmask16)((1u << (k - i)) - 1);
        _mm256_mask_storeu_epi16(dst + i, m,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
    }
    for (i = k; i < kp; i++) dst[i] = 0;
}

/* MR rows (a, kp bfloat16 apart) by NP adjacent panels (b, pstride apart) over k2 pairs,
 * stored with the bias into y's columns col0 .. (n columns in all, rows n apart),
 * float32 or rounded to bfloat16. MR and NP are constants at every call. */
static inline __attribute__((always_inline)) void tile(int MR, int NP, const uint16_t *a,
                                                       int64_t kp, const uint16_t *b,
                                                       int64_t pstride, int64_t k2,
                                                       const float *bias, void *y,
                                                       int y_bf16, int64_t n, int64_t col0,
                                                       const char *pf, int64_t pf_lines,
                                                       int64_t pf_step) {
    __m512 acc[BT_ROWS][BT_PANELS];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k2; i++) {
        /* the next group's weights, pf_step lines a step, spread over the walk */
        for (int64_t l = i * pf_step; l < (i + 1) * pf_step && l < pf_lines; l++)
            _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
        __m512bh w[BT_PANELS];
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++)
            w[j] = (__m512bh)_mm512_loadu_si512(b + j * pstride + i * 32);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, a + r * kp + 2 * i, sizeof pair);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int j = 0; j < NP; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, w[j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NP; j++) {
        const int64_t c = col0 + 16 * j;
        const __mmask16 m = n - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - c)) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(m, bias + c) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const __m512 v = _mm512_add_ps(acc[r][j], add);
            if (y_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + r * n + c, m,
                                         (__m256i)_mm512_cvtneps_pbh(v));
            else
                _mm512_mask_storeu_ps((float *)y + r * n + c, m, v);
        }
    }
}

/* y = a W^T (+ bias) for m rows of a (kp bfloat16 apart, kp even and zero-padded);
 * each thread of the team a contiguous share of the panels, walked 4 at a time (its
 * last 1-3 as 2 and 1), every row tile per group of panels. Team function. */
static void pass(const uint16_t *a, int64_t m, int64_t kp, const uint16_t *panels, int64_t n,
                 const float *bias, void *y, int y_bf16) {
    const int64_t num_panels = (n + 15) / 16, k2 = kp / 2, pstride = k2 * 32;
    const int64_t team = omp_get_num_threads();
    const size_t esize = y_bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t tiles = (m + BT_ROWS - 1) / BT_ROWS;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < team; t++) {
        const int64_t end = num_panels * (t + 1) / team;
        int np;
        for (int64_t p = num_panels * t / team; p < end; p += np) {
            np = end - p >= BT_PANELS ? BT_PANELS : end - p >= 2 ? 2 : 1;
            const uint16_t *b = panels + p * pstride;
            /* the next group's panels (contiguous after this group's) stream from memory
             * while this group's row tiles run: a share of their lines per tile */
            const int64_t next = end - p - np;
            const int64_t next_np = next >= BT_PANELS ? BT_PANELS : next >= 2 ? 2 : next;
            const int64_t next_lines = next_np * pstride * 2 / 64;
            const int64_t share = (next_lines + tiles - 1) / tiles;
            const int64_t step = (share + k2 - 1) / k2;
            for (int64_t r0 = 0; r0 < m; r0 += BT_ROWS) {
                const int64_t mr = m - r0 < BT_ROWS ? m - r0 : BT_ROWS;
                const uint16_t *ar = a + r0 * kp;
                void *yr = (char *)y + (size_t)(r0 * n) * esize;
                const int64_t first = (r0 / BT_ROWS) * share;
                const int64_t lines = next_lines - first < share ? next_lines - first : share;
                const char *pf = (const char *)(b + np * pstride) + 64 * first;
#define ARGS ar, kp, b, pstride, k2, bias, yr, y_bf16, n, 16 * p, pf, lines, step
#define ROWS(NP)                                                                           \
    switch (mr) {                                                                          \
    case 6: tile(6, NP, ARGS); break;                                                      \
    case 5: tile(5, NP, ARGS); break;                                                      \
    case 4: tile(4, NP, ARGS); break;                                                      \
    case 3: tile(3, NP, ARGS); break;                                                      \
    case 2: tile(2, NP, ARGS); break;                                                      \
    default: tile(1, NP, ARGS); break;                                                     \
    }
                if (np == BT_PANELS) {
                    ROWS(BT_PANELS)
                } else if (np == 2) {
                    ROWS(2)
                } else {
                    ROWS(1)
                }
#undef ROWS
#undef ARGS
            }
        }
    }
}

void quire_bf16_gemm_team(const float *x, int64_t m, int64_t k, const uint16_t *panels,
                          int64_t n, const float *bias, float *y, uint16_t *rows) {
    const int64_t kp = k + (k & 1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) round_pairs(x + r * k, k, kp, rows + r * kp);
    pass(rows, m, kp, panels, n, bias, y, 0);
}

int quire_bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels,
                      int64_t n, const float *bias, void *y, int32_t y_bf16) {
    if (m <= 0 || k <= 0 || n <= 0)
        return 1;
    const uint16_t *a = x;
    int64_t kp = k;
    if (k & 1) { /* rows copied with a zero after each, so that pairs stay whole */
        kp = k + 1;
        uint16_t *padded = (uint16_t *)quire_thread_scratch((size_t)((m * kp + 1) / 2));
        if (padded == NULL)
            return 2;
        for (int64_t r = 0; r < m; r++) {
            memcpy(padded + r * kp, x + r * k, (size_t)k * sizeof(uint16_t));
            padded[r * kp + k] = 0;
        }
        a = padded;
    }
#pragma omp parallel
    pass(a, m, kp, panels, n, bias, y, y_bf16);
    return 0;
}

#else

int quire_bf16_gemm_available(void) { return 0; }

/* Never called: without AVX512_BF16 no linear keeps pair panels (decode_layer.c links
 * against it whatever the level). */
void quire_bf16_gemm_team(const float *x, int64_t m, int64_t k, const uint16_t *panels,
                          int64_t n, const float *bias, float *y, uint16_t *rows) {
    (void)x, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)y, (void)rows;
}

int quire_bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *panels,
                      int64_t n, const float *bias, void *y, int32_t y_bf16) {
    (void)x, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)y, (void)y_bf16;
    return 1;
}

#endif
