/*
 * Products on quantised weights with int8 activations (cpu platform), llama.cpp's way for
 * one-row (decode) products: y = q8(x) W^T (+ bias) for a weight in one of GGUF's block
 * formats read in place, integer dot products of the weight's codes with the quantised
 * activations, the block scales and minima applied in float.
 *
 * Activations: each row of x is cut into blocks of 32 values along k; block b is
 * quantised to int8 with d_b = max|x| / 127 (float32), q = round-half-to-even(x / d_b)
 * clamped to +-127 (d_b = 0 and q = 0 for an all-zero block), once per call and row, with
 * each block's float d_b * sum(q) kept for the formats with minima. One activation block
 * size (32) serves every format, so a K-quant's 256-weight block sees 8 activation scales.
 *
 *   y[i][j] = sum_b d_b * sum_{c in b} q_c * w_jc (+ bias[j])
 *
 * with w_jc as quire/quantization/dequant.py gives them, computed as
 * sum_b d_b * (wscale_b * isum_b + wmin_b * sum_b(q)) where isum_b is the exact integer
 * sum of q times the weight's integer codes (times the integer sub-scales of Q6_K's
 * 16-weight halves). The results differ from F.linear(dequant_q8(x), W.dequantize())
 * only by float rounding of the scales' products and of the sums.
 *
 * Codes: unsigned where the format allows (Q4_0 / Q5_0 take their offsets 8 / 16 as the
 * minima -8 d / -16 d, exact in float; Q4_1, Q5_1, Q4_K, Q5_K have minima), signed for
 * Q8_0; Q6_K's are taken unsigned (0..63) and 32 * sum(sc * sum16(q)) is taken off in
 * integers (the activations keep their sums per 16 for it, as llama.cpp's Q8_K does).
 *
 * Levels: AVX512-VNNI (avx512_bf16): _mm256_dpbusd_epi32 on unsigned codes, or on |w|
 * with q carrying w's sign for Q8_0; AVX2 and avx512: maddubs / madd, the same way
 * (Q6_K by maddubs at every level, its sub-scales applied by madd); generic: plain C.
 * The SIMD levels take 8 activation blocks at a time (a K-quant's super-block, or 8
 * consecutive 32-weight blocks): 8 integer block sums reduced into one vector, one
 * convert and one FMA with the 8 blocks' float scales times the 8 activation scales; a
 * 32-weight format's last k/32 mod 8 blocks go one at a time.
 *
 * Batches (quire_quant_gemm_q8_batch, AVX2 and AVX-512 levels): the tiles above unpack
 * each weight block once per 4 rows; the batch kernel unpacks the weight once a call into
 * column panels and multiplies every row from them (the section at the end), 16 rows at
 * a time on AMX-INT8 tiles at the amx level.
 *
 * Return codes (quire_quant_gemm_q8, quire_quant_gemm_q8_batch): 0; 4 a format these
 * products do not take, or no batch kernel at this level (the caller falls back); 2 k
 * not a whole number of the format's blocks; 3 out of memory.
 */
#pragma GCC diagnostic ignored "-Wpsabi"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "cpu_kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum {
    Q8F_Q4_0 = 2, Q8F_Q4_1 = 3, Q8F_Q5_0 = 6, Q8F_Q5_1 = 7, Q8F_Q8_0 = 8, Q8F_Q4_K = 12,
    Q8F_Q5_K = 13, Q8F_Q6_K = 14
};

#define Q8_UNSUPPORTED 4
#define Q8_MAX_ROWS 4

#define INL static inline __attribute__((always_inline))

/* IEEE half to float (exact). */
static inline float q8_h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)(h & 0x7fff) << 13, r;
    float f;
    memcpy(&f, &u, 4);
    f *= 0x1p112f;
    memcpy(&r, &f, 4);
    if ((h & 0x7c00) == 0x7c00)
        r = 0x7f800000u | ((uint32_t)(h & 0x3ff) << 13);
    r |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &r, 4);
    return f;
}

/* Weights a block holds and its bytes; 0 for a format these products do not take. */
static int q8_block(int32_t fmt) {
    switch (fmt) {
    case Q8F_Q4_0: case Q8F_Q4_1: case Q8F_Q5_0: case Q8F_Q5_1: case Q8F_Q8_0: return 32;
    case Q8F_Q4_K: case Q8F_Q5_K: case Q8F_Q6_K: return 256;
    default: return 0;
    }
}

/* ---- the activations ---- */

/* One row of k values (k a multiple of 32): q [k], d [k/32], ds [k/32] = d_b * sum(q_b),
 * bs [k/16] the sums of q per 16 (for Q6_K's codes taken unsigned). */
static void q8_quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *ds,
                            int16_t *bs) {
    int64_t b = 0;
#if defined(__AVX2__)
    /* the same operations, 32 at a time (division and round-to-nearest-even are IEEE's) */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4];
        for (int t = 0; t < 4; t++) v[t] = _mm256_loadu_ps(xb + 8 * t);
        __m256 mx = _mm256_and_ps(v[0], absmask);
        for (int t = 1; t < 4; t++) mx = _mm256_max_ps(mx, _mm256_and_ps(v[t], absmask));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float s = _mm_cvtss_f32(h) / 127.0f;
        d[b] = s;
        if (!(s > 0.0f)) {
            memset(q + 32 * b, 0, 32);
            ds[b] = 0.0f, bs[2 * b] = bs[2 * b + 1] = 0;
            continue;
        }
        const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.0f);
        const __m256 lo = _mm256_set1_ps(-127.0f);
        __m256i iv[4];
        for (int t = 0; t < 4; t++) {
            const __m256 r = _mm256_round_ps(_mm256_div_ps(v[t], sv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            iv[t] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
        }
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                                  _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256((void *)(q + 32 * b), _mm256_permutevar8x32_epi32(packed, order));
        const __m256i s01 = _mm256_add_epi32(iv[0], iv[1]), s23 = _mm256_add_epi32(iv[2], iv[3]);
        /* the sums of the first and the last 16: lanes 0 + 4 and 1 + 5 of hs2 */
        const __m256i hs = _mm256_hadd_epi32(s01, s23), hs2 = _mm256_hadd_epi32(hs, hs);
        const int32_t h0 = _mm256_extract_epi32(hs2, 0) + _mm256_extract_epi32(hs2, 4);
        const int32_t h1 = _mm256_extract_epi32(hs2, 1) + _mm256_extract_epi32(hs2, 5);
        bs[2 * b] = (int16_t)h0, bs[2 * b + 1] = (int16_t)h1;
        ds[b] = s * (float)(h0 + h1);
    }
#endif
    for (; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int c = 0; c < 32; c++) {
            const float a = fabsf(xb[c]);
            amax = a > amax ? a : amax;
        }
        const float s = amax / 127.0f;
        int32_t sum = 0;
        if (s > 0.0f) {
            for (int c = 0; c < 32; c++) {
                float t = nearbyintf(xb[c] / s);
                t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
                q[32 * b + c] = (int8_t)t;
                sum += q[32 * b + c];
            }
        } else {
            memset(q + 32 * b, 0, 32);
        }
        d[b] = s;
        ds[b] = s * (float)sum;
        for (int h = 0; h < 2; h++) {
            int32_t part = 0;
            for (int c = 0; c < 16; c++) part += q[32 * b + 16 * h + c];
            bs[2 * b + h] = (int16_t)part;
        }
    }
}

