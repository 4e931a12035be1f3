/*
 * One-row products y = W x on weights kept in a compact, exact encoding (cpu platform).
 *
 * A decode step of one sequence reads every weight once and does two flops with it, so
 * its time is the time to stream the weights from memory. Many float32 weights are
 * exactly representable in fewer bits: those dequantised from a GGUF file (Q4_0, Q4_1,
 * Q8_0) and those upcast from a bf16 or f16 checkpoint. quire/platforms/cpu/compact.py
 * finds such an encoding for a layer and checks that decoding it gives back every
 * float32 weight bit for bit; these kernels stream the encoding and rebuild each weight
 * in registers with the same float32 operations, so the product is the float32 one,
 * with only the order of the sums different (as between any two GEMM libraries).
 *
 * Encodings, for W of N rows by K columns (K a multiple of 32), 32 weights per block:
 * - a4 (affine 4-bit): w = d * q + m, q in 0..15; per block a float32 scale d and
 *   offset m. Codes: row-major [N, K / 2] bytes, a block's 16 bytes being 8 little-endian
 *   16-bit lanes, lane j holding the codes of weights j, j + 8, j + 16 and j + 24 in
 *   its nibbles 0..3: one widening move then shifts give four 8-wide vectors (a byte
 *   per weight pair needed four widening moves and two byte shifts, measured 15%
 *   slower). d * q is exact (d has at most 20 significant bits, checked at encoding),
 *   so one rounding happens, at the + m, whether or not the compiler fuses it.
 * - s8 (scaled 8-bit): w = d * q, q in -128..127, d a float32 per block; exact (d has at
 *   most 16 significant bits).
 * - bf16: the upper half of the float32 bits.
 *
 * Work is split over output rows with OpenMP (the libgomp torch loaded, so torch's
 * thread count). Each dot product keeps 4 x 8 partial sums, added in a fixed order.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef int8_t v8i8 __attribute__((vector_size(8)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));

static inline v8f i8tof(v8i8 c) {
    return __builtin_convertvector(__builtin_convertvector(c, v8i32), v8f);
}

static inline v8f loadf(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8u8 loadu8(const uint8_t *p) {
    v8u8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum4(v8f a0, v8f a1, v8f a2, v8f a3) {
    v8f s = (a0 + a1) + (a2 + a3);
    float t[8];
    memcpy(t, &s, sizeof t);
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* x86 with AVX-512 (the avx512 ISA level): a 32-weight block is two 16-wide vectors,
 * half the instructions of the AVX2 path below. Blocks go in pairs to four
 * accumulators, so consecutive FMAs do not wait on each other. */

static inline __m512 sum512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    return _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
}

/* A block's 8 code lanes widened to 32 bits, in both halves: shifted by 0 | 4 they give
 * weights 0..15 in order, by 8 | 12 weights 16..31 (see the layout above). */
static inline void a4_block(const float *xb, const uint8_t *q, float d, float m, __m512 *s0,
                            __m512 *s1) {
    const __m512i low4 = _mm512_set1_epi32(15);
    const __m512i shift01 = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i shift23 = _mm512_set_epi32(12, 12, 12, 12, 12, 12, 12, 12, 8, 8, 8, 8, 8, 8,
                                             8, 8);
    const __m512i c =
        _mm512_broadcast_i64x4(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    /* d * q is exact, so the FMA rounds once, at + m, as d * q + m does */
    const __m512 w01 = _mm512_fmadd_ps(
        vd, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(c, shift01), low4)), vm);
    const __m512 w23 = _mm512_fmadd_ps(
        vd, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(c, shift23), low4)), vm);
    *s0 = _mm512_fmadd_ps(_mm512_loadu_ps(xb), w01, *s0);
    *s1 = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), w23, *s1);
}

