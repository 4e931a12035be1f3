/*
 * Shared by the cpu platform's C kernels (built into one library by
 * quire/platforms/cpu/native.py): small vector helpers, and the functions one kernel
 * file offers another.
 */
#ifndef QUIRE_CPU_KERNELS_H
#define QUIRE_CPU_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

/* Lanes summed as a tree (GCC and Clang turn this into shuffles). */
static inline float hsum(v8f a) {
    float t[8];
    memcpy(t, &a, sizeof t);
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Four independent partial sums: one chain of dependent FMAs would wait on the FMA
 * latency at every step, and a score is one short dot product. */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
    if (n >= 32) {
        v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (; i + 32 <= n; i += 32) {
            s0 += load8(a + i) * load8(b + i);
            s1 += load8(a + i + 8) * load8(b + i + 8);
            s2 += load8(a + i + 16) * load8(b + i + 16);
            s3 += load8(a + i + 24) * load8(b + i + 24);
        }
        total = hsum((s0 + s1) + (s2 + s3));
    }
    if (i + 8 <= n) {
        v8f s = {0};
        for (; i + 8 <= n; i += 8) s += load8(a + i) * load8(b + i);
        total += hsum(s);
    }
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* e^x for 8 lanes, x <= 88: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series
 * to degree 6 (truncation error below 1.3e-7 relative, about one float32 ulp, as expf),
 * times 2^n built in the exponent bits; below -87 (where 2^n would be subnormal) the
 * result is 0, which is what a softmax weight that small contributes anyway. expf
 * itself is not vectorised without -ffast-math, and one call per score was a third of
 * the kernel's time. */
static inline v8f exp8(v8f x) {
    const v8i under = (v8i)(x < -87.0f);                     /* all ones: flushes to 0 */
    x = (v8f)(((v8i)x & ~under) | ((v8i)((v8f){0} - 87.0f) & under));
    const v8f t = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(t, v8i);                 /* truncates toward 0 */
    n += (v8i)(__builtin_convertvector(n, v8f) > t);         /* -1 where that was up: floor */
    const v8f nf = __builtin_convertvector(n, v8f);
    const v8f r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
    v8f p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v8i bits = (n + 127) << 23;
    return (v8f)((v8i)(p * (v8f)bits) & ~under);
}

/* The first float of position pos's row (all KV heads) in one half of the cache. */
static inline const float *slot_row(const float *half, const int64_t *table, int64_t pos,
                                    int64_t block_size, int64_t row) {
    return half + (table[pos / block_size] * block_size + pos % block_size) * row;
}

/* Ask for the row PREFETCH_AHEAD positions on: pages are scattered, and the hardware
 * prefetcher stops at each page's end (measured: 10-18% faster with 2 threads). */
#define PREFETCH_AHEAD 6
static inline void prefetch_row(const float *row_start, int64_t row) {
    const char *p = (const char *)row_start;
    for (int64_t c = 0; c < row * (int64_t)sizeof(float); c += 64) __builtin_prefetch(p + c);
}

/* out[i] += w * v[i] */
static inline void axpy(float *out, float w, const float *v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] += w * v[i];
}

/* bfloat16 (the upper 16 bits of a float32) widened exactly: for KV pages in bf16. */
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline v8f load8_bf16(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u32) << 16);
}

static inline const uint16_t *slot_row_bf16(const uint16_t *half, const int64_t *table,
                                            int64_t pos, int64_t block_size, int64_t row) {
    return half + (table[pos / block_size] * block_size + pos % block_size) * row;
}

static inline void prefetch_row_bf16(const uint16_t *row_start, int64_t row) {
    const char *p = (const char *)row_start;
    for (int64_t c = 0; c < row * (int64_t)sizeof(uint16_t); c += 64) __builtin_prefetch(p + c);
}

/* float32 to bfloat16, rounding to nearest even as torch does (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* One slot's row of `row` elements into a cache half of float32 or bfloat16 (rounded). */
static inline void store_kv_row(void *half, int kv_bf16, int64_t slot, int64_t row,
                                const float *src) {
    if (kv_bf16) {
        uint16_t *dst = (uint16_t *)half + slot * row;
        for (int64_t i = 0; i < row; ++i) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)half + slot * row, src, sizeof(float) * row);
    }
}