/* The quantised rows of x: m rows of k bytes, then m rows of k/32 scales and sums. */
struct q8_act {
    const int8_t *q;
    const float *d, *ds;
    const int16_t *bs;
    int64_t k, nb;
};

/* Bytes needed for m rows of k. */
static size_t q8_act_bytes(int64_t m, int64_t k) {
    return (size_t)m * (size_t)k + 4 * sizeof(float) * (size_t)m * (size_t)(k / 32) + 64;
}

/* Own per-thread buffer (not quire_thread_scratch: the fused decode layer holds that
 * one's pointer across the team calls). */
static __thread void *q8_buf;
static __thread size_t q8_buf_bytes;

static void *q8_scratch(size_t bytes) { return quire_grown(&q8_buf, &q8_buf_bytes, bytes); }

static struct q8_act q8_quantize(const float *x, int64_t m, int64_t k, void *buf) {
    struct q8_act a;
    const int64_t nb = k / 32;
    int8_t *q = buf;
    float *d = (float *)(((uintptr_t)(q + m * k) + 15) & ~(uintptr_t)15);
    float *ds = d + m * nb;
    int16_t *bs = (int16_t *)(ds + m * nb);
    for (int64_t i = 0; i < m; i++)
        q8_quantize_row(x + i * k, k, q + i * k, d + i * nb, ds + i * nb, bs + 2 * i * nb);
    a.q = q, a.d = d, a.ds = ds, a.bs = bs, a.k = k, a.nb = nb;
    return a;
}

/* ---- weight blocks: activation block b (32 weights) of a row ---- */

/* Q4_K / Q5_K: sub-block j's 6-bit scale and minimum. */
INL void q8_k_scale_min(const uint8_t *p, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = p[j] & 63, *mn = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 15) | ((p[j - 4] >> 2) & 0x30);
        *mn = (p[j + 4] >> 4) | ((p[j] >> 2) & 0x30);
    }
}

#if defined(__AVX2__)

typedef __m256i wv;

/* sum over groups of 4 of u (unsigned bytes, < 128 here) times s (signed): int32 x 8. */
INL __m256i dot_u(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The same for signed w: |w| times s carrying w's sign. */
INL __m256i dot_s(__m256i w, __m256i s) {
    return dot_u(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
}

/* Q6_K: signed w, the first 16 products times sc0, the last 16 times sc1. */
INL __m256i dot_s2(__m256i w, __m256i s, int sc0, int sc1) {
    const __m256i u = _mm256_abs_epi8(w), sx = _mm256_sign_epi8(s, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i sum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, sx);
    return _mm256_mullo_epi32(sum, _mm256_set_m128i(_mm_set1_epi32(sc1), _mm_set1_epi32(sc0)));
#else
    const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((int16_t)sc1),
                                            _mm_set1_epi16((int16_t)sc0));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, sx), scales);
#endif
}

INL __m256i ld32(const uint8_t *p) { return _mm256_loadu_si256((const void *)p); }

/* 16 bytes as 32 nibbles: all low ones, then all high ones. */
INL __m256i nibbles16(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const void *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

/* Bit i of the little-endian word at p as 0x10 in byte i. */
INL __m256i bits32_x10(const uint8_t *p) {
    uint32_t x32;
    memcpy(&x32, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)),
                            _mm256_set1_epi8(0x10));
}

/* (bytes >> sh) & mask, per byte. */
INL __m256i shr_mask(__m256i v, int sh, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, sh), _mm256_set1_epi8((char)mask));
}

#define W_SUB(a, c) _mm256_sub_epi8(a, _mm256_set1_epi8(c))
#define W_OR(a, b) _mm256_or_si256(a, b)
#define W_SHL4(a) _mm256_slli_epi16(a, 4)

#else /* generic: plain C on 32-byte arrays */

typedef struct {
    int8_t v[32];
} wv;

INL int32_t dot_u(wv u, const int8_t *s) {
    int32_t acc = 0;
    for (int c = 0; c < 32; c++) acc += (int32_t)(uint8_t)u.v[c] * s[c];
    return acc;
}
INL int32_t dot_s(wv w, const int8_t *s) {
    int32_t acc = 0;
    for (int c = 0; c < 32; c++) acc += (int32_t)w.v[c] * s[c];
    return acc;
}
INL int32_t dot_s2(wv w, const int8_t *s, int sc0, int sc1) {
    int32_t a0 = 0, a1 = 0;
    for (int c = 0; c < 16; c++) a0 += (int32_t)w.v[c] * s[c];
    for (int c = 16; c < 32; c++) a1 += (int32_t)w.v[c] * s[c];
    return a0 * sc0 + a1 * sc1;
}
INL wv ld32(const uint8_t *p) {
    wv r;
    memcpy(r.v, p, 32);
    return r;
}
INL wv nibbles16(const uint8_t *p) {
    wv r;
    for (int c = 0; c < 16; c++) r.v[c] = (int8_t)(p[c] & 15), r.v[16 + c] = (int8_t)(p[c] >> 4);
    return r;
}
INL wv bits32_x10(const uint8_t *p) {
    uint32_t x32;
    memcpy(&x32, p, 4);
    wv r;
    for (int c = 0; c < 32; c++) r.v[c] = (int8_t)(((x32 >> c) & 1) << 4);
    return r;
}
INL wv shr_mask(wv a, int sh, int mask) {
    for (int c = 0; c < 32; c++) a.v[c] = (int8_t)(((uint8_t)a.v[c] >> sh) & mask);
    return a;
}
INL wv w_sub(wv a, int c) {
    for (int i = 0; i < 32; i++) a.v[i] = (int8_t)(a.v[i] - c);
    return a;
}
INL wv w_or(wv a, wv b) {
    for (int i = 0; i < 32; i++) a.v[i] |= b.v[i];
    return a;
}
INL wv w_shl4(wv a) {
    for (int i = 0; i < 32; i++) a.v[i] = (int8_t)((uint8_t)a.v[i] << 4);
    return a;
}
#define W_SUB(a, c) w_sub(a, c)
#define W_OR(a, b) w_or(a, b)
#define W_SHL4(a) w_shl4(a)

#endif

/* Kinds of product: signed codes, unsigned codes, signed codes with two int sub-scales. */
enum { K_S = 0, K_U = 1, K_S2 = 2 };

/* Activation block b of a weight row: its codes, their float scale, the float coefficient
 * of d_b * sum(q_b) (the minimum; 0 where none) and Q6_K's two integer sub-scales. */
typedef struct {
    wv w;
    float scale, min;
    int sc0, sc1;
} wblk;

INL int fmt_kind(int32_t fmt) {
    switch (fmt) {
    case Q8F_Q4_0: case Q8F_Q5_0: case Q8F_Q4_1: case Q8F_Q5_1: case Q8F_Q4_K:
    case Q8F_Q5_K: return K_U;
    case Q8F_Q6_K: return K_S2;
    default: return K_S;
    }
}

INL int fmt_has_min(int32_t fmt) {
    return fmt != Q8F_Q8_0 && fmt != Q8F_Q6_K;
}

/* The codes of a 32-weight block at p (unsigned, but signed for Q8_0: Q4_0's and Q5_0's
 * offsets 8 and 16 are taken as minima, -8 d and -16 d, exact in float). */