static float dot_a4(const float *x, const uint8_t *q, const float *d, const float *m,
                    int64_t blocks) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        a4_block(x + 32 * b, q + 16 * b, d[b], m[b], &a0, &a1);
        a4_block(x + 32 * b + 32, q + 16 * b + 16, d[b + 1], m[b + 1], &a2, &a3);
    }
    if (b < blocks)
        a4_block(x + 32 * b, q + 16 * b, d[b], m[b], &a0, &a1);
    return _mm512_reduce_add_ps(sum512(a0, a1, a2, a3));
}

static inline __m512 s8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline void s8_block(const float *xb, const int8_t *p, float d, __m512 *s0,
                            __m512 *s1) {
    const __m512 vd = _mm512_set1_ps(d); /* d * q is exact */
    *s0 = _mm512_fmadd_ps(_mm512_loadu_ps(xb), _mm512_mul_ps(vd, s8x16(p)), *s0);
    *s1 = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), _mm512_mul_ps(vd, s8x16(p + 16)), *s1);
}

static float dot_s8(const float *x, const int8_t *q, const float *d, int64_t blocks) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        s8_block(x + 32 * b, q + 32 * b, d[b], &a0, &a1);
        s8_block(x + 32 * b + 32, q + 32 * b + 32, d[b + 1], &a2, &a3);
    }
    if (b < blocks)
        s8_block(x + 32 * b, q + 32 * b, d[b], &a0, &a1);
    return _mm512_reduce_add_ps(sum512(a0, a1, a2, a3));
}

/* bf16 to float32 by a shift, exact; AVX512_BF16's dot product would round x to bf16. */
static inline __m512 bf16x16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static float dot_bf16(const float *x, const uint16_t *w, int64_t blocks) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        const uint16_t *p = w + 32 * b;
        const float *xb = x + 32 * b;
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xb), bf16x16(p), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), bf16x16(p + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 32), bf16x16(p + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 48), bf16x16(p + 48), a3);
    }
    if (b < blocks) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32 * b), bf16x16(w + 32 * b), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32 * b + 16), bf16x16(w + 32 * b + 16), a1);
    }
    return _mm512_reduce_add_ps(sum512(a0, a1, a2, a3));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* x86 with AVX2: intrinsics, because GCC's generic vectors load widened bytes one at a
 * time (measured 2x slower than these). The portable versions below are the reference
 * for what each computes. */

static inline float hsum256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    v8f s;
    __m256 t = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    memcpy(&s, &t, sizeof s);
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

static float dot_a4(const float *x, const uint8_t *q, const float *d, const float *m,
                    int64_t blocks) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t b = 0; b < blocks; b++) {
        const __m256 vd = _mm256_broadcast_ss(d + b), vm = _mm256_broadcast_ss(m + b);
        const __m256i c = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * b)));
        const float *xb = x + 32 * b;
        /* d * q is exact, so the FMA rounds once, at + m, as d * q + m does */
        const __m256 w0 = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(c, low4)), vm);
        const __m256 w1 = _mm256_fmadd_ps(
            vd, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(c, 4), low4)), vm);
        const __m256 w2 = _mm256_fmadd_ps(
            vd, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(c, 8), low4)), vm);
        const __m256 w3 = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 12)), vm);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xb), w0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), w1, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), w2, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), w3, a3);
    }
    return hsum256(a0, a1, a2, a3);
}

static inline __m256 s8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static float dot_s8(const float *x, const int8_t *q, const float *d, int64_t blocks) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < blocks; b++) {
        const __m256 vd = _mm256_broadcast_ss(d + b);
        const int8_t *p = q + 32 * b;
        const float *xb = x + 32 * b;
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xb), _mm256_mul_ps(vd, s8x8(p)), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), _mm256_mul_ps(vd, s8x8(p + 8)), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), _mm256_mul_ps(vd, s8x8(p + 16)), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), _mm256_mul_ps(vd, s8x8(p + 24)), a3);
    }
    return hsum256(a0, a1, a2, a3);
}

static inline __m256 bf16x8(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static float dot_bf16(const float *x, const uint16_t *w, int64_t blocks) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *p = w + 32 * b;
        const float *xb = x + 32 * b;
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xb), bf16x8(p), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), bf16x8(p + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), bf16x8(p + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), bf16x8(p + 24), a3);
    }
    return hsum256(a0, a1, a2, a3);
}

