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

/* float32 to bfloat16, rounding to nearest even as torch does (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* A weight streamed once in order (a decode step's products read every weight from
 * memory once): with the bytes at p about to be read, ask for those
 * QUIRE_PREFETCH_BYTES further on. Without asking, short rows (576 columns of Q4_1 are
 * 360 bytes) end before the hardware prefetcher catches up; asking a whole row ahead at
 * each row's start instead floods the fill buffers on long rows. The distance is the
 * best one measured on whole decode steps, whose weights come from memory (docs/bench.md);
 * products timed back to back on one weight read it from cache and favour a shorter one.
 * Addresses past the weight's end are harmless: a prefetch does not fault. */
#define QUIRE_PREFETCH_BYTES 4096

static inline void quire_prefetch_span(const uint8_t *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64)
        __builtin_prefetch(p + QUIRE_PREFETCH_BYTES + at, 0, 3);
}

/* Bytes of one block of a GGUF block type, by its ggml type id (the format ids of
 * quant_gemm.c and quant_q8.c); 0 for any other id. */
static inline int quire_gguf_block_bytes(int32_t ggml_type) {
    switch (ggml_type) {
    case 2: return 18;   /* Q4_0 */
    case 3: return 20;   /* Q4_1 */
    case 6: return 22;   /* Q5_0 */
    case 7: return 24;   /* Q5_1 */
    case 8: return 34;   /* Q8_0 */
    case 10: return 84;  /* Q2_K */
    case 11: return 110; /* Q3_K */
    case 12: return 144; /* Q4_K */
    case 13: return 176; /* Q5_K */
    case 14: return 210; /* Q6_K */
    default: return 0;
    }
}

/* What a layer's KV pages hold (quire/ops/kv_quant.py has the quantised layout): a head
 * row of d elements, or for int8 and fp8 (e4m3fn) d bytes then d / QUIRE_KV_GROUP float16
 * scales, scale g for elements g * QUIRE_KV_GROUP on (value = element * scale); d a
 * multiple of QUIRE_KV_GROUP. */
#define QUIRE_KV_F32 0
#define QUIRE_KV_BF16 1
#define QUIRE_KV_I8 2
#define QUIRE_KV_FP8 3
#define QUIRE_KV_GROUP 16

static inline int kv_quantized(int kv_type) { return kv_type >= QUIRE_KV_I8; }

/* Elements of one head row in the pages (quantised: d bytes and d / 8 of scales), and
 * between consecutive slots. */
static inline int64_t kv_head_elems(int kv_type, int64_t d) {
    return kv_quantized(kv_type) ? d + 2 * d / QUIRE_KV_GROUP : d;
}
static inline int64_t kv_slot_elems(int kv_type, int64_t hkv, int64_t d) {
    return hkv * kv_head_elems(kv_type, d);
}

/* float32 to e4m3fn, rounding to nearest even as torch's .to(torch.float8_e4m3fn) does
 * (c10's fp8e4m3fn_from_fp32_value) for |f| <= 448, all it is given (values are clamped
 * to +-448 first). */
static inline uint8_t f32_to_fp8(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t out;
    if (bits >= (1087u << 20)) {
        out = 0x7f;
    } else if (bits < (121u << 23)) { /* below e4m3's normals: align by a float add */
        const uint32_t denorm = 141u << 23;
        float a, b;
        memcpy(&a, &bits, sizeof a);
        memcpy(&b, &denorm, sizeof b);
        a += b;
        memcpy(&bits, &a, sizeof bits);
        out = (uint8_t)(bits - denorm);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        out = (uint8_t)(bits >> 20);
    }
    return out | (uint8_t)(sign >> 24);
}

/* float16 (a KV scale's) exactly as a float32; infinities and NaNs are never written. */
static inline float f16_to_f32(uint16_t h) {
    float f;
    if (h & 0x7c00u) {
        const uint32_t bits = ((uint32_t)(h & 0x7fffu) << 13) + (112u << 23);
        memcpy(&f, &bits, sizeof f);
    } else {
        f = (float)(h & 0x3ffu) * 0x1p-24f; /* subnormal */
    }
    return (h & 0x8000u) ? -f : f;
}

/* float32 to float16, rounding to nearest even as torch's .half() does (c10's
 * fp16_ieee_from_fp32_value: the rounding done by float adds at the right exponent). */