INL wv codes32(int32_t fmt, const uint8_t *p) {
    switch (fmt) {
    case Q8F_Q4_0: return nibbles16(p + 2);
    case Q8F_Q4_1: return nibbles16(p + 4);
    case Q8F_Q5_0: return W_OR(nibbles16(p + 6), bits32_x10(p + 2));
    case Q8F_Q5_1: return W_OR(nibbles16(p + 8), bits32_x10(p + 4));
    default: return ld32(p + 2);
    }
}

INL void decode(int32_t fmt, const uint8_t *row, int64_t b, wblk *o) {
    o->min = 0.0f;
    o->sc0 = o->sc1 = 0;
    switch (fmt) {
    case Q8F_Q4_0: {
        const uint8_t *p = row + 18 * b;
        o->scale = q8_h2f(p), o->min = -8.0f * o->scale;
        o->w = nibbles16(p + 2);
        break;
    }
    case Q8F_Q4_1: {
        const uint8_t *p = row + 20 * b;
        o->scale = q8_h2f(p), o->min = q8_h2f(p + 2);
        o->w = nibbles16(p + 4);
        break;
    }
    case Q8F_Q5_0: {
        const uint8_t *p = row + 22 * b;
        o->scale = q8_h2f(p), o->min = -16.0f * o->scale;
        o->w = W_OR(nibbles16(p + 6), bits32_x10(p + 2));
        break;
    }
    case Q8F_Q5_1: {
        const uint8_t *p = row + 24 * b;
        o->scale = q8_h2f(p), o->min = q8_h2f(p + 2);
        o->w = W_OR(nibbles16(p + 8), bits32_x10(p + 4));
        break;
    }
    case Q8F_Q8_0: {
        const uint8_t *p = row + 34 * b;
        o->scale = q8_h2f(p);
        o->w = ld32(p + 2);
        break;
    }
    case Q8F_Q4_K: {
        const uint8_t *p = row + 144 * (b / 8);
        const int j = (int)(b % 8);
        int sc, mn;
        q8_k_scale_min(p + 4, j, &sc, &mn);
        o->scale = q8_h2f(p) * (float)sc;
        o->min = -(q8_h2f(p + 2) * (float)mn);
        o->w = shr_mask(ld32(p + 16 + 32 * (j / 2)), 4 * (j % 2), 15);
        break;
    }
    case Q8F_Q5_K: {
        const uint8_t *p = row + 176 * (b / 8);
        const int j = (int)(b % 8);
        int sc, mn;
        q8_k_scale_min(p + 4, j, &sc, &mn);
        o->scale = q8_h2f(p) * (float)sc;
        o->min = -(q8_h2f(p + 2) * (float)mn);
        const wv low = shr_mask(ld32(p + 48 + 32 * (j / 2)), 4 * (j % 2), 15);
        o->w = W_OR(low, W_SHL4(shr_mask(ld32(p + 16), j, 1)));
        break;
    }
    case Q8F_Q6_K: {
        const uint8_t *p = row + 210 * (b / 8);
        const int s = (int)(b % 8), g = s / 4, c = s % 4;
        o->scale = q8_h2f(p + 208);
        o->sc0 = (int8_t)p[192 + 2 * s], o->sc1 = (int8_t)p[193 + 2 * s];
        const wv low = shr_mask(ld32(p + 64 * g + 32 * (c & 1)), 4 * (c >> 1), 15);
        const wv high = shr_mask(ld32(p + 128 + 32 * g), 2 * c, 3);
        o->w = W_SUB(W_OR(low, W_SHL4(high)), 32);
        break;
    }
    default: o->scale = 0.0f; break;
    }
}

#if defined(__AVX2__)
/* Eight activation blocks at once (a K-quant's super-block, or eight consecutive blocks
 * of a 32-weight format): the codes, the prepared dot operands (|w| for signed codes),
 * the eight blocks' float scales and minima as vectors, Q6_K's integer sub-scales. */
typedef struct {
    __m256i w[8], u[8], sc[8], sc16;
    __m256 scale, min;
} wgrp;

/* Eight IEEE halves to float (exact, as q8_h2f). */
INL __m256 h2f8(const uint16_t *h) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)h));
    const __m256 f = _mm256_mul_ps(
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fff)), 13)),
        _mm256_set1_ps(0x1p112f));
    const __m256i e = _mm256_set1_epi32(0x7c00);
    const __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(u, e), e);
    const __m256i inf = _mm256_or_si256(
        _mm256_set1_epi32(0x7f800000),
        _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x3ff)), 13));
    const __m256i r = _mm256_blendv_epi8(_mm256_castps_si256(f), inf, special);
    return _mm256_castsi256_ps(_mm256_or_si256(
        r, _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x8000)), 16)));
}

/* Group g (blocks 8g .. 8g + 7) of a row. */
INL void decode8(int32_t fmt, const uint8_t *row, int64_t g, wgrp *o) {
    const int kind = fmt_kind(fmt);
    if (fmt == Q8F_Q4_K || fmt == Q8F_Q5_K) {
        const uint8_t *p = row + (fmt == Q8F_Q4_K ? 144 : 176) * g;
        /* the 8 six-bit scales into bytes 0..7 and minima into 8..15 (llama.cpp's way) */
        uint32_t u[4];
        memcpy(u, p + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t u1 = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = u1;
        u[0] &= 0x3f3f3f3f;
        const __m128i bytes = _mm_loadu_si128((const void *)u);
        const __m256 scs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        const __m256 mns = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
        o->scale = _mm256_mul_ps(_mm256_set1_ps(q8_h2f(p)), scs);
        o->min = _mm256_sub_ps(_mm256_setzero_ps(),
                               _mm256_mul_ps(_mm256_set1_ps(q8_h2f(p + 2)), mns));
        if (fmt == Q8F_Q4_K) {
            for (int h = 0; h < 4; h++) {
                const __m256i q = ld32(p + 16 + 32 * h);
                o->w[2 * h] = shr_mask(q, 0, 15), o->w[2 * h + 1] = shr_mask(q, 4, 15);
            }
        } else {
            const __m256i qh = ld32(p + 16);
            for (int h = 0; h < 4; h++) {
                const __m256i q = ld32(p + 48 + 32 * h);
                o->w[2 * h] = W_OR(shr_mask(q, 0, 15), W_SHL4(shr_mask(qh, 2 * h, 1)));
                o->w[2 * h + 1] = W_OR(shr_mask(q, 4, 15), W_SHL4(shr_mask(qh, 2 * h + 1, 1)));
            }
        }
    } else if (fmt == Q8F_Q6_K) {
        const uint8_t *p = row + 210 * g;
        o->scale = _mm256_set1_ps(q8_h2f(p + 208));
        o->min = _mm256_setzero_ps();
        o->sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)(p + 192)));
        for (int gg = 0; gg < 2; gg++) {
            const __m256i l0 = ld32(p + 64 * gg), l1 = ld32(p + 64 * gg + 32);
            const __m256i hb = ld32(p + 128 + 32 * gg);
            for (int c = 0; c < 4; c++) {
                const int s = 4 * gg + c;
                const __m256i low = shr_mask((c & 1) ? l1 : l0, 4 * (c >> 1), 15);
                o->w[s] = W_OR(low, W_SHL4(shr_mask(hb, 2 * c, 3)));
                o->sc[s] = _mm256_set_m128i(_mm_set1_epi16((int8_t)p[193 + 2 * s]),
                                            _mm_set1_epi16((int8_t)p[192 + 2 * s]));
            }
        }
    } else {
        const int BB = fmt == Q8F_Q4_0 ? 18 : fmt == Q8F_Q4_1 ? 20 : fmt == Q8F_Q5_0 ? 22
                       : fmt == Q8F_Q5_1 ? 24 : 34;
        uint16_t hd[8], hm[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *p = row + BB * (8 * g + i);
            memcpy(hd + i, p, 2);
            memcpy(hm + i, p + 2, 2);
            o->w[i] = codes32(fmt, p);
        }
        o->scale = h2f8(hd);
        if (fmt == Q8F_Q4_1 || fmt == Q8F_Q5_1)
            o->min = h2f8(hm);
        else if (fmt == Q8F_Q8_0)
            o->min = _mm256_setzero_ps();
        else
            o->min = _mm256_mul_ps(o->scale, _mm256_set1_ps(fmt == Q8F_Q4_0 ? -8.0f : -16.0f));
    }
    if (kind == K_S)
        for (int i = 0; i < 8; i++) o->u[i] = _mm256_abs_epi8(o->w[i]);
}

