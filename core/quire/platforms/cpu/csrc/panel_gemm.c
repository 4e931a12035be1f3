/*
 * float32 products on weights packed in column panels (cpu platform): every product of
 * a float32 linear layer on AVX2 hosts, from a decode batch to a 2048-token prompt.
 *
 * oneDNN, which ran these products before, measured 73-112 GFLOP/s inside a SmolLM2
 * decode step of 64 rows against ~145 for the 2048-row steps of a prompt: its blocking
 * favours tall products. This is the classic register-blocked kernel: a tile of up to 6
 * rows by 16 columns held in 12 AVX registers while it walks K, each step broadcasting
 * one value per row and loading 16 weights, 12 FMAs. Isolated, 64-66 rows: 136-140
 * GFLOP/s on the 576-wide products where oneDNN gave 103-114. From QUIRE_PACK_MIN_ROWS
 * rows on, the rows are first packed into 6-row tiles, 512 rows at a time; a 2048-row
 * prompt step then measured 3.05 s against oneDNN's 3.58 s.
 *
 * Weight layout ("panels"): panel p holds columns 16p .. 16p + 15 as [K][16] floats,
 * zero past N. Work is split over panels with OpenMP (the libgomp torch loaded), each
 * thread a contiguous share; the AVX-512 build walks its share 4 panels to a tile.
 * Arithmetic: float32 FMAs along K in order, one sum per output, packed or not, at every
 * ISA level (AVX-512's results equal AVX2's bit for bit); results agree with other
 * GEMMs to float32 rounding.
 *
 * Without AVX2 and FMA the entry point returns 1 and the caller keeps oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* One buffer per calling thread, kept between calls (grown, never shrunk): a fresh
 * allocation of a few MB is an mmap and its page faults every call, which made a
 * 2048-row prompt step slower than oneDNN where the kept buffer is 9% faster. */
static __thread void *thread_scratch;
static __thread size_t thread_scratch_bytes;

float *quire_thread_scratch(size_t floats) {
    return quire_grown(&thread_scratch, &thread_scratch_bytes, floats * sizeof(float));
}

void *quire_aligned_alloc(size_t bytes) {
    const size_t line = 64;
    return aligned_alloc(line, (bytes + line - 1) / line * line);
}

void *quire_grown(void **buf, size_t *held, size_t bytes) {
    if (bytes > *held) {
        void *grown = quire_aligned_alloc(bytes);
        if (grown == NULL)
            return NULL;
        free(*buf);
        *buf = grown;
        *held = bytes;
    }
    return *buf;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#define TILE_ROWS 6

#if defined(__AVX512F__)

/* AVX-512 (the avx512 ISA level): a row's 16 columns are one register, so a 6 x 16 tile
 * holds 6 accumulators, too few to cover the FMA latency on two pipes; a tile spans NP
 * adjacent panels instead (up to TILE_PANELS = 4: 6 rows x 64 columns, 24 accumulators,
 * four weight loads and 6 broadcasts per K step; the blockings compared are in
 * docs/bench.md). Panel j is b + j * pstride; row r's panel j goes to
 * out[(r * NP + j) * 16]. Each output is still one sum along K in order: results equal
 * the AVX2 path's bit for bit. */
#define TILE_PANELS 4

static inline __attribute__((always_inline)) void tile_wide(int MR, int NP, const float *a,
                                                            int64_t rs, int64_t ks,
                                                            const float *b, int64_t pstride,
                                                            int64_t k, float *out) {
    __m512 c[TILE_ROWS][TILE_PANELS];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) c[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++, b += 16, a += ks) {
        __m512 w[TILE_PANELS];
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) w[j] = _mm512_loadu_ps(b + j * pstride);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const __m512 x = _mm512_set1_ps(a[r * rs]);
#pragma GCC unroll 4
            for (int j = 0; j < NP; j++) c[r][j] = _mm512_fmadd_ps(x, w[j], c[r][j]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) _mm512_storeu_ps(out + (r * NP + j) * 16, c[r][j]);
}