static inline uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float bias_f;
    memcpy(&bias_f, &bias_bits, sizeof bias_f);
    base = bias_f + base;
    uint32_t bits;
    memcpy(&bits, &base, sizeof bits);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

/* The orthonormal 16-point Hadamard transform of one group in place: butterflies
 * (a + b, a - b) at distances 1, 2, 4 and 8 in that order, then times 1/4, as
 * quire.ops.kv_quant.hadamard16 does them (the same bits). int8 KV groups are stored in
 * this basis (see kv_quant.py); the transform is its own inverse. */
static inline void hadamard16(float *g) {
    for (int h = 1; h < QUIRE_KV_GROUP; h <<= 1)
        for (int i = 0; i < QUIRE_KV_GROUP; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const float a = g[j], b = g[j + h];
                g[j] = a + b;
                g[j + h] = a - b;
            }
    for (int i = 0; i < QUIRE_KV_GROUP; ++i) g[i] *= 0.25f;
}

/* One head's d floats quantised into a quantised head row at dst, each group of
 * QUIRE_KV_GROUP on its own (int8: the group's Hadamard transform): s = absmax / qmax
 * capped at 65504 and rounded to float16 (1 where that is 0), elements / s clamped to
 * +-qmax and rounded to nearest even (int8) or converted (fp8), then the groups' float16
 * scales: torch's quire.ops.kv_quant.quantize, bit for bit. */
static inline void quantize_kv_head(int kv_type, const float *src, int64_t d, uint8_t *dst) {
    const float qmax = kv_type == QUIRE_KV_I8 ? 127.0f : 448.0f;
    float rotated[QUIRE_KV_GROUP];
    for (int64_t g = 0; g < d / QUIRE_KV_GROUP; ++g) {
        const float *x = src + g * QUIRE_KV_GROUP;
        if (kv_type == QUIRE_KV_I8) { /* int8 groups are stored in the Hadamard basis */
            memcpy(rotated, x, sizeof rotated);
            hadamard16(rotated);
            x = rotated;
        }
        uint8_t *q = dst + g * QUIRE_KV_GROUP;
        float top = 0.0f;
        for (int i = 0; i < QUIRE_KV_GROUP; ++i) {
            const float a = fabsf(x[i]);
            top = a > top ? a : top;
        }
        float s = top / qmax;
        uint16_t h = f32_to_f16(s < 65504.0f ? s : 65504.0f);
        if (h == 0)
            h = 0x3c00u; /* 1.0 */
        s = f16_to_f32(h);
        for (int i = 0; i < QUIRE_KV_GROUP; ++i) {
            float v = x[i] / s;
            v = v < -qmax ? -qmax : (v > qmax ? qmax : v);
            q[i] = kv_type == QUIRE_KV_I8 ? (uint8_t)(int8_t)nearbyintf(v) : f32_to_fp8(v);
        }
        memcpy(dst + d + 2 * g, &h, sizeof h);
    }
}

/* One slot's keys (or values), hkv heads of d floats at src, into a cache half of
 * kv_type: copied, rounded to bfloat16, or quantised per head. */