/* Lane i: the sum of v[i]'s eight lanes. */
INL __m256i reduce8(const __m256i *v) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* The eight blocks' integer sums for one row of activations s (256 bytes; bs its sums
 * per 16). Q6_K's codes are taken unsigned (0..63), by maddubs at every level (the sums
 * of 16 times the integer sub-scales by madd), and 32 * sum(sc * bs) taken off. */
INL __m256i group_dots(int kind, const wgrp *o, const int8_t *s, const int16_t *bs) {
    __m256i v[8];
    for (int i = 0; i < 8; i++) {
        const __m256i x = _mm256_loadu_si256((const void *)(s + 32 * i));
        if (kind == K_S2) {
            v[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(o->w[i], x), o->sc[i]);
        } else if (kind == K_U) {
            v[i] = dot_u(o->w[i], x);
        } else {
            const __m256i sx = _mm256_sign_epi8(x, o->w[i]);
            v[i] = dot_u(o->u[i], sx);
        }
    }
    const __m256i sums = reduce8(v);
    if (kind != K_S2)
        return sums;
    const __m256i corr = _mm256_madd_epi16(o->sc16, _mm256_loadu_si256((const void *)bs));
    return _mm256_sub_epi32(sums, _mm256_slli_epi32(corr, 5));
}
#endif

/* ---- R (1..Q8_MAX_ROWS) rows of activations times weight rows [j0, j1) ---- */

INL void q8_rows(int32_t fmt, int R, const struct q8_act *a, int64_t r0, const uint8_t *w,
                 int64_t ws, int64_t j0, int64_t j1, const float *bias, float *y,
                 int64_t ldy) {
    const int kind = fmt_kind(fmt), has_min = fmt_has_min(fmt);
    const int64_t nb = a->nb, k = a->k;
    const int8_t *qx[Q8_MAX_ROWS];
    const float *dx[Q8_MAX_ROWS], *dsx[Q8_MAX_ROWS];
    const int16_t *bsx[Q8_MAX_ROWS];
    for (int r = 0; r < R; r++) {
        qx[r] = a->q + (r0 + r) * k, dx[r] = a->d + (r0 + r) * nb, dsx[r] = a->ds + (r0 + r) * nb;
        bsx[r] = a->bs + 2 * (r0 + r) * nb;
    }
    (void)bsx;
    /* bytes of 8 activation blocks' weights (decode8's group), and of one's */
    const int64_t group_bytes = q8_block(fmt) == 32 ? 8 * quire_gguf_block_bytes(fmt)
                                                    : quire_gguf_block_bytes(fmt);
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = w + j * ws;
        float mins[Q8_MAX_ROWS] = {0};
#if defined(__AVX2__)
        __m256 acc[Q8_MAX_ROWS];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
#else
        float acc[Q8_MAX_ROWS] = {0};
#endif
        int64_t b = 0;
#if defined(__AVX2__)
        __m256 gacc[Q8_MAX_ROWS], gmin[Q8_MAX_ROWS];
        for (int r = 0; r < R; r++) gacc[r] = gmin[r] = _mm256_setzero_ps();
        for (; b + 8 <= nb; b += 8) {
            wgrp o;
            quire_prefetch_span(row + b / 8 * group_bytes, group_bytes);
            decode8(fmt, row, b / 8, &o);
            for (int r = 0; r < R; r++) {
                const __m256i isum = group_dots(kind, &o, qx[r] + 32 * b, bsx[r] + 2 * b);
                gacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                          _mm256_mul_ps(o.scale, _mm256_loadu_ps(dx[r] + b)),
                                          gacc[r]);
                if (has_min)
                    gmin[r] = _mm256_fmadd_ps(o.min, _mm256_loadu_ps(dsx[r] + b), gmin[r]);
            }
        }
        for (int r = 0; r < R; r++) acc[r] = _mm256_add_ps(gacc[r], gmin[r]);
#endif
        for (; b < nb; b++) {
            wblk o;
            if (b % 8 == 0)
                quire_prefetch_span(row + b / 8 * group_bytes, group_bytes);
            decode(fmt, row, b, &o);
            for (int r = 0; r < R; r++) {
#if defined(__AVX2__)
                const __m256i s = _mm256_loadu_si256((const void *)(qx[r] + 32 * b));
                const __m256i isum = kind == K_U ? dot_u(o.w, s)
                                     : kind == K_S ? dot_s(o.w, s)
                                                   : dot_s2(o.w, s, o.sc0, o.sc1);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                         _mm256_set1_ps(dx[r][b] * o.scale), acc[r]);
#else
                const int8_t *s = qx[r] + 32 * b;
                const int32_t isum = kind == K_U ? dot_u(o.w, s)
                                     : kind == K_S ? dot_s(o.w, s)
                                                   : dot_s2(o.w, s, o.sc0, o.sc1);
                acc[r] += (float)isum * (dx[r][b] * o.scale);
#endif
                if (has_min)
                    mins[r] += o.min * dsx[r][b];
            }
        }
        for (int r = 0; r < R; r++) {
#if defined(__AVX2__)
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            float v = _mm_cvtss_f32(h) + mins[r];
#else
            float v = acc[r] + mins[r];
#endif
            y[(r0 + r) * ldy + j] = bias ? v + bias[j] : v;
        }
    }
}

#define Q8_FMT(F)                                                                          \
    case F:                                                                                \
        switch (R) {                                                                       \
        case 1: q8_rows(F, 1, a, r0, w, ws, j0, j1, bias, y, ldy); break;                  \
        case 2: q8_rows(F, 2, a, r0, w, ws, j0, j1, bias, y, ldy); break;                  \
        case 3: q8_rows(F, 3, a, r0, w, ws, j0, j1, bias, y, ldy); break;                  \
        default: q8_rows(F, 4, a, r0, w, ws, j0, j1, bias, y, ldy); break;                 \
        }                                                                                  \
        break;

static void q8_dispatch(int32_t fmt, int R, const struct q8_act *a, int64_t r0,
                        const uint8_t *w, int64_t ws, int64_t j0, int64_t j1,
                        const float *bias, float *y, int64_t ldy) {
    switch (fmt) {
        Q8_FMT(Q8F_Q4_0) Q8_FMT(Q8F_Q4_1) Q8_FMT(Q8F_Q5_0) Q8_FMT(Q8F_Q5_1)
        Q8_FMT(Q8F_Q8_0) Q8_FMT(Q8F_Q4_K) Q8_FMT(Q8F_Q5_K) Q8_FMT(Q8F_Q6_K)
    default: break;
    }
}