/* One panel (the last of a thread's share, when it has an odd count). */
static inline __attribute__((always_inline)) void tile(int MR, const float *a, int64_t rs,
                                                       int64_t ks, const float *b, int64_t k,
                                                       float *out) {
    tile_wide(MR, 1, a, rs, ks, b, 0, k, out);
}

/* One row: four positions of K to four accumulators, as the AVX2 tile1 below. */
static void tile1(const float *a, const float *b, int64_t k, float *out) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    int64_t i = 0;
    for (; i + 4 <= k; i += 4, b += 64) {
        c0 = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), _mm512_loadu_ps(b), c0);
        c1 = _mm512_fmadd_ps(_mm512_set1_ps(a[i + 1]), _mm512_loadu_ps(b + 16), c1);
        c2 = _mm512_fmadd_ps(_mm512_set1_ps(a[i + 2]), _mm512_loadu_ps(b + 32), c2);
        c3 = _mm512_fmadd_ps(_mm512_set1_ps(a[i + 3]), _mm512_loadu_ps(b + 48), c3);
    }
    for (; i < k; i++, b += 16)
        c0 = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), _mm512_loadu_ps(b), c0);
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)));
}

#else

#define TILE_PANELS 1

/* out[r * 16 + c] = sum_k a[r * rs + k * ks] * b[k * 16 + c] for r < MR: rows read in
 * place (rs = the row length, ks = 1) or packed by pack_rows (rs = 1, ks = 6). MR and ks
 * are compile-time constants at each call, so the unused accumulators fold away and
 * each layout gets its own loop. */
static inline __attribute__((always_inline)) void tile(int MR, const float *a, int64_t rs,
                                                       int64_t ks, const float *b, int64_t k,
                                                       float *out) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t i = 0; i < k; i++, b += 16, a += ks) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        __m256 x;
#define ROW(R, C0, C1)                                                                     \
    if (MR > R) {                                                                          \
        x = _mm256_broadcast_ss(a + R * rs);                                               \
        C0 = _mm256_fmadd_ps(x, b0, C0);                                                   \
        C1 = _mm256_fmadd_ps(x, b1, C1);                                                   \
    }
        ROW(0, c00, c01) ROW(1, c10, c11) ROW(2, c20, c21)
        ROW(3, c30, c31) ROW(4, c40, c41) ROW(5, c50, c51)
#undef ROW
    }
    const __m256 rows[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    memcpy(out, rows, sizeof(float) * 16 * MR);
}

/* One row: the tile above would chain every FMA on two accumulators and wait on their
 * latency, so four positions of K go to four accumulator pairs. */
static void tile1(const float *a, const float *b, int64_t k, float *out) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00;
    int64_t i = 0;
    for (; i + 4 <= k; i += 4, b += 64) {
        __m256 x = _mm256_broadcast_ss(a + i);
        c00 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b), c00);
        c01 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 8), c01);
        x = _mm256_broadcast_ss(a + i + 1);
        c10 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 16), c10);
        c11 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 24), c11);
        x = _mm256_broadcast_ss(a + i + 2);
        c20 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 32), c20);
        c21 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 40), c21);
        x = _mm256_broadcast_ss(a + i + 3);
        c30 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 48), c30);
        c31 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 56), c31);
    }
    for (; i < k; i++, b += 16) {
        const __m256 x = _mm256_broadcast_ss(a + i);
        c00 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b), c00);
        c01 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + 8), c01);
    }
    const __m256 lo = _mm256_add_ps(_mm256_add_ps(c00, c10), _mm256_add_ps(c20, c30));
    const __m256 hi = _mm256_add_ps(_mm256_add_ps(c01, c11), _mm256_add_ps(c21, c31));
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
}

#endif

/* x [m, k] as row tiles [ceil(m / 6)][k][6], zero past m; tiles over the team. */
static void pack_rows(const float *x, int64_t m, int64_t k, float *packed) {
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float *dst = packed + t * TILE_ROWS * k;
        const int64_t rows = m - t * TILE_ROWS < TILE_ROWS ? m - t * TILE_ROWS : TILE_ROWS;
        for (int64_t r = 0; r < rows; r++) {
            const float *src = x + (t * TILE_ROWS + r) * k;
            for (int64_t i = 0; i < k; i++) dst[i * TILE_ROWS + r] = src[i];
        }
        for (int64_t r = rows; r < TILE_ROWS; r++) /* the last tile's missing rows */
            for (int64_t i = 0; i < k; i++) dst[i * TILE_ROWS + r] = 0.0f;
    }
}