static inline void store_kv_row(void *half, int kv_type, int64_t slot, int64_t hkv, int64_t d,
                                const float *src) {
    const int64_t row = hkv * d;
    if (kv_type == QUIRE_KV_BF16) {
        uint16_t *dst = (uint16_t *)half + slot * row;
        for (int64_t i = 0; i < row; ++i) dst[i] = f32_to_bf16(src[i]);
    } else if (kv_quantized(kv_type)) {
        uint8_t *dst = (uint8_t *)half + slot * kv_slot_elems(kv_type, hkv, d);
        for (int64_t h = 0; h < hkv; ++h)
            quantize_kv_head(kv_type, src + h * d, d, dst + h * kv_head_elems(kv_type, d));
    } else {
        memcpy((float *)half + slot * row, src, sizeof(float) * row);
    }
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

/* The attention kernel's vector (attend_heads.h): one register of the level, 16 lanes on
 * avx512 (a head of 64 is four), 8 on avx2, 4 on generic levels; fused multiply-adds
 * where the level has them (-std=c11 keeps GCC from contracting a * b + c itself). */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define VW 16
typedef float vwf __attribute__((vector_size(64)));
typedef int32_t vwi __attribute__((vector_size(64)));
static inline vwf fmaw(vwf a, vwf b, vwf c) {
    return (vwf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
/* The two 8-lane halves added, then sum4's tree. */
static inline void sum4w(vwf a0, vwf a1, vwf a2, vwf a3, float *out) {
#define QUIRE_HALVES(a) ((v8f)_mm512_castps512_ps256((__m512)(a)) + \
                         (v8f)_mm512_extractf32x8_ps((__m512)(a), 1))
    sum4(QUIRE_HALVES(a0), QUIRE_HALVES(a1), QUIRE_HALVES(a2), QUIRE_HALVES(a3), out);
#undef QUIRE_HALVES
}
static inline float hsumw(vwf a) {
    return hsum((v8f)_mm512_castps512_ps256((__m512)a) +
                (v8f)_mm512_extractf32x8_ps((__m512)a, 1));
}
#elif defined(__AVX__)
#define VW 8
typedef v8f vwf;
typedef v8i vwi;
typedef v8u16 vwu16;
typedef v8u32 vwu32;
#if defined(__FMA__)
static inline vwf fmaw(vwf a, vwf b, vwf c) {
    return (vwf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
#define fmaw(a, b, c) ((a) * (b) + (c))
#endif
static inline void sum4w(vwf a0, vwf a1, vwf a2, vwf a3, float *out) {
    sum4(a0, a1, a2, a3, out);
}
static inline float hsumw(vwf a) { return hsum(a); }
#else
/* One 128-bit register (SSE2, NEON): GCC kept arrays of the wider v8f in memory. */
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#define VW 4
typedef float vwf __attribute__((vector_size(16)));
typedef int32_t vwi __attribute__((vector_size(16)));
typedef uint16_t vwu16 __attribute__((vector_size(8)));
typedef uint32_t vwu32 __attribute__((vector_size(16)));
#define fmaw(a, b, c) ((a) * (b) + (c))
static inline float hsumw(vwf a) { return (a[0] + a[2]) + (a[1] + a[3]); }
static inline void sum4w(vwf a0, vwf a1, vwf a2, vwf a3, float *out) {
    out[0] = hsumw(a0), out[1] = hsumw(a1), out[2] = hsumw(a2), out[3] = hsumw(a3);
}
#endif

static inline vwf loadw(const float *p) {
    vwf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storew(float *p, vwf v) { memcpy(p, &v, sizeof v); }

/* x in every lane (a plain broadcast; {0} + x would add first, for the sign of zero). */
static inline vwf splatw(float x) {
#if VW == 16
    return (vwf)_mm512_set1_ps(x);
#elif VW == 8
    return (vwf)_mm256_set1_ps(x);
#else
    return (vwf){x, x, x, x};
#endif
}

static inline vwf loadw_bf16(const uint16_t *p) {
#if VW == 16 /* one vpmovzxwd: GCC splits the generic conversion into halves */
    return (vwf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16);
#elif VW == 4 && defined(__SSE2__) /* zeros below each element: one punpcklwd, not five */
    return (vwf)_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const void *)p));
#else
    vwu16 h;
    memcpy(&h, p, sizeof h);
    return (vwf)(__builtin_convertvector(h, vwu32) << 16);
#endif
}

/* VW int8 elements of a quantised page widened to float32 (exact). */
static inline vwf loadw_i8(const int8_t *p) {
#if VW == 16
    return (vwf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
#else
    typedef int8_t vwi8 __attribute__((vector_size(VW)));
    vwi8 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, vwi), vwf);
#endif
}

/* VW e4m3fn elements widened to float32 exactly, as torch widens them (its NaN, never
 * written, reads as 480). On avx512:
 * an e4m3 byte's bits moved up 7 are the float16 of its value / 2^8 (subnormals too),
 * which vcvtph2ps widens (sign extended to 16 bits, shifted, bit 14 cleared). Elsewhere:
 * normals by moving the bits into place and rebiasing the exponent, subnormals
 * (magnitude < 8) as magnitude * 2^-9, then the sign. */
static inline vwf loadw_fp8(const uint8_t *p) {
#if VW == 16
    const __m256i h = _mm256_and_si256(
        _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)p)), 7),
        _mm256_set1_epi16((short)0xbf80));
    return (vwf)_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