/* Every row of x times weight rows [j0, j1). */
static void q8_share(int32_t fmt, const struct q8_act *a, int64_t m, const uint8_t *w,
                     int64_t ws, int64_t j0, int64_t j1, const float *bias, float *y,
                     int64_t ldy) {
    if (j0 >= j1)
        return;
    for (int64_t r0 = 0; r0 < m; r0 += Q8_MAX_ROWS) {
        const int R = m - r0 < Q8_MAX_ROWS ? (int)(m - r0) : Q8_MAX_ROWS;
        q8_dispatch(fmt, R, a, r0, w, ws, j0, j1, bias, y, ldy);
    }
}

/* ---- entries ---- */

int quire_quant_q8_fits(int32_t fmt, int64_t k) {
    const int B = q8_block(fmt);
    return B != 0 && k > 0 && k % B == 0;
}

int quire_quant_gemm_q8(int32_t fmt, const float *x, int64_t m, int64_t k, const uint8_t *w,
                        int64_t w_stride, int64_t n, const float *bias, float *y,
                        int64_t ldy) {
    const int B = q8_block(fmt);
    if (B == 0)
        return Q8_UNSUPPORTED;
    if (k < 0 || k % B)
        return 2;
    if (m <= 0 || n <= 0)
        return 0;
    if (k == 0) {
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) y[i * ldy + j] = bias ? bias[j] : 0.0f;
        return 0;
    }
    void *buf = q8_scratch(q8_act_bytes(m, k));
    if (buf == NULL)
        return 3;
    const struct q8_act a = q8_quantize(x, m, k, buf);
#pragma omp parallel
    {
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        q8_share(fmt, &a, m, w, w_stride, n * t / team, n * (t + 1) / team, bias, y, ldy);
    }
    return 0;
}

/* Called by every thread of a running team: each quantises x into its own buffer (no
 * barrier needed) and computes its contiguous share of the n outputs. fmt and k are the
 * caller's to check (quire_quant_q8_fits); a thread without memory for its buffer leaves
 * its share of y untouched. */
void quire_quant_rows_q8_team(int32_t fmt, const float *x, int64_t m, int64_t k,
                              const uint8_t *w, int64_t w_stride, int64_t n, const float *bias,
                              float *y, int64_t ldy) {
    if (!quire_quant_q8_fits(fmt, k) || m <= 0 || n <= 0)
        return;
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t j0 = n * t / team, j1 = n * (t + 1) / team;
    if (j0 >= j1)
        return;
    void *buf = q8_scratch(q8_act_bytes(m, k));
    if (buf == NULL)
        return;
    const struct q8_act a = q8_quantize(x, m, k, buf);
    q8_share(fmt, &a, m, w, w_stride, j0, j1, bias, y, ldy);
}

/* A test harness for the team variant: a team of `threads` (0: the default) running it. */
int quire_quant_rows_q8_team_test(int32_t fmt, const float *x, int64_t m, int64_t k,
                                  const uint8_t *w, int64_t w_stride, int64_t n,
                                  const float *bias, float *y, int64_t ldy, int32_t threads) {
    if (!quire_quant_q8_fits(fmt, k))
        return q8_block(fmt) == 0 ? Q8_UNSUPPORTED : 2;
    const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel num_threads(nt)
    quire_quant_rows_q8_team(fmt, x, m, k, w, w_stride, n, bias, y, ldy);
    return 0;
}

/* ---- batches: every row against column panels of the weight ----
 *
 * For products of many rows (prompts, batched decode) the weight's codes are unpacked
 * once per call into panels of QB_NC output columns (16 at the AVX-512 levels, 8 at
 * AVX2), laid out so that one vector holds 4 consecutive codes of each column (lane =
 * column): a row's 4 activation bytes, broadcast, times that vector (vpdpbusd, or
 * maddubs + madd) add to every column's block sum at once, 8 such per 32-block. Each
 * row of a tile of up to QB_RM rows then multiplies the panel from cache: a weight
 * block is unpacked once per call (once per chunk of rows where the panels are too few
 * to share among the threads), not once per 4 rows. Each block's integer sums are
 * scaled per row in float by the block's weight scales (a vector over the columns)
 * times the row's activation scale, and the minima times the row's block sums added.
 *
 * Codes: unsigned as above, but Q8_0's are offset by 128 at VNNI (a minimum of -128 d),
 * kept signed on AMX tiles (TDPBSSD) and taken by the sign trick below VNNI (maddubs
 * would saturate on offset codes); Q6_K's
 * offset by 32 with one scale and minimum (-32 d sc) per 16 weights, the activations'
 * sums per 16 in float. The results differ from the tiles' above only by float rounding.
 */
#if defined(__AVX2__)

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QB_NC 16
#define QB_RM 8
typedef __m512i qbi;
typedef __m512 qbf;
#define QB_ZI() _mm512_setzero_si512()
#define QB_ZF() _mm512_setzero_ps()
#define QB_I32(v) _mm512_set1_epi32(v)
#define QB_F32(v) _mm512_set1_ps(v)
#define QB_LDF(p) _mm512_load_ps(p)
#define QB_CVT(v) _mm512_cvtepi32_ps(v)
#define QB_ADDI(a, b) _mm512_add_epi32(a, b)
#define QB_MUL(a, b) _mm512_mul_ps(a, b)
#define QB_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#if defined(__AVX512VNNI__)
#define QB_VNNI 1
INL qbi qb_dot_u(qbi acc, qbi u, qbi s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
#define QB_VNNI 0
INL qbi qb_dot_u(qbi acc, qbi u, qbi s) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
}
#endif
/* signed w: |w| times s carrying w's sign */
INL qbi qb_dot_s(qbi acc, qbi w, qbi s) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    return qb_dot_u(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(s, neg, QB_ZI(), s));
}
/* A whole line of 16 floats, 64-byte aligned: not read first (the output is larger
 * than the caches, and a missed store's line fetch would stall every row). */