/* mr rows (1..TILE_ROWS) by np adjacent panels (TILE_PANELS, 2 or 1; pstride floats
 * apart) into out, row r's panel j at out[(r * np + j) * 16]. The switches make MR and
 * NP constants for the tiles. `lone`: one row read in place, by tile1 panel by panel. */
static inline __attribute__((always_inline)) void tile_rows(int lone, int64_t mr, int np,
                                                            const float *a, int64_t rs,
                                                            int64_t ks, const float *b,
                                                            int64_t pstride, int64_t k,
                                                            float *out) {
    if (lone) {
        for (int j = 0; j < np; j++) tile1(a, b + j * pstride, k, out + 16 * j);
        return;
    }
#define CASES(TILE, ...)                                                                   \
    switch (mr) {                                                                          \
    case 6: TILE(6, __VA_ARGS__); break;                                                   \
    case 5: TILE(5, __VA_ARGS__); break;                                                   \
    case 4: TILE(4, __VA_ARGS__); break;                                                   \
    case 3: TILE(3, __VA_ARGS__); break;                                                   \
    case 2: TILE(2, __VA_ARGS__); break;                                                   \
    default: TILE(1, __VA_ARGS__); break;                                                  \
    }
#if TILE_PANELS > 1
    if (np == TILE_PANELS) {
        CASES(tile_wide, TILE_PANELS, a, rs, ks, b, pstride, k, out)
        return;
    }
    if (np == 2) {
        CASES(tile_wide, 2, a, rs, ks, b, pstride, k, out)
        return;
    }
#endif
    CASES(tile, a, rs, ks, b, k, out)
#undef CASES
}

/* y = a W^T (+ bias) for the rows of a, read in place (packed = 0: x, rows k apart) or
 * packed by pack_rows (packed = 1). Each thread of the team takes a contiguous share of
 * the panels, balanced to one panel whatever the team size, and walks it TILE_PANELS
 * at a time (its last 1-3 as 2 and 1), every row tile per group of panels. `packed` is
 * a constant at each call, so each layout gets its own inlined loops. */
static inline __attribute__((always_inline)) void panel_pass(int packed, const float *a0,
                                                             int64_t m, int64_t k,
                                                             const float *panels, int64_t n,
                                                             const float *bias, float *y) {
    const int64_t num_panels = (n + 15) / 16, pstride = k * 16;
    const int64_t rs = packed ? 1 : k, ks = packed ? TILE_ROWS : 1;
    const int64_t team = omp_get_num_threads();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < team; t++) {
        const int64_t end = num_panels * (t + 1) / team;
        int np;
        for (int64_t p = num_panels * t / team; p < end; p += np) {
            np = end - p >= TILE_PANELS ? TILE_PANELS : end - p >= 2 ? 2 : 1;
            const float *b = panels + p * pstride;
            float out[TILE_ROWS * TILE_PANELS * 16];
            for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
                const int64_t mr = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
                /* row r0, or packed tile r0 / 6 */
                tile_rows(mr == 1 && !packed, mr, np, a0 + r0 * k, rs, ks, b, pstride, k, out);
                for (int64_t r = 0; r < mr; r++)
                    for (int j = 0; j < np; j++) {
                        const int64_t col0 = 16 * (p + j);
                        const int64_t cols = n - col0 < 16 ? n - col0 : 16;
                        const float *src = out + (r * np + j) * 16;
                        float *dst = y + (r0 + r) * n + col0;
                        for (int64_t c = 0; c < cols; c++)
                            dst[c] = bias ? src[c] + bias[col0 + c] : src[c];
                    }
            }
        }
    }
}

void quire_panel_gemm_packed_team(const float *x, int64_t m, int64_t k, const float *panels,
                                  int64_t n, const float *bias, float *y, float *packed) {
    pack_rows(x, m, k, packed); /* its omp for ends in a barrier */
    panel_pass(1, packed, m, k, panels, n, bias, y);
}