/* dot() of a float32 a and a bfloat16 b (a KV row): two 8-wide partial sums. */
static inline float kv_dot_bf16(const float *a, const uint16_t *b, int64_t n) {
    int64_t i = 0;
    v8f s0 = {0}, s1 = {0};
    for (; i + 16 <= n; i += 16) {
        s0 += load8(a + i) * load8_bf16(b + i);
        s1 += load8(a + i + 8) * load8_bf16(b + i + 8);
    }
    for (; i + 8 <= n; i += 8) s0 += load8(a + i) * load8_bf16(b + i);
    float total = hsum(s0 + s1);
    for (; i < n; ++i) total += a[i] * bf16_to_f32(b[i]);
    return total;
}

/* out[i] += w * v[i], v in bfloat16 */
static inline void kv_axpy_bf16(float *out, float w, const uint16_t *v, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] += w * bf16_to_f32(v[i]);
}

#if defined(__AVX__)
#include <immintrin.h>
/* Four 8-wide partial sums to their four totals (3 hadds and an add, where four
 * hsum() calls take ~28 operations). */
static inline void sum4(v8f a0, v8f a1, v8f a2, v8f a3, float *out) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1),
                                    _mm256_hadd_ps((__m256)a2, (__m256)a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
#else
static inline void sum4(v8f a0, v8f a1, v8f a2, v8f a3, float *out) {
    out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
}
#endif

/* paged_decode.c: attention of query heads [h_begin, h_end) of one sequence. */
void quire_attend_heads(const float *q, const float *k_cache, const float *v_cache,
                        const int64_t *table, int64_t start, int64_t n, int64_t h_begin,
                        int64_t h_end, int64_t groups, int64_t row, int64_t d,
                        int64_t block_size, float scale, float *scores, float *out);

/* paged_decode.c: the same over bfloat16 pages. */
void quire_attend_heads_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *table, int64_t start, int64_t n, int64_t h_begin,
                             int64_t h_end, int64_t groups, int64_t row, int64_t d,
                             int64_t block_size, float scale, float *scores, float *out);

/* quire_attend_heads or its bfloat16 twin, by the cache's element type. */
static inline void attend_heads_kv(int kv_bf16, const float *q, const void *k_cache,
                                   const void *v_cache, const int64_t *table, int64_t start,
                                   int64_t n, int64_t h_begin, int64_t h_end, int64_t groups,
                                   int64_t row, int64_t d, int64_t block_size, float scale,
                                   float *scores, float *out) {
    if (kv_bf16)
        quire_attend_heads_bf16(q, k_cache, v_cache, table, start, n, h_begin, h_end, groups,
                                row, d, block_size, scale, scores, out);
    else
        quire_attend_heads(q, k_cache, v_cache, table, start, n, h_begin, h_end, groups, row,
                           d, block_size, scale, scores, out);
}

/* compact_gemv.c: row j of a compact weight (see there) times x, without bias. */
float quire_compact_dot(int32_t format, const float *x, int64_t k, const void *codes,
                        const float *scales, const float *offsets, int64_t j);

/* panel_gemm.c: the calling thread's scratch, at least `floats` long (NULL when it cannot
 * grow). Shared by the entry points, none of which calls another, so a call may use it
 * whole; call it before a parallel region and pass the pointer in (each thread of the
 * team has its own). */
float *quire_thread_scratch(size_t floats);

/* panel_gemm.c: y = x W^T (+ bias) for x [m, k] and W in 16-column panels, panels split
 * over the team; call inside a parallel region (it ends in the omp for's barrier). */
void quire_panel_gemm_team(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                           const float *bias, float *y);

/* Products of this many rows or more pack them first (quire_panel_gemm_packed_team):
 * measured at 512 and 2048 rows on SmolLM2's shapes, 5-10% faster than reading them in
 * place. Below that (decode batches, whose weights stream from DRAM) packing measured
 * no gain. */
#define QUIRE_PACK_MIN_ROWS 128

/* panel_gemm.c: the same product with x first packed into `packed` (room for m rounded
 * up to 6, times k floats), for QUIRE_PACK_MIN_ROWS rows or more. Team function. */
void quire_panel_gemm_packed_team(const float *x, int64_t m, int64_t k, const float *panels,
                                  int64_t n, const float *bias, float *y, float *packed);

/* rms_norm.c: out = weight * (h / sqrt(mean(h^2) + eps)) for one row of n. */
void quire_rms_norm_row(const float *h, const float *weight, float eps, int64_t n, float *out);

#endif