INL int qb_stream_fits(const float *y, int nc) {
    return nc == 16 && ((uintptr_t)y & 63) == 0;
}
INL void qb_store(float *y, qbf v, const float *bias, int nc, int stream) {
    const __mmask16 keep = (__mmask16)((1u << nc) - 1u);
    if (bias)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias));
    if (stream && qb_stream_fits(y, nc))
        _mm512_stream_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, keep, v);
}
#else
#define QB_NC 8
#define QB_RM 4
#define QB_VNNI 0
typedef __m256i qbi;
typedef __m256 qbf;
#define QB_ZI() _mm256_setzero_si256()
#define QB_ZF() _mm256_setzero_ps()
#define QB_I32(v) _mm256_set1_epi32(v)
#define QB_F32(v) _mm256_set1_ps(v)
#define QB_LDF(p) _mm256_load_ps(p)
#define QB_CVT(v) _mm256_cvtepi32_ps(v)
#define QB_ADDI(a, b) _mm256_add_epi32(a, b)
#define QB_MUL(a, b) _mm256_mul_ps(a, b)
#define QB_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
INL qbi qb_dot_u(qbi acc, qbi u, qbi s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
}
INL qbi qb_dot_s(qbi acc, qbi w, qbi s) {
    return qb_dot_u(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
}
INL void qb_store(float *y, qbf v, const float *bias, int nc, int stream) {
    (void)stream;
    float t[8];
    _mm256_storeu_ps(t, v);
    for (int c = 0; c < nc; c++) y[c] = bias ? t[c] + bias[c] : t[c];
}
#endif

/* The panel's kinds: unsigned codes, one scale and minimum a 32-block (QB_U1); signed
 * codes, one scale, no minimum (QB_S1: Q8_0 below VNNI); unsigned codes, a scale and
 * minimum per 16 (QB_U2: Q6_K). */
enum { QB_U1 = 0, QB_S1 = 1, QB_U2 = 2 };

INL int qb_kind(int32_t fmt) {
    if (fmt == Q8F_Q6_K)
        return QB_U2;
    return fmt == Q8F_Q8_0 && !QB_VNNI ? QB_S1 : QB_U1;
}

/* The quantised rows for batches: as struct q8_act, with d_b * (sum of q per 16). */
struct qb_act {
    const int8_t *q;
    const float *d, *ds, *ds16;
    int64_t k, nb;
};

static size_t qb_act_bytes(int64_t m, int64_t k) {
    return (size_t)m * (size_t)k + 24 * (size_t)m * (size_t)(k / 32) + 64;
}

/* A panel: nb blocks of 8 code vectors, then per block `sub` vectors of scales and of
 * minima (sub = 2 for QB_U2). */
typedef struct {
    qbi *q;
    float *s, *m;
} qb_panel;

static size_t qb_panel_bytes(int64_t nb) {
    return (size_t)nb * (8 * sizeof(qbi) + 4 * QB_NC * sizeof(float)) + 64;
}

/* Outputs of more bytes than this are written by streaming stores where they fit. */
#define QB_STREAM_BYTES (4 << 20)

static __thread void *qb_buf;
static __thread size_t qb_buf_bytes;

static qb_panel qb_panel_scratch(int64_t nb) {
    qb_panel p = {NULL, NULL, NULL};
    const size_t bytes = qb_panel_bytes(nb);
    if (bytes > qb_buf_bytes) {
        void *grown = realloc(qb_buf, bytes);
        if (grown == NULL)
            return p;
        qb_buf = grown;
        qb_buf_bytes = bytes;
    }
    p.q = (qbi *)(((uintptr_t)qb_buf + 63) & ~(uintptr_t)63);
    p.s = (float *)(p.q + 8 * nb);
    p.m = p.s + 2 * QB_NC * nb;
    return p;
}

/* r[i] (8 dwords each) transposed: r[t] lane i = dword t of the input r[i]. */
INL void qb_transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* Column c's block b: its 32 codes as the panel takes them, its scales and minima. */
INL __m256i qb_codes(int32_t fmt, int kind, const uint8_t *row, int64_t b, float *s,
                     float *mn) {
    wblk o;
    o.w = _mm256_setzero_si256();
    decode(fmt, row, b, &o);
    if (kind == QB_U2) {
        s[0] = o.scale * (float)o.sc0, s[QB_NC] = o.scale * (float)o.sc1;
        mn[0] = -32.0f * s[0], mn[QB_NC] = -32.0f * s[QB_NC];
        return _mm256_add_epi8(o.w, _mm256_set1_epi8(32));
    }
    if (fmt == Q8F_Q8_0) {
        s[0] = o.scale, mn[0] = kind == QB_U1 ? -128.0f * o.scale : 0.0f;
        return kind == QB_U1 ? _mm256_xor_si256(o.w, _mm256_set1_epi8((char)0x80)) : o.w;
    }
    s[0] = o.scale, mn[0] = o.min;
    return o.w;
}

/* Transposes stage[i][0 .. QB_NC) (column i's 32 codes) into the panel's block at dst. */
INL void qb_put(__m256i *stage, uint8_t *dst) {
    for (int g = 0; g < QB_NC / 8; g++) {
        qb_transpose8(stage + 8 * g);
        for (int t = 0; t < 8; t++)
            _mm256_store_si256((void *)(dst + t * sizeof(qbi) + 32 * g), stage[8 * g + t]);
    }
}

/* The same for the 32-weight formats, their half scales converted 8 columns at once. */
static void qb_pack32(int32_t fmt, int kind, const uint8_t *w, int64_t ws, int64_t j0,
                      int nc, int64_t nb, qb_panel p) {
    const int bb = fmt == Q8F_Q4_0 ? 18 : fmt == Q8F_Q4_1 ? 20 : fmt == Q8F_Q5_0 ? 22
                   : fmt == Q8F_Q5_1 ? 24 : 34;
    const int offset8 = fmt == Q8F_Q8_0 && kind == QB_U1;
    const float bias = fmt == Q8F_Q4_0 ? -8.0f : fmt == Q8F_Q5_0 ? -16.0f
                       : offset8 ? -128.0f : 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        __m256i stage[QB_NC];
        uint16_t hd[QB_NC], hm[QB_NC];
        for (int c = 0; c < QB_NC; c++) {
            if (c >= nc) {
                stage[c] = _mm256_setzero_si256(), hd[c] = hm[c] = 0;
                continue;
            }
            const uint8_t *q = w + (j0 + c) * ws + bb * b;
            memcpy(hd + c, q, 2);
            memcpy(hm + c, q + 2, 2);
            stage[c] = codes32(fmt, q);
            if (offset8)
                stage[c] = _mm256_xor_si256(stage[c], _mm256_set1_epi8((char)0x80));
        }
        qb_put(stage, (uint8_t *)(p.q + 8 * b));
        for (int g = 0; g < QB_NC / 8; g++) {
            const __m256 d = h2f8(hd + 8 * g);
            const __m256 mn = fmt == Q8F_Q4_1 || fmt == Q8F_Q5_1
                                  ? h2f8(hm + 8 * g) : _mm256_mul_ps(d, _mm256_set1_ps(bias));
            _mm256_store_ps(p.s + QB_NC * b + 8 * g, d);
            _mm256_store_ps(p.m + QB_NC * b + 8 * g, mn);
        }
    }
}

/* Columns [j0, j0 + nc) of the weight into the panel (lanes nc.. zero): a block of
 * every column decoded, then transposed into 4-byte lanes. */
static void qb_pack(int32_t fmt, int kind, const uint8_t *w, int64_t ws, int64_t j0, int nc,
                    int64_t nb, qb_panel p) {
    if (q8_block(fmt) == 32) {
        qb_pack32(fmt, kind, w, ws, j0, nc, nb, p);
        return;
    }
    const int sub = kind == QB_U2 ? 2 : 1;
    for (int64_t b = 0; b < nb; b++) {
        __m256i stage[QB_NC];
        for (int c = 0; c < QB_NC; c++) {
            float *s = p.s + sub * QB_NC * b + c, *mn = p.m + sub * QB_NC * b + c;
            if (c < nc) {
                stage[c] = qb_codes(fmt, kind, w + (j0 + c) * ws, b, s, mn);
            } else {
                stage[c] = _mm256_setzero_si256();
                for (int h = 0; h < sub; h++) s[h * QB_NC] = 0.0f, mn[h * QB_NC] = 0.0f;
            }
        }
        qb_put(stage, (uint8_t *)(p.q + 8 * b));
    }
}