int quire_panel_gemm_available(void) { return 1; }

void quire_panel_block(const float *x, int64_t ldx, int64_t m, int64_t k, const float *panels,
                       int64_t pstride, int64_t np, int64_t cols, float *y, int64_t ldy,
                       int accumulate) {
    int64_t g;
    for (int64_t p = 0; p < np; p += g) {
        g = np - p >= TILE_PANELS ? TILE_PANELS : np - p >= 2 ? 2 : 1;
        const float *b = panels + p * pstride;
        float out[TILE_ROWS * TILE_PANELS * 16];
        for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
            const int64_t mr = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
            tile_rows(mr == 1, mr, (int)g, x + r0 * ldx, ldx, 1, b, pstride, k, out);
            for (int64_t r = 0; r < mr; r++)
                for (int64_t j = 0; j < g; j++) {
                    const int64_t col0 = 16 * (p + j);
                    const int64_t n = cols - col0 < 16 ? cols - col0 : 16;
                    const float *src = out + (r * g + j) * 16;
                    float *dst = y + (r0 + r) * ldy + col0;
                    if (accumulate)
                        for (int64_t c = 0; c < n; c++) dst[c] += src[c];
                    else
                        for (int64_t c = 0; c < n; c++) dst[c] = src[c];
                }
        }
    }
}

void quire_panel_gemm_team(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                           const float *bias, float *y) {
    panel_pass(0, x, m, k, panels, n, bias, y);
}

/* Rows packed at a time: bounds the packed copy (512 x K floats, 3 MB for K = 1536)
 * whatever the number of rows, and a block of it stays in cache while the panels pass. */
#define PACK_BLOCK_ROWS 512

int quire_panel_gemm_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                         const float *bias, float *y) {
    const int64_t block = m < PACK_BLOCK_ROWS ? m : PACK_BLOCK_ROWS;
    const size_t need = (size_t)((block + TILE_ROWS - 1) / TILE_ROWS) * TILE_ROWS * (size_t)k;
    /* the packed rows; taken here: each thread of the team has its own buffer */
    float *packed = m >= QUIRE_PACK_MIN_ROWS ? quire_thread_scratch(need) : NULL;
    if (packed != NULL) {
#pragma omp parallel
        for (int64_t r0 = 0; r0 < m; r0 += block) {
            const int64_t rows = m - r0 < block ? m - r0 : block;
            quire_panel_gemm_packed_team(x + r0 * k, rows, k, panels, n, bias, y + r0 * n,
                                         packed);
        }
        return 0;
    }
#pragma omp parallel
    quire_panel_gemm_team(x, m, k, panels, n, bias, y);
    return 0;
}

#else

int quire_panel_gemm_available(void) { return 0; }

void quire_panel_block(const float *x, int64_t ldx, int64_t m, int64_t k, const float *panels,
                       int64_t pstride, int64_t np, int64_t cols, float *y, int64_t ldy,
                       int accumulate) {
    (void)np;
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < cols; j++) {
            const float *b = panels + (j / 16) * pstride + j % 16;
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc += x[r * ldx + i] * b[i * 16];
            y[r * ldy + j] = accumulate ? y[r * ldy + j] + acc : acc;
        }
}

void quire_panel_gemm_packed_team(const float *x, int64_t m, int64_t k, const float *panels,
                                  int64_t n, const float *bias, float *y, float *packed) {
    (void)packed;
    quire_panel_gemm_team(x, m, k, panels, n, bias, y);
}

/* Plain loops, for decode_layer.c's sake only: without the kernel no linear
 * keeps panels (quire/platforms/cpu/packed_linear.py), so nothing calls this. */
void quire_panel_gemm_team(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                           const float *bias, float *y) {
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++)
                acc += x[r * k + i] * panels[((j / 16) * k + i) * 16 + j % 16];
            y[r * n + j] = bias ? acc + bias[j] : acc;
        }
}

int quire_panel_gemm_f32(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                         const float *bias, float *y) {
    (void)x, (void)m, (void)k, (void)panels, (void)n, (void)bias, (void)y;
    return 1;
}

#endif