#else /* portable: GCC/Clang generic vectors */

static float dot_a4(const float *x, const uint8_t *q, const float *d, const float *m,
                    int64_t blocks) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const v8f vd = {d[b], d[b], d[b], d[b], d[b], d[b], d[b], d[b]};
        const v8f vm = {m[b], m[b], m[b], m[b], m[b], m[b], m[b], m[b]};
        v8u16 lanes;
        memcpy(&lanes, q + 16 * b, sizeof lanes);
        const v8i32 c = __builtin_convertvector(lanes, v8i32);
        const float *xb = x + 32 * b;
        a0 += loadf(xb) * (vd * __builtin_convertvector(c & 15, v8f) + vm);
        a1 += loadf(xb + 8) * (vd * __builtin_convertvector((c >> 4) & 15, v8f) + vm);
        a2 += loadf(xb + 16) * (vd * __builtin_convertvector((c >> 8) & 15, v8f) + vm);
        a3 += loadf(xb + 24) * (vd * __builtin_convertvector(c >> 12, v8f) + vm);
    }
    return hsum4(a0, a1, a2, a3);
}

static float dot_s8(const float *x, const int8_t *q, const float *d, int64_t blocks) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const v8f vd = {d[b], d[b], d[b], d[b], d[b], d[b], d[b], d[b]};
        const int8_t *p = q + 32 * b;
        const float *xb = x + 32 * b;
        v8i8 c0, c1, c2, c3;
        memcpy(&c0, p, 8);
        memcpy(&c1, p + 8, 8);
        memcpy(&c2, p + 16, 8);
        memcpy(&c3, p + 24, 8);
        a0 += loadf(xb) * (vd * i8tof(c0));
        a1 += loadf(xb + 8) * (vd * i8tof(c1));
        a2 += loadf(xb + 16) * (vd * i8tof(c2));
        a3 += loadf(xb + 24) * (vd * i8tof(c3));
    }
    return hsum4(a0, a1, a2, a3);
}

static inline v8f bf16x8(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 bits = __builtin_convertvector(h, v8u32) << 16;
    v8f f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float dot_bf16(const float *x, const uint16_t *w, int64_t blocks) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *p = w + 32 * b;
        const float *xb = x + 32 * b;
        a0 += loadf(xb) * bf16x8(p);
        a1 += loadf(xb + 8) * bf16x8(p + 8);
        a2 += loadf(xb + 16) * bf16x8(p + 16);
        a3 += loadf(xb + 24) * bf16x8(p + 24);
    }
    return hsum4(a0, a1, a2, a3);
}

#endif

float quire_compact_dot(int32_t format, const float *x, int64_t k, const void *codes,
                        const float *scales, const float *offsets, int64_t j) {
    const int64_t blocks = k / 32;
    if (format == 0)
        return dot_a4(x, (const uint8_t *)codes + j * (k / 2), scales + j * blocks,
                      offsets + j * blocks, blocks);
    if (format == 1)
        return dot_s8(x, (const int8_t *)codes + j * k, scales + j * blocks, blocks);
    return dot_bf16(x, (const uint16_t *)codes + j * k, blocks);
}

/* y[r, n] = sum_k x[r, k] * W[n, k] (+ bias[n]) for r < rows. x is [rows, K], y is
 * [rows, N], both contiguous; bias may be NULL. Returns 0, or 1 for an unknown format. */
int quire_compact_gemv(int32_t format, const float *x, int64_t rows, int64_t k, int64_t n,
                       const void *codes, const float *scales, const float *offsets,
                       const float *bias, float *y) {
    if (format < 0 || format > 2 || k % 32 != 0)
        return 1;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r = 0; r < rows; r++) {
            const float v = quire_compact_dot(format, x + r * k, k, codes, scales, offsets, j);
            y[r * n + j] = bias ? v + bias[j] : v;
        }
    }
    return 0;
}