INL int32_t qb_word(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Rows [r0, r0 + R) times the panel into y's columns [j0, j0 + nc). */
INL void qb_tile(int kind, int R, const struct qb_act *a, int64_t r0, qb_panel p,
                 int nc, int64_t j0, const float *bias, float *y, int64_t ldy, int stream) {
    const int64_t nb = a->nb, k = a->k;
    qbf acc[8]; /* R <= QB_RM <= 8; the dispatch's switch names up to 7 at every level */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = QB_ZF();
    for (int64_t b = 0; b < nb; b++) {
        const qbi *wq = p.q + 8 * b;
        if (kind != QB_U2) {
            const qbf sc = QB_LDF(p.s + QB_NC * b), mn = QB_LDF(p.m + QB_NC * b);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int8_t *x = a->q + (r0 + r) * k + 32 * b;
                qbi i0 = QB_ZI(), i1 = QB_ZI(); /* two chains of 4, not one of 8 */
                for (int t = 0; t < 8; t += 2) {
                    const qbi a0 = QB_I32(qb_word(x + 4 * t)), a1 = QB_I32(qb_word(x + 4 * t + 4));
                    i0 = kind == QB_S1 ? qb_dot_s(i0, wq[t], a0) : qb_dot_u(i0, wq[t], a0);
                    i1 = kind == QB_S1 ? qb_dot_s(i1, wq[t + 1], a1) : qb_dot_u(i1, wq[t + 1], a1);
                }
                const qbi is = QB_ADDI(i0, i1);
                const int64_t ib = (r0 + r) * nb + b;
                acc[r] = QB_FMA(QB_CVT(is), QB_MUL(sc, QB_F32(a->d[ib])), acc[r]);
                if (kind == QB_U1)
                    acc[r] = QB_FMA(mn, QB_F32(a->ds[ib]), acc[r]);
            }
        } else {
            const qbf s0 = QB_LDF(p.s + 2 * QB_NC * b), s1 = QB_LDF(p.s + 2 * QB_NC * b + QB_NC);
            const qbf m0 = QB_LDF(p.m + 2 * QB_NC * b), m1 = QB_LDF(p.m + 2 * QB_NC * b + QB_NC);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int8_t *x = a->q + (r0 + r) * k + 32 * b;
                qbi i0 = QB_ZI(), i1 = QB_ZI();
                for (int t = 0; t < 4; t++) {
                    i0 = qb_dot_u(i0, wq[t], QB_I32(qb_word(x + 4 * t)));
                    i1 = qb_dot_u(i1, wq[t + 4], QB_I32(qb_word(x + 16 + 4 * t)));
                }
                const int64_t ib = (r0 + r) * nb + b;
                const qbf d = QB_F32(a->d[ib]);
                acc[r] = QB_FMA(QB_CVT(i0), QB_MUL(s0, d), acc[r]);
                acc[r] = QB_FMA(QB_CVT(i1), QB_MUL(s1, d), acc[r]);
                acc[r] = QB_FMA(m0, QB_F32(a->ds16[2 * ib]), acc[r]);
                acc[r] = QB_FMA(m1, QB_F32(a->ds16[2 * ib + 1]), acc[r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        qb_store(y + (r0 + r) * ldy + j0, acc[r], bias ? bias + j0 : NULL, nc, stream);
}

#define QB_KIND(K)                                                                         \
    static void qb_rows_##K(int64_t r0, int64_t r1, const struct qb_act *a, qb_panel p,    \
                            int nc, int64_t j0, const float *bias, float *y, int64_t ldy,  \
                            int stream) {                                                  \
        int64_t r = r0;                                                                    \
        for (; r + QB_RM <= r1; r += QB_RM)                                                \
            qb_tile(K, QB_RM, a, r, p, nc, j0, bias, y, ldy, stream);                      \
        switch (r1 - r) {                                                                  \
        case 1: qb_tile(K, 1, a, r, p, nc, j0, bias, y, ldy, stream); break;               \
        case 2: qb_tile(K, 2, a, r, p, nc, j0, bias, y, ldy, stream); break;               \
        case 3: qb_tile(K, 3, a, r, p, nc, j0, bias, y, ldy, stream); break;               \
        case 4: qb_tile(K, 4, a, r, p, nc, j0, bias, y, ldy, stream); break;               \
        case 5: qb_tile(K, 5, a, r, p, nc, j0, bias, y, ldy, stream); break;               \
        case 6: qb_tile(K, 6, a, r, p, nc, j0, bias, y, ldy, stream); break;               \
        case 7: qb_tile(K, 7, a, r, p, nc, j0, bias, y, ldy, stream); break;               \
        default: break;                                                                    \
        }                                                                                  \
    }
QB_KIND(QB_U1)
QB_KIND(QB_S1)
QB_KIND(QB_U2)

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && QB_NC == 16 && QB_VNNI
#define QB_AMX 1
/* Products of fewer rows keep vpdpbusd: there the tiles' set-up and the sums' round
 * trip through memory cost about what they save (docs/quantization.md, Platforms). */
#define QB_AMX_MIN_ROWS 32
/* AMX-INT8 for the 32-value blocks' panels (the amx level, once Linux grants the tile
 * state): a panel's block is AMX's B-tile layout as it stands (8 rows of 64 bytes: row t
 * holds codes 4t .. 4t + 3 of each of the 16 columns), so one TDPBSUD (unsigned codes,
 * QB_U1) or TDPBSSD (Q8_0's signed codes, packed without the offset of 128 that
 * vpdpbusd needs: QB_S1, no minimum) multiplies 16 rows' 32 signed activation bytes (an
 * A tile read in place, rows k bytes apart) by it into the 16 x 16 exact integer block
 * sums that vpdpbusd makes 8 instructions a row for. The sums are scaled as qb_tile
 * scales them, so on QB_U1 panels the results are qb_tile's bit for bit. Two sets of
 * tiles alternate so that one block's product runs while the other's sums are scaled:
 * C tiles 0 and 1, A tiles 4 and 5, B tiles 6 and 7. */
static const struct quire_amx_config __attribute__((aligned(64))) QB_AMX_CONFIG = {
    .palette = 1,
    .colsb = {64, 64, 0, 0, 32, 32, 64, 64},
    .rows = {16, 16, 0, 0, 16, 16, 8, 8},
};

/* Block b's sums (in buf, 16 rows of 16 int32) scaled into acc as qb_tile does. */
INL void qb_amx_scale(int kind, const struct qb_act *a, int64_t r0, qb_panel p, int64_t b,
                      const int32_t *buf, qbf acc[16]) {
    const qbf sc = QB_LDF(p.s + QB_NC * b), mn = QB_LDF(p.m + QB_NC * b);
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        const int64_t ib = (r0 + r) * a->nb + b;
        const qbi is = _mm512_load_si512(buf + 16 * r);
        acc[r] = QB_FMA(QB_CVT(is), QB_MUL(sc, QB_F32(a->d[ib])), acc[r]);
        if (kind == QB_U1)
            acc[r] = QB_FMA(mn, QB_F32(a->ds[ib]), acc[r]);
    }
}

/* Tile c += tile a times tile b, b's bytes unsigned (QB_U1) or signed (QB_S1). */
#define QB_AMX_DOT(kind, c, a, b)                                                          \
    do {                                                                                   \
        if ((kind) == QB_U1)                                                               \
            _tile_dpbsud(c, a, b);                                                         \
        else                                                                               \
            _tile_dpbssd(c, a, b);                                                         \
    } while (0)

/* Rows [r0, r0 + 16) times a QB_U1 or QB_S1 panel on AMX tiles; the tile configuration
 * loaded. */
INL void qb_amx_tile(int kind, const struct qb_act *a, int64_t r0, qb_panel p, int nc,
                     int64_t j0, const float *bias, float *y, int64_t ldy, int stream) {
    const int64_t nb = a->nb, k = a->k;
    const int8_t *x = a->q + r0 * k;
    int32_t buf[256] __attribute__((aligned(64)));
    qbf acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = QB_ZF();
    _tile_loadd(4, x, k);
    _tile_loadd(6, p.q, 64);
    _tile_zero(0);
    QB_AMX_DOT(kind, 0, 4, 6);
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 1 < nb) {
            _tile_loadd(5, x + 32 * (b + 1), k);
            _tile_loadd(7, p.q + 8 * (b + 1), 64);
            _tile_zero(1);
            QB_AMX_DOT(kind, 1, 5, 7);
        }
        _tile_stored(0, buf, 64);
        qb_amx_scale(kind, a, r0, p, b, buf, acc);
        if (b + 1 < nb) {
            if (b + 2 < nb) {
                _tile_loadd(4, x + 32 * (b + 2), k);
                _tile_loadd(6, p.q + 8 * (b + 2), 64);
                _tile_zero(0);
                QB_AMX_DOT(kind, 0, 4, 6);
            }
            _tile_stored(1, buf, 64);
            qb_amx_scale(kind, a, r0, p, b + 1, buf, acc);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        qb_store(y + (r0 + r) * ldy + j0, acc[r], bias ? bias + j0 : NULL, nc, stream);
}

/* The whole 16s of rows [r0, r1) times a QB_U1 or QB_S1 panel on AMX tiles; returns
 * the first row left (for qb_tile). */
static int64_t qb_amx_rows(int kind, int64_t r0, int64_t r1, const struct qb_act *a,
                           qb_panel p, int nc, int64_t j0, const float *bias, float *y,
                           int64_t ldy, int stream) {
    int64_t r = r0;
    for (; r + 16 <= r1; r += 16) {
        if (kind == QB_U1)
            qb_amx_tile(QB_U1, a, r, p, nc, j0, bias, y, ldy, stream);
        else
            qb_amx_tile(QB_S1, a, r, p, nc, j0, bias, y, ldy, stream);
    }
    return r;
}
#else
#define QB_AMX 0
#define QB_AMX_MIN_ROWS 0
#endif

#endif /* __AVX2__ */

/* Whether this build has the batch kernel (the AVX2 and AVX-512 levels). */
int quire_quant_q8_batch_available(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

int quire_quant_gemm_q8_batch(int32_t fmt, const float *x, int64_t m, int64_t k,
                              const uint8_t *w, int64_t w_stride, int64_t n, const float *bias,
                              float *y, int64_t ldy) {
#if defined(__AVX2__)
    const int B = q8_block(fmt);
    if (B == 0)
        return Q8_UNSUPPORTED;
    if (k <= 0 || k % B)
        return 2;
    if (m <= 0 || n <= 0)
        return 0;
    const int64_t nb = k / 32;
    void *buf = q8_scratch(qb_act_bytes(m, k));
    if (buf == NULL)
        return 3;
    int8_t *q = buf;
    float *d = (float *)(((uintptr_t)(q + m * k) + 63) & ~(uintptr_t)63);
    float *ds = d + m * nb, *ds16 = ds + m * nb;
    int16_t *bs = (int16_t *)(ds16 + 2 * m * nb);
    const struct qb_act a = {q, d, ds, ds16, k, nb};
    const int amx = QB_AMX && quire_amx_ready();
    /* Q8_0's codes stay signed on AMX tiles (TDPBSSD), where vpdpbusd wants them offset */
    const int kind = amx && m >= QB_AMX_MIN_ROWS && fmt == Q8F_Q8_0 ? QB_S1 : qb_kind(fmt);
    const int64_t tiles = (n + QB_NC - 1) / QB_NC;
    /* an output larger than the caches is streamed (QB_STREAM_BYTES) */
    const int stream = (double)m * (double)n * sizeof(float) > QB_STREAM_BYTES;
    int failed = 0;
#pragma omp parallel
    {
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            q8_quantize_row(x + i * k, k, q + i * k, d + i * nb, ds + i * nb, bs + 2 * i * nb);
            for (int64_t h = 0; h < 2 * nb; h++)
                ds16[2 * i * nb + h] = d[i * nb + h / 2] * (float)bs[2 * i * nb + h];
        }
        /* rows go to AMX tiles 16 at a time, else to qb_tile QB_RM at a time */
        const int tiles_on = amx && kind != QB_U2 && m >= QB_AMX_MIN_ROWS;
        const int64_t rm = tiles_on ? 16 : QB_RM;
        /* work items: column panels, each cut into row chunks when panels are few */
        int64_t chunks = 1;
        if (tiles < 4 * team) {
            chunks = (4 * team + tiles - 1) / tiles;
            const int64_t most = (m + rm - 1) / rm;
            chunks = chunks < most ? chunks : most;
        }
        const int64_t items = tiles * chunks, i0 = items * t / team, i1 = items * (t + 1) / team;
        qb_panel p = {NULL, NULL, NULL};
        if (i0 < i1) {
            p = qb_panel_scratch(nb);
            if (p.q == NULL) {
#pragma omp atomic write
                failed = 1;
            }
        }
#if QB_AMX
        if (tiles_on)
            quire_amx_begin_with(&QB_AMX_CONFIG);
#endif
        int64_t packed = -1;
        for (int64_t it = i0; it < i1 && p.q != NULL; it++) {
            const int64_t tile = it / chunks, chunk = it % chunks, j0 = tile * QB_NC;
            const int nc = (int)(n - j0 < QB_NC ? n - j0 : QB_NC);
            if (tile != packed) {
                qb_pack(fmt, kind, w, w_stride, j0, nc, nb, p);
                packed = tile;
            }
            /* row chunks of whole tiles of rm rows */
            const int64_t rt = (m + rm - 1) / rm;
            int64_t r0 = rm * (rt * chunk / chunks);
            int64_t r1 = rm * (rt * (chunk + 1) / chunks);
            r1 = r1 < m ? r1 : m;
#if QB_AMX
            if (tiles_on)
                r0 = qb_amx_rows(kind, r0, r1, &a, p, nc, j0, bias, y, ldy, stream);
#endif
            if (r0 >= r1)
                continue;
            if (kind == QB_U1)
                qb_rows_QB_U1(r0, r1, &a, p, nc, j0, bias, y, ldy, stream);
            else if (kind == QB_S1)
                qb_rows_QB_S1(r0, r1, &a, p, nc, j0, bias, y, ldy, stream);
            else
                qb_rows_QB_U2(r0, r1, &a, p, nc, j0, bias, y, ldy, stream);
        }
#if QB_AMX
        if (tiles_on)
            quire_amx_end();
#endif
        if (stream)
            _mm_sfence(); /* the streamed stores visible before the team's barrier */
    }
    return failed ? 3 : 0;
#else
    (void)fmt, (void)x, (void)m, (void)k, (void)w, (void)w_stride, (void)n, (void)bias;
    (void)y, (void)ldy;
    return Q8_UNSUPPORTED;
#endif
}