#else
    typedef uint8_t vwu8 __attribute__((vector_size(VW)));
    vwu8 b;
    memcpy(&b, p, sizeof b);
    const vwi u = __builtin_convertvector(b, vwi);
    const vwi mag = u & 0x7f, small = (vwi)(mag < 8);
    const vwi normal = (mag << 20) + (120 << 23);
    const vwi sub = (vwi)(__builtin_convertvector(mag, vwf) * 0x1p-9f);
    return (vwf)(((normal & ~small) | (sub & small)) | ((u & 0x80) << 24));
#endif
}

/* Butterflies of the 16-point Hadamard transform within one vector (distances below VW),
 * as hadamard16 does them: lane i with bit h clear takes v[i] + v[i + h], with it set
 * v[i - h] - v[i] (v[i] * -1 + v[i - h]: one rounding, the same bits). */
static inline vwf hadamard16_in_vector(vwf v) {
#if VW == 16
    v = v * (vwf){1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1} +
        __builtin_shuffle(v, (vwi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    v = v * (vwf){1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1} +
        __builtin_shuffle(v, (vwi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v = v * (vwf){1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1} +
        __builtin_shuffle(v, (vwi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v = v * (vwf){1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1} +
        __builtin_shuffle(v, (vwi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
#elif VW == 8
    v = v * (vwf){1, -1, 1, -1, 1, -1, 1, -1} +
        __builtin_shuffle(v, (vwi){1, 0, 3, 2, 5, 4, 7, 6});
    v = v * (vwf){1, 1, -1, -1, 1, 1, -1, -1} +
        __builtin_shuffle(v, (vwi){2, 3, 0, 1, 6, 7, 4, 5});
    v = v * (vwf){1, 1, 1, 1, -1, -1, -1, -1} +
        __builtin_shuffle(v, (vwi){4, 5, 6, 7, 0, 1, 2, 3});
#else
    v = v * (vwf){1, -1, 1, -1} + __builtin_shuffle(v, (vwi){1, 0, 3, 2});
    v = v * (vwf){1, 1, -1, -1} + __builtin_shuffle(v, (vwi){2, 3, 0, 1});
#endif
    return v;
}

/* The Hadamard transform of one group held in 16 / VW vectors (each already times 1/4,
 * which commutes exactly with the adds): the in-vector distances, then the ones across
 * vectors, in hadamard16's order. */
static inline void hadamard16_vectors(vwf *v) {
    for (int i = 0; i < QUIRE_KV_GROUP / VW; ++i) v[i] = hadamard16_in_vector(v[i]);
    for (int h = 1; h < QUIRE_KV_GROUP / VW; h <<= 1)
        for (int i = 0; i < QUIRE_KV_GROUP / VW; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const vwf a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
}

/* One quantised head row (kv_type QUIRE_KV_I8 or QUIRE_KV_FP8: d elements then their
 * d / QUIRE_KV_GROUP float16 scales, d a whole number of groups) as d float32 values at
 * out, each group widened and times its scale, int8 groups then taken back from the
 * Hadamard basis where `unrotate` (else left in it: a reader that rotates its queries and
 * outputs instead, as attend_heads.h does). With `unrotate`, what
 * quire.ops.kv_quant.dequantize gives, bit for bit (the transform's 1/4 is folded into
 * the scale, exactly). On avx512 up to 16 scales are widened at once (vcvtph2ps) and
 * kept in a register, each group (one vector) taking its lane: a masked store of them
 * reloaded by broadcasts stalled every load on store forwarding. */
static inline void dequant_kv_row_basis(int kv_type, const uint8_t *row, int64_t d, float *out,
                                        int unrotate) {
    const int64_t ng = d / QUIRE_KV_GROUP;
    const uint8_t *bits = row + d;
    const int i8 = kv_type == QUIRE_KV_I8, rotate = i8 && unrotate;
#define QUIRE_KV_LOADW(p) (i8 ? loadw_i8((const int8_t *)(p)) : loadw_fp8(p))
#if VW == 16 && QUIRE_KV_GROUP == 16
    for (int64_t g0 = 0; g0 < ng; g0 += 16) {
        const int64_t left = ng - g0 < 16 ? ng - g0 : 16;
        const __m512 scales = _mm512_mul_ps(
            _mm512_cvtph_ps(
                _mm256_maskz_loadu_epi16((__mmask16)((1u << left) - 1), bits + 2 * g0)),
            _mm512_set1_ps(rotate ? 0.25f : 1.0f));
        for (int64_t g = 0; g < left; ++g) {
            const vwf s = (vwf)_mm512_permutexvar_ps(_mm512_set1_epi32((int)g), scales);
            const vwf v = QUIRE_KV_LOADW(row + (g0 + g) * 16) * s;
            storew(out + (g0 + g) * 16, rotate ? hadamard16_in_vector(v) : v);
        }
    }
#else
    for (int64_t g = 0; g < ng; ++g) {
        uint16_t h;
        memcpy(&h, bits + 2 * g, sizeof h);
        const vwf s = splatw(f16_to_f32(h) * (rotate ? 0.25f : 1.0f));
        vwf v[QUIRE_KV_GROUP / VW]; /* a group: whole vectors */
        for (int i = 0; i < QUIRE_KV_GROUP / VW; ++i)
            v[i] = QUIRE_KV_LOADW(row + g * QUIRE_KV_GROUP + i * VW) * s;
        if (rotate)
            hadamard16_vectors(v);
        for (int i = 0; i < QUIRE_KV_GROUP / VW; ++i)
            storew(out + g * QUIRE_KV_GROUP + i * VW, v[i]);
    }
#endif
#undef QUIRE_KV_LOADW
}

/* The row's values (int8 groups back from the Hadamard basis): kv_quant.dequantize. */
static inline void dequant_kv_row(int kv_type, const uint8_t *row, int64_t d, float *out) {
    dequant_kv_row_basis(kv_type, row, d, out, 1);
}

/* Every group of d floats at x taken into (or, the same, back from) the Hadamard basis:
 * queries and outputs of attention over int8 pages left in that basis. */
static inline void hadamard16_row(float *x, int64_t d) {
    for (int64_t g = 0; g < d; g += QUIRE_KV_GROUP) {
        vwf v[QUIRE_KV_GROUP / VW];
        for (int i = 0; i < QUIRE_KV_GROUP / VW; ++i) v[i] = loadw(x + g + i * VW) * 0.25f;
        hadamard16_vectors(v);
        for (int i = 0; i < QUIRE_KV_GROUP / VW; ++i) storew(x + g + i * VW, v[i]);
    }
}

/* exp8 at the attention vector's width, its polynomial in fused multiply-adds (the
 * softmax's exponentials were a fifth of the kernel at 32 positions). */
static inline vwf expw(vwf x) {
    const vwi under = (vwi)(x < -87.0f);
    x = (vwf)(((vwi)x & ~under) | ((vwi)(splatw(-87.0f)) & under));
    const vwf t = fmaw(x, splatw(1.44269504088896341f), splatw(0.5f));
    vwi n = __builtin_convertvector(t, vwi);
    n += (vwi)(__builtin_convertvector(n, vwf) > t);
    const vwf nf = __builtin_convertvector(n, vwf);
    const vwf r = fmaw(nf, splatw(-1.428606765330187e-06f),
                       fmaw(nf, splatw(-0.693145751953125f), x));
    vwf p = fmaw(r, splatw(1.0f / 720), splatw(1.0f / 120));
    p = fmaw(p, r, splatw(1.0f / 24));
    p = fmaw(p, r, splatw(1.0f / 6));
    p = fmaw(p, r, splatw(0.5f));
    p = fmaw(p, r, splatw(1.0f));
    p = fmaw(p, r, splatw(1.0f));
    const vwi bits = (n + 127) << 23;
    return (vwf)((vwi)(p * (vwf)bits) & ~under);
}

/* A row of n scores to softmax(scale * s), in place, VW lanes at a time (scalar loops
 * were a fifth of the decode kernel's time at 32 positions); for both attention kernels.
 * With stats, a part of a longer row: exp(scale * s - top) left undivided, and top and
 * the exponentials' total in stats[0] and stats[1] (split attention combines the parts). */
static inline void softmax_row_part(float *s, int64_t n, float scale, float *stats) {
    vwf top_w = splatw(-INFINITY);
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        const vwf x = loadw(s + j) * scale;
        const vwi above = (vwi)(x > top_w);
        top_w = (vwf)(((vwi)x & above) | ((vwi)top_w & ~above));
        storew(s + j, x);
    }
    float top = -INFINITY;
    for (int l = 0; l < VW; ++l) top = top_w[l] > top ? top_w[l] : top;
    for (int64_t i = j; i < n; ++i) {
        s[i] *= scale;
        top = s[i] > top ? s[i] : top;
    }
    vwf acc = {0};
    for (j = 0; j + VW <= n; j += VW) {
        const vwf e = expw(loadw(s + j) - top);
        storew(s + j, e);
        acc += e;
    }
    float total = hsumw(acc);
    for (int64_t i = j; i < n; ++i) {
        s[i] = expf(s[i] - top);
        total += s[i];
    }
    if (stats) {
        stats[0] = top, stats[1] = total;
        return;
    }
    const float inv = 1.0f / total;
    for (j = 0; j + VW <= n; j += VW) storew(s + j, loadw(s + j) * inv);
    for (int64_t i = j; i < n; ++i) s[i] *= inv;
}

static inline void softmax_row(float *s, int64_t n, float scale) {
    softmax_row_part(s, n, scale, NULL);
}

/* paged_decode.c: attention of query heads [h_begin, h_end) of one sequence over pages
 * of float32, bfloat16, int8 or fp8 (rows of `row` elements between slots: see
 * kv_slot_elems), float32 arithmetic. With stats (NULL: none) positions [start, start +
 * n) are a part of the sequence's: each head's output is left undivided by its softmax
 * total, and its top score and total go to stats[2 (h - h_begin)], [.. + 1]. */
#define QUIRE_ATTEND_ARGS(KV_T)                                                            \
    const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *table,        \
        int64_t start, int64_t n, int64_t h_begin, int64_t h_end, int64_t groups,          \
        int64_t row, int64_t d, int64_t block_size, float scale, float *scores, float *out, \
        float *stats
void quire_attend_heads(QUIRE_ATTEND_ARGS(float));
void quire_attend_heads_bf16(QUIRE_ATTEND_ARGS(uint16_t));
void quire_attend_heads_i8(QUIRE_ATTEND_ARGS(int8_t));
void quire_attend_heads_fp8(QUIRE_ATTEND_ARGS(uint8_t));
#undef QUIRE_ATTEND_ARGS

/* The one of those for the pages' kv_type (QUIRE_KV_*); attend_heads_kv for a whole
 * sequence, attend_heads_kv_part for a part with its stats. */
static inline void attend_heads_kv_part(int kv_type, const float *q, const void *k_cache,
                                        const void *v_cache, const int64_t *table,
                                        int64_t start, int64_t n, int64_t h_begin,
                                        int64_t h_end, int64_t groups, int64_t row, int64_t d,
                                        int64_t block_size, float scale, float *scores,
                                        float *out, float *stats) {
#define QUIRE_ATTEND(name, KV_T)                                                           \
    name(q, (const KV_T *)k_cache, (const KV_T *)v_cache, table, start, n, h_begin, h_end, \
         groups, row, d, block_size, scale, scores, out, stats)
    switch (kv_type) {
    case QUIRE_KV_BF16: QUIRE_ATTEND(quire_attend_heads_bf16, uint16_t); break;
    case QUIRE_KV_I8: QUIRE_ATTEND(quire_attend_heads_i8, int8_t); break;
    case QUIRE_KV_FP8: QUIRE_ATTEND(quire_attend_heads_fp8, uint8_t); break;
    default: QUIRE_ATTEND(quire_attend_heads, float); break;
    }
#undef QUIRE_ATTEND
}

static inline void attend_heads_kv(int kv_type, const float *q, const void *k_cache,
                                   const void *v_cache, const int64_t *table, int64_t start,
                                   int64_t n, int64_t h_begin, int64_t h_end, int64_t groups,
                                   int64_t row, int64_t d, int64_t block_size, float scale,
                                   float *scores, float *out) {
    attend_heads_kv_part(kv_type, q, k_cache, v_cache, table, start, n, h_begin, h_end,
                         groups, row, d, block_size, scale, scores, out, NULL);
}

/* paged_decode.c: inside a parallel region, one token's attention for each of `rows`
 * sequences over its pages (row r: query q + r * q_stride and output out + r *
 * out_stride, both [hq, d]; the last min(seq_lens[r], window) positions of the pages
 * block table tables + r * table_stride lists, a stride of 0 sharing one table), their
 * positions cut into parts over the team where the rows are few (see there); scores:
 * the calling thread's own, hq * (the longest span) floats. Ends in a barrier. */
void quire_attend_rows_team(int kv_type, const float *q, int64_t q_stride,
                            const void *k_cache, const void *v_cache, const int64_t *tables,
                            int64_t table_stride, const int64_t *seq_lens, int64_t rows,
                            int64_t window, int64_t hq, int64_t hkv, int64_t d,
                            int64_t block_size, float scale, float *scores, float *out,
                            int64_t out_stride);

/* compact_gemv.c: row j of a compact weight (see there) times x, without bias. */
float quire_compact_dot(int32_t format, const float *x, int64_t k, const void *codes,
                        const float *scales, const float *offsets, int64_t j);

/* A tile configuration as LDTILECFG reads it (palette 1: per tile, its bytes a row and
 * its rows). Keep one static and 64-byte aligned: GCC's _tile_loadconfig tells the
 * compiler it reads 8 bytes of its operand, so one built on the stack just before may
 * not be there yet. */
struct quire_amx_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* amx_tiles.c: whether this process may use AMX tiles (asked of Linux once; 0 at levels
 * built without AMX, or when refused). Only where it is 1: quire_amx_begin loads the
 * calling thread's tile configuration (quire_amx_begin_with: another one), quire_amx_end
 * releases the tiles, and between them quire_amx_pairs adds (or, without accumulate,
 * stores) a [m][lda] bfloat16 times np pair panels (pstride pairs apart) over kt blocks
 * of 32 K values into c's columns [0, 16 np) (rows ldc floats apart); m a multiple of
 * 16. quire_amx_sections: how many threads' tile sections have begun in this process,
 * so that a caller (the tests) can tell a product took the tiles, whose results are
 * those of the vector paths bit for bit. */
int quire_amx_ready(void);
void quire_amx_begin(void);
void quire_amx_begin_with(const struct quire_amx_config *config);
void quire_amx_end(void);
uint64_t quire_amx_sections(void);
void quire_amx_pairs(const uint16_t *a, int64_t lda, int64_t m, const uint32_t *b,
                     int64_t pstride, int64_t np, int64_t kt, float *c, int64_t ldc,
                     int accumulate);

/* panel_gemm.c: the calling thread's scratch, at least `floats` long (NULL when it cannot
 * grow). Shared by the entry points, none of which calls another, so a call may use it
 * whole; call it before a parallel region and pass the pointer in (each thread of the
 * team has its own). */
float *quire_thread_scratch(size_t floats);

/* panel_gemm.c: malloc's memory, `bytes` rounded up, starting on a 64-byte cache line
 * (free() releases it). malloc gives 16-byte alignment, so rows of 64 bytes (an AMX
 * tile's, a 512-bit load's) read from its memory could each straddle two lines. */
void *quire_aligned_alloc(size_t bytes);

/* panel_gemm.c: *buf grown to at least `bytes` (quire_aligned_alloc'd, the old buffer
 * freed; never shrunk), *held its size: a per-thread buffer kept between calls, since a
 * fresh allocation of a few MB is an mmap and its page faults every call. NULL, *buf
 * kept, when memory is short. */
void *quire_grown(void **buf, size_t *held, size_t bytes);

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

/* One part of a quantised weight: rows rows of in_features weights in format fmt (a
 * quant_gemm.c id), row r at w + r * w_stride; scales: a row-scaled format's, or NULL.
 * A layer's parts (q, k and v; gate and up) are its outputs in order. */
struct quire_qpart {
    int32_t fmt;
    int64_t rows;
    const uint8_t *w;
    int64_t w_stride;
    const float *scales;
    int32_t acts; /* QUIRE_ACTS_*: the direct path's activations (decode rows) */
};

/* struct quire_qpart.acts: float32 (quant_gemm.c's direct path), int8 per 32 values
 * (quant_q8.c), or rounded to bfloat16 (quire_quant_rows_bf16_team). */
#define QUIRE_ACTS_F32 0
#define QUIRE_ACTS_Q8 1
#define QUIRE_ACTS_BF16 2

/* quant_gemm.c: the one-row products of quantised weights inside a running team (the
 * fused decode layer's), and whether a format and width fit them. */
void quire_quant_rows_team(int32_t fmt, const float *x, int64_t m, int64_t k,
                           const uint8_t *w, int64_t w_stride, int64_t n,
                           const float *row_scales, const float *bias, float *y,
                           int64_t ldy);
int quire_quant_fits(int32_t fmt, int64_t k);
/* The same with the rows rounded to bfloat16 (float32 sums of the exact weights' products:
 * Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K at the levels with AVX512_BF16), and whether
 * a format and width fit. */
void quire_quant_rows_bf16_team(int32_t fmt, const float *x, int64_t m, int64_t k,
                                const uint8_t *w, int64_t w_stride, int64_t n,
                                const float *bias, float *y, int64_t ldy);
int quire_quant_rows_bf16_fits(int32_t fmt, int64_t k);
/* Whether this level's library has the bfloat16 products (AVX512_BF16): 1, else 0. */
int quire_quant_gemm_bf16_available(void);
/* The most rows quire_quant_gemm_f32 takes on the direct path (quire_quant_rows_team's)
 * for fmt: fewer than that, a call and a team's shares give the same numbers. */
int64_t quire_quant_direct_rows(int32_t fmt);

/* quant_gemm.c: the bfloat16 products on quantised weights (AVX512_BF16; AMX tiles where
 * Linux grants them) inside a running team: every thread calls it with the same
 * arguments, the team rounds float32 rows xf into the shared bfloat16 buffer x (m * k)
 * and shares out the parts' panels; it returns the thread's failure (3: no scratch; 4 on
 * a level without the kernel) and ends in a barrier. quire_quant_bf16_fits: whether a
 * format and width fit it on this level. */
int quire_quant_gemm_bf16_team(int64_t nparts, const struct quire_qpart *parts, uint16_t *x,
                               const float *xf, int64_t m, int64_t k, const float *bias,
                               float *y, int64_t ldy);
int quire_quant_bf16_fits(int32_t fmt, int64_t k);

/* quant_q8.c: products on quantised weights with the activations quantised to int8 per
 * 32 values (llama.cpp's Q8_0 way), integer dot products: the one-call entry (0; 4 for a
 * format it does not take; 2 k not whole blocks; 3 no memory), the same inside a running
 * team (each thread a contiguous share of the n outputs, no barrier), and whether a
 * format and width fit them. */
int quire_quant_gemm_q8(int32_t fmt, const float *x, int64_t m, int64_t k, const uint8_t *w,
                        int64_t w_stride, int64_t n, const float *bias, float *y,
                        int64_t ldy);
void quire_quant_rows_q8_team(int32_t fmt, const float *x, int64_t m, int64_t k,
                              const uint8_t *w, int64_t w_stride, int64_t n, const float *bias,
                              float *y, int64_t ldy);
int quire_quant_q8_fits(int32_t fmt, int64_t k);
/* The same for batches: the weight unpacked once per call into column panels, every row
 * multiplied from them (codes as quire_quant_gemm_q8's; 4 also at the generic level). */
int quire_quant_gemm_q8_batch(int32_t fmt, const float *x, int64_t m, int64_t k,
                              const uint8_t *w, int64_t w_stride, int64_t n, const float *bias,
                              float *y, int64_t ldy);
int quire_quant_q8_batch_available(void);

/* panel_gemm.c: rows [0, m) of x (ldx floats apart) times np panels ([k][16] floats each,
 * pstride floats apart) into y (ldy floats apart), output columns [0, cols) of the
 * 16 * np: stored, or added to what y holds when `accumulate`. One thread, no OpenMP:
 * for quant_gemm.c, which dequantises a strip of weights into panels and multiplies
 * them here (the same tiles as the panel GEMM). */
void quire_panel_block(const float *x, int64_t ldx, int64_t m, int64_t k, const float *panels,
                       int64_t pstride, int64_t np, int64_t cols, float *y, int64_t ldy,
                       int accumulate);

/* panel_bf16.c: y = round_bf16(x) W^T (+ bias) for float32 x [m, k] and W in pair
 * panels (bfloat16, hosts with AVX512_BF16), float32 out; x is first rounded into
 * `rows` (room for m times k rounded up to even bfloat16). Team function. */
void quire_bf16_gemm_team(const float *x, int64_t m, int64_t k, const uint16_t *panels,
                          int64_t n, const float *bias, float *y, uint16_t *rows);

/* rms_norm.c: out = weight * (h / sqrt(mean(h^2) + eps)) for one row of n. */
void quire_rms_norm_row(const float *h, const float *weight, float eps, int64_t n, float *out);

#endif
