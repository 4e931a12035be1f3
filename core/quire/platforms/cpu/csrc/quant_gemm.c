/*
 * Products on quantised weights read in place (cpu platform): y = x W^T (+ bias) for a
 * weight kept in one of quire/quantization/formats.py's block formats (GGUF's types and
 * Quire's row-scaled int8 / fp8), with no float copy of the weight ever made.
 *
 * Float activations (quire_quant_gemm_f32). Every weight is turned back into the float32
 * the torch reference makes (quire/quantization/dequant.py: an f16 scale times the
 * integer value, plus or minus the block's minimum, as separate roundings; -std=c11
 * keeps the compiler from contracting other expressions into FMAs, and the FMAs written
 * here round once where the reference's product is exact: see dq_q4_0), so the results
 * differ from F.linear(x, dequantize(W)) only by summation order. Two paths:
 *   - up to DIRECT_MAX_ROWS rows (decode): each weight row is dequantised block by
 *     block into registers and multiplied into every activation row's accumulators at
 *     once; the quantised bytes are read once and nothing is written but y. Q4_K, Q5_K
 *     and Q6_K rows instead multiply x by the codes (exact integers in float) and apply
 *     each sub-block's scale to the sub-block's sum, the minima times the sums of x
 *     (direct_rows_kmin; direct_rows_spread at AVX-512): the exact weights' products in
 *     another order, with fewer operations than dequantising every weight. A one-hot row
 *     still reads the reference's weight exactly. Up to DIRECT_BATCH_ROWS rows (a small
 *     decode batch) take it DIRECT_MAX_ROWS at a time, over chunks of weight rows that
 *     the later groups read from cache (direct_groups).
 *   - more rows (a prompt): each thread takes a share of 16-row panels; 4 at a time
 *     (64 weight rows), KC columns at a time, it dequantises them into a per-thread
 *     [KC][16] panel buffer (row-major first, then transposed in 16 x 16 tiles) that
 *     stays in L2, and runs panel_gemm.c's register tiles over all rows of x
 *     (quire_panel_block), adding each K chunk into y.
 * The dequantisers are written once on generic vectors of the level's register width
 * (16 floats on AVX-512, 8 on AVX2, 4 at the generic level's SSE2; wider generic
 * vectors GCC kept on the stack), so every level is vectorised from one source.
 *
 * bfloat16 decode rows (quire_quant_rows_bf16, and _team inside the fused layers; levels
 * with AVX512_BF16, Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K): the direct path with
 * the rows rounded to bfloat16 and the codes made bfloat16 words in registers
 * (direct_rows_spread_bf, direct_rows_blocks_bf), so
 * vdpbf16ps takes 32 products an instruction where the float32 rows take 16; the
 * weights stay exact, the sums float32 (what F.linear on the rounded rows and the
 * dequantised weight computes, up to summation order).
 *
 * bfloat16 activations (quire_quant_gemm_bf16, levels with AVX512_BF16): a bfloat16
 * model's products of more than DIRECT_MAX_ROWS rows. The panel path again, each K chunk's
 * dequantised weights rounded to bfloat16 (nearest even) into panel_bf16.c's pair layout
 * and multiplied with vdpbf16ps into float32 sums: what F.linear on bfloat16 activations
 * and the dequantised weight rounded to bfloat16 computes, up to summation order, at the
 * bfloat16 product rate (twice float32's per instruction) with the dequantisation spread
 * over every row. Block formats are rounded to pairs straight from the block's registers.
 * At the amx level, once Linux grants the tile state, the pair panels (AMX's B-tile
 * layout) are multiplied on AMX tiles instead (amx_tiles.c): a group of 8 panels is
 * unpacked over the whole of K, then each 32 rows run every K block with the sums kept
 * in the tiles; the rows past the last whole 16 run as a tile padded with zero rows, and
 * a K tail takes vdpbf16ps. Returns 4 where the level has no
 * AVX512_BF16, or K is odd. quire_quant_gemm_bf16_f32 takes float32 rows (a float32
 * model's bfloat16 products) and rounds them to bfloat16 as torch does, in the call;
 * quire_quant_gemm_bf16_parts takes a layer's parts (q, k and v) in one call, their
 * panels shared out over the team as one run, outputs side by side.
 *
 * Integer activations (quire_quant_gemm_i8, w8a8): each row of x is quantised to int8
 * as quire.ops.quantized.quantize_activations does (scale max|x| / 127, round half to
 * even, clamp to +-127), multiplied by int8 weights with exact int32 sums, and scaled
 * as the reference does (in double: acc * sx * sw, then float, then + bias). AVX512-VNNI
 * (vpdpbusd) takes the weights +128 as unsigned bytes and subtracts 128 * sum(x) per
 * row; AVX-512BW and AVX2 use maddubs on |w| and x carrying w's sign; plain C otherwise.
 * At the amx level, whole 16 rows of a product of 16 or more take AMX-INT8 tiles
 * (TDPBSSD, the same exact sums).
 *
 * Return codes: 0; 1 unknown format; 2 k not a whole number of blocks (or, for int8
 * activations, above I8_MAX_K, where int32 sums could overflow); 3 out of memory; 4 the
 * bfloat16 path not taken here.
 */
#pragma GCC diagnostic ignored "-Wpsabi"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "cpu_kernels.h"

enum {
    QF_F32 = 0, QF_F16 = 1, QF_BF16 = 30, QF_Q4_0 = 2, QF_Q4_1 = 3, QF_Q5_0 = 6,
    QF_Q5_1 = 7, QF_Q8_0 = 8, QF_Q2_K = 10, QF_Q3_K = 11, QF_Q4_K = 12, QF_Q5_K = 13,
    QF_Q6_K = 14, QF_INT8 = 256, QF_FP8 = 257
};

/* Rows the direct (dequantise-and-dot) path takes in one pass over the weights. */
#define DIRECT_MAX_ROWS 4
/* Weight rows a thread takes through every group of DIRECT_MAX_ROWS rows of x before the
 * next ones: 256 rows of a 2048-wide Q4_K weight are 288 KB, so the groups after the
 * first read them from L2, not memory. */
#define DIRECT_CHUNK 256
/* Rows up to which quire_quant_gemm_f32 takes the direct path (groups of
 * DIRECT_MAX_ROWS), not the panel path. */
#define DIRECT_BATCH_ROWS 8
/* Columns of K dequantised into panels at a time (a multiple of every block). */
#define KC 512
/* Most K for int8 activations: |sum| <= K * 255 * 127 stays below 2^31. */
#define I8_MAX_K 65536

#define INL static inline __attribute__((always_inline))

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

/* NL: lanes of the level's float register, which every vector below is: 16 (AVX-512),
 * 8 (AVX2), 4 (SSE2 at the generic level). U = 16 / NL registers make 16 weights.
 * (Generic vectors wider than the registers were kept on the stack by GCC.) */
#if defined(__AVX512F__)
#define NL 16
#elif defined(__AVX2__)
#define NL 8
#else
#define NL 4
#endif
#define U (16 / NL)
typedef float vf __attribute__((vector_size(4 * NL)));
typedef int32_t vi __attribute__((vector_size(4 * NL)));
typedef uint32_t vu __attribute__((vector_size(4 * NL)));

/* ---- scalar conversions (exact) ---- */

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* IEEE half to float: the magnitude's bits moved into a float's place and scaled by
 * 2^112 (exact, subnormals included), infinities and NaNs rebuilt, the sign put back. */
static inline float h2f(uint16_t h) {
    float f = bits_f32((uint32_t)(h & 0x7fff) << 13) * 0x1p112f;
    if ((h & 0x7c00) == 0x7c00)
        f = bits_f32(0x7f800000u | ((uint32_t)(h & 0x3ff) << 13));
    return bits_f32(f32_bits(f) | ((uint32_t)(h & 0x8000) << 16));
}

static inline float h2f_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h2f(h);
}

/* float8 e4m3fn to float: the same trick (2^120), 0x7f / 0xff are NaN (no infinity). */
static inline float e4m3_to_f32(uint8_t b) {
    float f = bits_f32((uint32_t)(b & 0x7f) << 20) * 0x1p120f;
    if ((b & 0x7f) == 0x7f)
        f = NAN;
    return bits_f32(f32_bits(f) | ((uint32_t)(b & 0x80) << 24));
}

/* ---- NL-lane vectors ---- */

INL vf splat(float x) {
#if NL == 16
    return (vf)_mm512_set1_ps(x);
#elif NL == 8
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){x, x, x, x};
#endif
}
INL vu splat_u(uint32_t x) { return (vu)splat(bits_f32(x)); }
INL vu lanes(uint32_t first) {
#if NL == 16
    const vu l = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#elif NL == 8
    const vu l = {0, 1, 2, 3, 4, 5, 6, 7};
#else
    const vu l = {0, 1, 2, 3};
#endif
    return l + first;
}

/* NL bytes widened to int32 lanes, unsigned or signed. */
INL vi ld_u8(const uint8_t *p) {
#if NL == 16
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)p));
#elif NL == 8
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)p));
#elif defined(__SSE2__)
    int32_t w;
    memcpy(&w, p, 4);
    const __m128i z = _mm_setzero_si128();
    return (vi)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(w), z), z);
#else
    return (vi){p[0], p[1], p[2], p[3]};
#endif
}
INL vi ld_s8(const uint8_t *p) {
#if NL == 16
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p));
#elif NL == 8
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p));
#elif defined(__SSE2__)
    int32_t w;
    memcpy(&w, p, 4);
    const __m128i b = _mm_cvtsi32_si128(w), lo = _mm_unpacklo_epi8(b, b);
    return (vi)_mm_srai_epi32(_mm_unpacklo_epi16(lo, lo), 24);
#else
    return (vi){(int8_t)p[0], (int8_t)p[1], (int8_t)p[2], (int8_t)p[3]};
#endif
}
/* NL uint16 widened to uint32 lanes. */
INL vu ld_u16(const uint8_t *p) {
#if NL == 16
    return (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p));
#elif NL == 8
    return (vu)_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p));
#elif defined(__SSE2__)
    return (vu)_mm_unpacklo_epi16(_mm_loadl_epi64((const void *)p), _mm_setzero_si128());
#else
    uint16_t h[4];
    memcpy(h, p, sizeof h);
    return (vu){h[0], h[1], h[2], h[3]};
#endif
}
INL vf cvt(vi q) { return __builtin_convertvector(q, vf); }
INL vf ldf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
INL void stf(float *p, vf v) { memcpy(p, &v, sizeof v); }

INL vf fmav(vf a, vf b, vf c) {
#if NL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif NL == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* The lanes' sum, halves added pairwise: log2 NL dependent adds, where lane after lane
 * (NL of them) took as long as a short row's blocks. */
INL float hsumv(vf a) {
#if NL == 16
    const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256((__m512)a),
                                    _mm512_extractf32x8_ps((__m512)a, 1));
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
#elif NL == 8
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128((__m256)a),
                           _mm256_extractf128_ps((__m256)a, 1));
#endif
#if NL >= 8
    h4 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h4, _mm_shuffle_ps(h4, h4, 1)));
#else
    return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

/* IEEE half to float, NL at a time (as h2f). */
INL vf h2f_v(const uint8_t *p) {
#if NL == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const void *)p));
#else
    const vu u = ld_u16(p);
    const vf f = (vf)((u & 0x7fff) << 13) * splat(0x1p112f);
    const vu special = (vu)((u & 0x7c00) == 0x7c00);
    const vu r = ((vu)f & ~special) | ((0x7f800000u | ((u & 0x3ff) << 13)) & special);
    return (vf)(r | ((u & 0x8000) << 16));
#endif
}

INL vf bf16_v(const uint8_t *p) { return (vf)(ld_u16(p) << 16); }

INL vf e4m3_v(const uint8_t *p) {
    const vu u = (vu)ld_u8(p);
    const vf f = (vf)((u & 0x7f) << 20) * splat(0x1p120f);
    const vu nan = (vu)((u & 0x7f) == 0x7f);
    const vu r = ((vu)f & ~nan) | (0x7fc00000u & nan);
    return (vf)(r | ((u & 0x80) << 24));
}

/* The half at p as a float in every lane (as splat(h2f_at(p))): on AVX-512 one
 * vcvtph2ps of the broadcast half (exact, as h2f), not h2f's scalar steps, which were a
 * large part of unpacking a 32-weight block. */
INL vf h2f_splat(const uint8_t *p) {
#if NL == 16
    uint16_t h;
    memcpy(&h, p, 2);
    return (vf)_mm512_cvtph_ps(_mm256_set1_epi16((short)h));
#else
    return splat(h2f_at(p));
#endif
}

/* ---- blocks to vectors: each writes block / NL vectors of consecutive weights ---- */

/* Where a block adds a minimum to d * q, the product d * q is exact in float32 (an
 * f16's 11 significant bits times a code of at most 5), so fmav(d, q, m) rounds once, as
 * the reference's d * q + m does: the same float, in one instruction instead of two.
 * The K formats below likewise: a sub-block's scale (d times a code of at most 6 bits,
 * exact) times a code of at most 5 bits needs 22 of float32's 24. */
INL void dq_q4_0(const uint8_t *b, vf *v) {
    const vf d = h2f_splat(b);
    for (int h = 0; h < U; h++) {
        const vi q = ld_u8(b + 2 + NL * h);
        v[h] = d * cvt((q & 15) - 8);
        v[U + h] = d * cvt((q >> 4) - 8);
    }
}

INL void dq_q4_1(const uint8_t *b, vf *v) {
    const vf d = h2f_splat(b), m = h2f_splat(b + 2);
    for (int h = 0; h < U; h++) {
        const vi q = ld_u8(b + 4 + NL * h);
        v[h] = fmav(d, cvt(q & 15), m);
        v[U + h] = fmav(d, cvt(q >> 4), m);
    }
}

/* Bits first .. first + NL - 1 of the little-endian word at p, one a lane. */
INL vi high_bits(const uint8_t *p, uint32_t first) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    return (vi)((splat_u(qh) >> lanes(first)) & 1u);
}

INL void dq_q5_0(const uint8_t *b, vf *v) {
    const vf d = h2f_splat(b);
    for (int h = 0; h < U; h++) {
        const vi q = ld_u8(b + 6 + NL * h);
        v[h] = d * cvt(((q & 15) | (high_bits(b + 2, NL * h) << 4)) - 16);
        v[U + h] = d * cvt(((q >> 4) | (high_bits(b + 2, 16 + NL * h) << 4)) - 16);
    }
}

INL void dq_q5_1(const uint8_t *b, vf *v) {
    const vf d = h2f_splat(b), m = h2f_splat(b + 2);
    for (int h = 0; h < U; h++) {
        const vi q = ld_u8(b + 8 + NL * h);
        v[h] = fmav(d, cvt((q & 15) | (high_bits(b + 4, NL * h) << 4)), m);
        v[U + h] = fmav(d, cvt((q >> 4) | (high_bits(b + 4, 16 + NL * h) << 4)), m);
    }
}

INL void dq_q8_0(const uint8_t *b, vf *v) {
    const vf d = h2f_splat(b);
    for (int t = 0; t < 32 / NL; t++) v[t] = cvt(ld_s8(b + 2 + NL * t)) * d;
}

INL void dq_q2_k(const uint8_t *b, vf *v) {
    const float d = h2f_at(b + 80), dmin = h2f_at(b + 82);
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {
        const int g = s / 8, sh = 2 * ((s % 8) / 2), half = s % 2;
        const vf dl = splat(d * (float)(b[s] & 15)), ml = splat(dmin * (float)(b[s] >> 4));
        for (int h = 0; h < U; h++) {
            const vi q = (ld_u8(b + 16 + g * 32 + half * 16 + NL * h) >> sh) & 3;
            v[U * s + h] = fmav(dl, cvt(q), -ml);
        }
    }
}

INL void dq_q3_k(const uint8_t *b, vf *v) {
    const float d = h2f_at(b + 108);
    const uint8_t *sc = b + 96;
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {
        const int low = (s < 8 ? sc[s] : sc[s - 8] >> 4) & 15;
        const int high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        const vf dl = splat(d * (float)((low | (high << 4)) - 32));
        const int g = s / 8, sh = 2 * ((s % 8) / 2), half = s % 2;
        for (int h = 0; h < U; h++) {
            const vi ql = (ld_u8(b + 32 + g * 32 + half * 16 + NL * h) >> sh) & 3;
            const vi qh = (ld_u8(b + half * 16 + NL * h) >> (s / 2)) & 1;
            v[U * s + h] = dl * cvt(ql - ((qh ^ 1) << 2));
        }
    }
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and minimum, times d and dmin (the block's
 * f16 fields, converted once by the caller: stores to the vectors may alias the block's
 * bytes, so the compiler would not hoist them). */
INL void k_scale_min(const uint8_t *b, float d, float dmin, int j, vf *scale, vf *minimum) {
    const uint8_t *p = b + 4;
    int sc, mn;
    if (j < 4) {
        sc = p[j] & 63, mn = p[j + 4] & 63;
    } else {
        sc = (p[j + 4] & 15) | ((p[j - 4] >> 2) & 0x30);
        mn = (p[j + 4] >> 4) | ((p[j] >> 2) & 0x30);
    }
    *scale = splat(d * (float)sc);
    *minimum = splat(dmin * (float)mn);
}

/* A Q4_K / Q5_K block's eight 6-bit scales (bytes 0-7 of packed) and minima (8-15),
 * unpacked from its 12 bytes a 32-bit word at a time (as llama.cpp's kernels do): a few
 * integer operations a block where k_scale_min takes a dozen a sub-block. */
INL void k_unpack_scales(const uint8_t *b, uint32_t packed[4]) {
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    packed[0] = u[0] & m6;
    packed[1] = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
    packed[2] = u[1] & m6;
    packed[3] = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
}

/* The scales times d and the minima times dmin, eight lanes each. */
typedef float v8f __attribute__((vector_size(32)));
INL void k_scales_mins(const uint8_t *b, v8f *scale, v8f *minimum) {
    uint32_t packed[4];
    uint8_t bytes[16];
    k_unpack_scales(b, packed);
    memcpy(bytes, packed, 16);
    const float d = h2f_at(b), dmin = h2f_at(b + 2);
    for (int i = 0; i < 8; i++) {
        (*scale)[i] = d * (float)bytes[i];
        (*minimum)[i] = dmin * (float)bytes[8 + i];
    }
}

/* Each block's eight sub-block sums of x, for R rows of k: sums[r * (k / 256) + block]. */
INL void subblock_sums(const float *x, int R, int64_t k, v8f *sums) {
    for (int r = 0; r < R; r++)
        for (int64_t s = 0; s < k / 32; s++) {
            const float *xs = x + r * k + 32 * s;
            vf t = ldf(xs);
            for (int u = 1; u < 32 / NL; u++) t += ldf(xs + NL * u);
            sums[r * (k / 256) + s / 8][s % 8] = hsumv(t);
        }
}

/* Sub-block j's 32 codes of a Q4_K / Q5_K block as floats (0..15 / 0..31, exact); qh:
 * a Q5_K block's 32 bytes of fifth bits, widened once for its eight sub-blocks. */
INL void k_codes(int32_t fmt, const uint8_t *b, const vi *qh, int j, vf *q) {
    const int r = j / 2, sh = 4 * (j % 2);
    for (int t = 0; t < 32 / NL; t++) {
        if (fmt == QF_Q4_K) {
            q[t] = cvt((ld_u8(b + 16 + 32 * r + NL * t) >> sh) & 15);
        } else {
            const vi low = (ld_u8(b + 48 + 32 * r + NL * t) >> sh) & 15;
            q[t] = cvt(low | (((qh[t] >> j) & 1) << 4));
        }
    }
}

INL void dq_q4_k(const uint8_t *b, vf *v) {
    const float d = h2f_at(b), dmin = h2f_at(b + 2);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        vf scale, minimum;
        k_scale_min(b, d, dmin, j, &scale, &minimum);
        const int r = j / 2, sh = 4 * (j % 2);
        for (int t = 0; t < 32 / NL; t++)
            v[(32 / NL) * j + t] =
                fmav(scale, cvt((ld_u8(b + 16 + 32 * r + NL * t) >> sh) & 15), -minimum);
    }
}

INL void dq_q5_k(const uint8_t *b, vf *v) {
    const float d = h2f_at(b), dmin = h2f_at(b + 2);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        vf scale, minimum;
        k_scale_min(b, d, dmin, j, &scale, &minimum);
        const int r = j / 2, sh = 4 * (j % 2);
        for (int t = 0; t < 32 / NL; t++) {
            const vi low = (ld_u8(b + 48 + 32 * r + NL * t) >> sh) & 15;
            const vi high = (ld_u8(b + 16 + NL * t) >> j) & 1;
            v[(32 / NL) * j + t] = fmav(scale, cvt(low | (high << 4)), -minimum);
        }
    }
}

INL void dq_q6_k(const uint8_t *b, vf *v) {
    const float d = h2f_at(b + 208);
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {
        const int g = s / 8, w8 = s % 8;
        const vf ds = splat(d * (float)(int8_t)b[192 + s]);
        for (int h = 0; h < U; h++) {
            const vi low = (ld_u8(b + g * 64 + 16 * (w8 % 4) + NL * h) >> (4 * (w8 / 4))) & 15;
            const vi high = (ld_u8(b + 128 + g * 32 + 16 * (w8 % 2) + NL * h) >> (2 * (w8 / 2)))
                            & 3;
            v[U * s + h] = ds * cvt((low | (high << 4)) - 32);
        }
    }
}

/* Weights a block holds (NL for the one-weight formats, taken a register at a time) and
 * its bytes; 0 for an unknown format. */
INL int blk_vals(int32_t fmt) {
    switch (fmt) {
    case QF_F32: case QF_F16: case QF_BF16: case QF_INT8: case QF_FP8: return NL;
    case QF_Q4_0: case QF_Q4_1: case QF_Q5_0: case QF_Q5_1: case QF_Q8_0: return 32;
    case QF_Q2_K: case QF_Q3_K: case QF_Q4_K: case QF_Q5_K: case QF_Q6_K: return 256;
    default: return 0;
    }
}

INL int blk_bytes(int32_t fmt) {
    switch (fmt) {
    case QF_F32: return 4 * NL;
    case QF_F16: case QF_BF16: return 2 * NL;
    case QF_INT8: case QF_FP8: return NL;
    default: return quire_gguf_block_bytes(fmt);
    }
}

/* True block size of the format (1 for the one-weight formats). */
static int true_block(int32_t fmt) {
    const int b = blk_vals(fmt);
    return b == NL ? 1 : b;
}

/* The block at p (block number `blk` of a row whose scale is rs) as vectors. */
INL void dq_block(int32_t fmt, const uint8_t *p, float rs, vf *v) {
    switch (fmt) {
    case QF_F32: v[0] = ldf((const float *)p); break;
    case QF_F16: v[0] = h2f_v(p); break;
    case QF_BF16: v[0] = bf16_v(p); break;
    case QF_INT8: v[0] = cvt(ld_s8(p)) * splat(rs); break;
    case QF_FP8: v[0] = e4m3_v(p) * splat(rs); break;
    case QF_Q4_0: dq_q4_0(p, v); break;
    case QF_Q4_1: dq_q4_1(p, v); break;
    case QF_Q5_0: dq_q5_0(p, v); break;
    case QF_Q5_1: dq_q5_1(p, v); break;
    case QF_Q8_0: dq_q8_0(p, v); break;
    case QF_Q2_K: dq_q2_k(p, v); break;
    case QF_Q3_K: dq_q3_k(p, v); break;
    case QF_Q4_K: dq_q4_k(p, v); break;
    case QF_Q5_K: dq_q5_k(p, v); break;
    case QF_Q6_K: dq_q6_k(p, v); break;
    default: break;
    }
}

/* Weight c of a row of a one-weight format (the tail past the last 16). */
static float dq_one(int32_t fmt, const uint8_t *row, int64_t c, float rs) {
    switch (fmt) {
    case QF_F32: {
        float f;
        memcpy(&f, row + 4 * c, 4);
        return f;
    }
    case QF_F16: return h2f_at(row + 2 * c);
    case QF_BF16: {
        uint16_t h;
        memcpy(&h, row + 2 * c, 2);
        return bits_f32((uint32_t)h << 16);
    }
    case QF_INT8: return (float)(int8_t)row[c] * rs;
    case QF_FP8: return e4m3_to_f32(row[c]) * rs;
    default: return 0.0f;
    }
}

/* ---- the direct path: R (1..DIRECT_MAX_ROWS) rows of x, weight rows [j0, j1) ---- */

INL void direct_rows(int32_t fmt, int R, const float *x, int64_t k, const uint8_t *w,
                     int64_t ws, int64_t j0, int64_t j1, const float *rs, const float *bias,
                     float *y, int64_t ldy) {
    const int B = blk_vals(fmt), BB = blk_bytes(fmt), NV = B / NL;
    /* Independent sums per row: four keep the FMA latency hidden; with more rows the
     * rows' own sums do, and four each would spill. */
    const int CH = R <= 2 ? 4 : 2;
    /* Blocks a turn of the loop takes, so that each of its vectors has a sum of its own. */
    const int UB = NV >= CH ? 1 : CH / NV;
    const int64_t nb = k / B;
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = w + j * ws;
        const float s = rs ? rs[j] : 0.0f;
        vf acc[DIRECT_MAX_ROWS][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CH; c++) acc[r][c] = (vf){0};
        for (int64_t blk = 0; blk < nb; blk += UB)
            for (int u = 0; u < UB && blk + u < nb; u++) {
                vf v[256 / NL];
                quire_prefetch_span(row + (blk + u) * BB, BB);
                dq_block(fmt, row + (blk + u) * BB, s, v);
                const float *xb = x + (blk + u) * B;
                for (int t = 0; t < NV; t++) {
                    const int c = (u * NV + t) % CH;
                    for (int r = 0; r < R; r++)
                        acc[r][c] = fmav(v[t], ldf(xb + r * k + NL * t), acc[r][c]);
                }
            }
        for (int r = 0; r < R; r++) {
            vf total = acc[r][0];
            for (int c = 1; c < CH; c++) total += acc[r][c];
            float sum = hsumv(total);
            for (int64_t c = nb * B; c < k; c++) sum += dq_one(fmt, row, c, s) * x[r * k + c];
            y[r * ldy + j] = bias ? sum + bias[j] : sum;
        }
    }
}

/* KERNEL(fmt, R, ...) with R (1..DIRECT_MAX_ROWS) a constant in each copy, so that the
 * rows' loops unroll: the copy for the caller's R. */
#define BY_ROWS(KERNEL, F, ...)                                                            \
    switch (R) {                                                                           \
    case 1: KERNEL(F, 1, __VA_ARGS__); break;                                              \
    case 2: KERNEL(F, 2, __VA_ARGS__); break;                                              \
    case 3: KERNEL(F, 3, __VA_ARGS__); break;                                              \
    default: KERNEL(F, 4, __VA_ARGS__); break;                                             \
    }

/* Q4_K / Q5_K rows with the minima taken out of the sum. In sub-block s (32 weights) a
 * weight is a_s q - b_s (a_s = d sc_s, b_s = dmin mn_s), so a row's product is
 * sum_s a_s (q . x)_s - sum_s b_s (sum x)_s: the codes (small integers, exact as floats)
 * multiply x as they are, and the sums of x per sub-block are made once a call. That is
 * one vector operation fewer per NL weights than dequantising each weight first (the
 * FMA that subtracts the minimum), on the formats a Q4_K_M file mostly holds. The
 * results equal F.linear(x, dequantize(W)) up to float rounding: the dot is taken with
 * the weights' exact values a_s q - b_s, not their float32 roundings, in another order. */
INL void direct_rows_kmin(int32_t fmt, int R, const float *x, int64_t k, const uint8_t *w,
                          int64_t ws, int64_t j0, int64_t j1, const float *bias, float *y,
                          int64_t ldy) {
    enum { V = 32 / NL };
    const int BB = blk_bytes(fmt);
    const int64_t nb = k / 256;
    v8f xs[DIRECT_MAX_ROWS * nb];
    subblock_sums(x, R, k, xs);
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = w + j * ws;
        vf acc[DIRECT_MAX_ROWS][2];
        v8f mins[DIRECT_MAX_ROWS];
        for (int r = 0; r < R; r++) {
            acc[r][0] = acc[r][1] = (vf){0};
            mins[r] = (v8f){0};
        }
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * BB;
            quire_prefetch_span(b, BB);
            v8f scale, minimum;
            k_scales_mins(b, &scale, &minimum);
            for (int r = 0; r < R; r++) mins[r] += minimum * xs[r * nb + blk];
            const float *xb = x + blk * 256;
            vi qh[V];
            if (fmt == QF_Q5_K)
                for (int t = 0; t < V; t++) qh[t] = ld_u8(b + 16 + NL * t);
#pragma GCC unroll 8
            for (int sb = 0; sb < 8; sb++) {
                vf q[V];
                k_codes(fmt, b, qh, sb, q);
                const vf a = splat(scale[sb]);
                for (int r = 0; r < R; r++) {
                    const float *xr = xb + r * k + 32 * sb;
                    /* two partial dots where a sub-block is more than two registers */
                    vf dot0 = q[0] * ldf(xr), dot1 = q[1] * ldf(xr + NL);
                    for (int t = 2; t < V; t++) {
                        if (t % 2)
                            dot1 = fmav(q[t], ldf(xr + NL * t), dot1);
                        else
                            dot0 = fmav(q[t], ldf(xr + NL * t), dot0);
                    }
                    if (V == 2)
                        dot0 = fmav(q[1], ldf(xr + NL), q[0] * ldf(xr));
                    else
                        dot0 += dot1;
                    acc[r][sb & 1] = fmav(a, dot0, acc[r][sb & 1]);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const v8f m = mins[r];
            const float sum = hsumv(acc[r][0] + acc[r][1]) -
                              (((m[0] + m[4]) + (m[2] + m[6])) + ((m[1] + m[5]) + (m[3] + m[7])));
            y[r * ldy + j] = bias ? sum + bias[j] : sum;
        }
    }
}

#if NL == 16
/* K-quant rows at AVX-512 (Q4_K, Q5_K, Q6_K), the codes never widened a byte a lane: a
 * 64-byte load of a block's low code bits holds 4 bytes in each 32-bit lane, and the
 * lane shifted right by 8m + 4n has the nibble n of its byte m in its low four bits,
 * which index a permute of the values 0..15: one operation where widening, masking and
 * converting took three or four. Q5_K's fifth and Q6_K's fifth and sixth bits come the
 * same way from their bytes (broadcast to both halves of the register, shifted per half)
 * through a second permute, of 16 * bits (minus Q6_K's 32), added. The codes are exact
 * integers in float, so the sums are the exact weights' (the minima taken out as in
 * direct_rows_kmin) up to float rounding.
 *
 * A lane's weights lie 4 apart in the row, so x is laid out once a call in that order
 * (spread_x): per block, vector v = (h, m, n) holds in lane i the x of spread_pos(v, i).
 * Each half of a vector (lanes 0-7, 8-15) lies in one sub-block of Q4_K / Q5_K; Q6_K's
 * sub-blocks of 16 are quarters. A permute of the block's scales gives each lane its own. */
INL int spread_pos(int32_t fmt, int v, int i) {
    const int h = v / 8, m = (v / 2) % 4, n = v % 2;
    if (fmt == QF_Q6_K) /* ql[64h + 4i + m]: weight 128h + 32c + l, c = i/8 + 2n */
        return 128 * h + 32 * (i / 8 + 2 * n) + 4 * (i % 8) + m;
    /* qs[64h + 4i + m]: sub-block 2 (2h + i / 8) + n, weight 4 (i % 8) + m */
    return 32 * (2 * (2 * h + i / 8) + n) + 4 * (i % 8) + m;
}

/* A prompt's rows come here four at a time, once per weight: a gather through a table
 * of a block's 256 positions, made once a call. */
static void spread_x(int32_t fmt, const float *x, int64_t k, float *xp) {
    int32_t at[256];
    for (int v = 0; v < 16; v++)
        for (int i = 0; i < 16; i++) at[v * 16 + i] = spread_pos(fmt, v, i);
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const float *xb = x + blk * 256;
        float *out = xp + blk * 256;
        for (int t = 0; t < 256; t++) out[t] = xb[at[t]];
    }
}

/* k_scales_mins in one register: lanes 0-7 the scales times d, 8-15 the minima times
 * dmin, converted 16 at a time (a lane at a time, converting them was a large share of
 * a Q4_K block's work). */
INL __m512 k_scales_mins16(const uint8_t *b) {
    uint32_t packed[4];
    k_unpack_scales(b, packed);
    const __m512 codes = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)packed)));
    const __m512 factor = _mm512_insertf32x8(_mm512_set1_ps(h2f_at(b)),
                                             _mm256_set1_ps(h2f_at(b + 2)), 1);
    return _mm512_mul_ps(codes, factor);
}

/* Each lane's scale (an index into the block's 8 or 16) in vector half h, nibble n;
 * lanes holds 0..15. */
INL __m512i spread_scale(int32_t fmt, int h, int n, __m512i lanes) {
    const __m512i halves = _mm512_slli_epi32(_mm512_srli_epi32(lanes, 3), 1); /* 2 (i/8) */
    if (fmt == QF_Q6_K) /* 8h + 2 (i/8 + 2n) + (i % 8) / 4 */
        return _mm512_add_epi32(
            _mm512_add_epi32(_mm512_set1_epi32(8 * h + 4 * n), halves),
            _mm512_srli_epi32(_mm512_and_si512(lanes, _mm512_set1_epi32(7)), 2));
    return _mm512_add_epi32(_mm512_set1_epi32(4 * h + n), halves); /* 4h + n + 2 (i/8) */
}

/* Each lane's right shift that brings byte m's high code bits (Q5_K, Q6_K) to bit 0. */
INL __m512i spread_shift(int32_t fmt, int h, int m, int n, __m512i lanes) {
    const __m512i halves = _mm512_slli_epi32(_mm512_srli_epi32(lanes, 3), 1);
    return _mm512_add_epi32(
        _mm512_set1_epi32(fmt == QF_Q6_K ? 8 * m + 4 * n : 8 * m + 4 * h + n), halves);
}

/* A spread block's scales (Q6_K: its 16 times d; Q4_K / Q5_K: k_scales_mins16's), and
 * for Q4_K / Q5_K each row's minima times its sums of x added to mins (sums: the row's
 * first block's, nb blocks a row). */
INL __m512 spread_scales(int32_t fmt, int R, const uint8_t *b, const v8f *sums, int64_t nb,
                         v8f *mins) {
    if (fmt == QF_Q6_K) {
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(b + 192)));
        return _mm512_mul_ps(_mm512_set1_ps(h2f_at(b + 208)), _mm512_cvtepi32_ps(sc));
    }
    const __m512 scales = k_scales_mins16(b);
    const v8f minimum = (v8f)_mm512_extractf32x8_ps(scales, 1);
    for (int r = 0; r < R; r++) mins[r] += minimum * sums[r * nb];
    return scales;
}

/* A row's product from its two sums and (Q4_K / Q5_K) its minima times x's sums. */
INL float spread_sum(int32_t fmt, __m512 acc0, __m512 acc1, v8f m) {
    float sum = hsumv((vf)_mm512_add_ps(acc0, acc1));
    if (fmt != QF_Q6_K)
        sum -= ((m[0] + m[4]) + (m[2] + m[6])) + ((m[1] + m[5]) + (m[3] + m[7]));
    return sum;
}

/* The bytes of a block's high code bits that vector half h reads, broadcast to both
 * halves of the register (Q5_K's 32, Q6_K's 32 of half h; zero for Q4_K). */
INL __m512i spread_high_bytes(int32_t fmt, const uint8_t *b, int h) {
    if (fmt == QF_Q5_K)
        return _mm512_broadcast_i64x4(_mm256_loadu_si256((const void *)(b + 16)));
    if (fmt == QF_Q6_K)
        return _mm512_broadcast_i64x4(_mm256_loadu_si256((const void *)(b + 128 + 32 * h)));
    return _mm512_setzero_si512();
}

INL void direct_rows_spread(int32_t fmt, int R, const float *xp, const v8f *sums, int64_t k,
                            const uint8_t *w, int64_t ws, int64_t j0, int64_t j1,
                            const float *bias, float *y, int64_t ldy) {
    const int64_t nb = k / 256; /* sums: [R][nb], each block's eight sub-block sums */
    const int BB = blk_bytes(fmt);
    const int low_at = fmt == QF_Q4_K ? 16 : fmt == QF_Q5_K ? 48 : 0;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                            15);
    /* a low code's value is its index; the high bits' value is 16 x bits (-32 for Q6_K) */
    const __m512 lo_values = _mm512_cvtepi32_ps(lanes);
    const __m512 hi_values = _mm512_cvtepi32_ps(
        fmt == QF_Q6_K
            ? _mm512_sub_epi32(_mm512_slli_epi32(_mm512_and_si512(lanes, _mm512_set1_epi32(3)), 4),
                               _mm512_set1_epi32(32))
            : _mm512_slli_epi32(_mm512_and_si512(lanes, _mm512_set1_epi32(1)), 4));
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = w + j * ws;
        __m512 acc[DIRECT_MAX_ROWS][2];
        v8f mins[DIRECT_MAX_ROWS];
        for (int r = 0; r < R; r++) {
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            mins[r] = (v8f){0};
        }
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * BB;
            quire_prefetch_span(b, BB);
            const __m512 scales = spread_scales(fmt, R, b, sums + blk, nb, mins);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m512i z = _mm512_loadu_si512((const void *)(b + low_at + 64 * h));
                const __m512i qh = spread_high_bytes(fmt, b, h);
#pragma GCC unroll 2
                for (int n = 0; n < 2; n++) {
                    const __m512 a = _mm512_permutexvar_ps(spread_scale(fmt, h, n, lanes),
                                                           scales);
                    __m512 dot[DIRECT_MAX_ROWS];
#pragma GCC unroll 4
                    for (int m = 0; m < 4; m++) {
                        __m512 q = _mm512_permutexvar_ps(_mm512_srli_epi32(z, 8 * m + 4 * n),
                                                         lo_values);
                        if (fmt != QF_Q4_K)
                            q = _mm512_add_ps(q, _mm512_permutexvar_ps(
                                _mm512_srlv_epi32(qh, spread_shift(fmt, h, m, n, lanes)),
                                hi_values));
                        for (int r = 0; r < R; r++) {
                            const __m512 xv = _mm512_loadu_ps(
                                xp + r * k + blk * 256 + ((h * 4 + m) * 2 + n) * 16);
                            dot[r] = m ? _mm512_fmadd_ps(q, xv, dot[r]) : _mm512_mul_ps(q, xv);
                        }
                    }
                    for (int r = 0; r < R; r++) acc[r][n] = _mm512_fmadd_ps(a, dot[r], acc[r][n]);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const float sum = spread_sum(fmt, acc[r][0], acc[r][1], mins[r]);
            y[r * ldy + j] = bias ? sum + bias[j] : sum;
        }
    }
}

/* Each thread's spread rows of x and their sums, kept between calls (a prompt comes here
 * four rows at a time for every weight: allocating each time put the allocator, and
 * for the larger sizes mmap and munmap, into every call). Never freed: at most
 * DIRECT_MAX_ROWS rows of the widest weight a thread has multiplied. */
static __thread float *spread_rows;
static __thread size_t spread_bytes;

static float *spread_scratch(size_t bytes) {
    if (bytes > spread_bytes) {
        free(spread_rows);
        spread_bytes = (bytes + 4095) / 4096 * 4096;
        spread_rows = aligned_alloc(64, spread_bytes);
        if (!spread_rows)
            spread_bytes = 0;
    }
    return spread_rows;
}

/* direct_rows_spread for R rows of x; false where the spread x could not be allocated. */
static int direct_spread(int32_t fmt, int R, const float *x, int64_t k, const uint8_t *w,
                         int64_t ws, int64_t j0, int64_t j1, const float *bias, float *y,
                         int64_t ldy) {
    const int64_t nb = k / 256;
    float *xp = spread_scratch((size_t)(R * k) * sizeof(float) + (size_t)(R * nb) * sizeof(v8f));
    if (!xp)
        return 0;
    v8f *sums = (v8f *)(xp + R * k); /* k is a multiple of 256: 64-byte aligned */
    for (int r = 0; r < R; r++) spread_x(fmt, x + r * k, k, xp + r * k);
    subblock_sums(x, R, k, sums);
#define SPREAD_FMT(F)                                                                      \
    case F:                                                                                \
        BY_ROWS(direct_rows_spread, F, xp, sums, k, w, ws, j0, j1, bias, y, ldy)           \
        break;
    switch (fmt) { /* each format a constant in its copies */
        SPREAD_FMT(QF_Q4_K) SPREAD_FMT(QF_Q5_K) SPREAD_FMT(QF_Q6_K)
    default: break;
    }
#undef SPREAD_FMT
    return 1;
}
#endif

#if defined(__AVX512BF16__)
/* K-quant rows with bfloat16 activations (quire_quant_rows_bf16): direct_rows_spread's
 * way with the codes as bfloat16 in 16-bit lanes, multiplied into x rounded to bfloat16
 * by vdpbf16ps (32 products an instruction, float32 sums), where the float32 path takes
 * 16. Word lane w of a half's 64-byte load holds bytes 2w and 2w + 1; shifted right by
 * 8 m + 4 n (m, n in 0..1) it has nibble n of byte 2w + m in its low four bits, the
 * index of a word permute of the codes' values (Q5_K's fifth bit and Q6_K's fifth and
 * sixth placed above them first, from their bytes broadcast to both halves). The pair
 * of words a vdpbf16ps lane sums (bytes 4p + m and 4p + 2 + m) lies in one sub-block,
 * the lane's of direct_rows_spread, so the scales are that path's. Codes and scales are
 * exact: the products are the exact weights' times x rounded to bfloat16 (nearest
 * even, as torch rounds), in float32 sums. */

/* Where word lane w of vector v = (h, n, m) (v = 4h + 2n + m) takes x from in a block. */
INL int spread_pos_bf(int32_t fmt, int v, int w) {
    const int h = v / 4, n = (v / 2) % 2, m = v % 2;
    const int byte = 2 * w + m; /* in the half's 64 */
    return spread_pos(fmt, 8 * h + 2 * (byte % 4) + n, byte / 4);
}

/* A row of x rounded to bfloat16 in the spread order (xp), and the rounded values' sums
 * per sub-block (sums, one v8f a block). */
static void spread_x_bf(int32_t fmt, const float *x, int64_t k, uint16_t *xp, v8f *sums) {
    int32_t at[256];
    for (int v = 0; v < 8; v++)
        for (int w = 0; w < 32; w++) at[v * 32 + w] = spread_pos_bf(fmt, v, w);
    float rounded[256], gathered[256];
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const float *xb = x + blk * 256;
        for (int t = 0; t < 256; t += 32) {
            const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xb + t + 16),
                                                               _mm512_loadu_ps(xb + t));
            /* back to float32: the words in order, each shifted into the high half */
            _mm512_storeu_ps(rounded + t, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_castsi512_si256(pairs)), 16)));
            _mm512_storeu_ps(rounded + t + 16, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pairs, 1)), 16)));
        }
        for (int s = 0; s < 8; s++) {
            vf t = ldf(rounded + 32 * s) + ldf(rounded + 32 * s + 16);
            sums[blk][s] = hsumv(t);
        }
        for (int t = 0; t < 256; t++) gathered[t] = rounded[at[t]];
        uint16_t *out = xp + blk * 256;
        for (int t = 0; t < 256; t += 32)
            _mm512_storeu_si512(out + t, (__m512i)_mm512_cvtne2ps_pbh(
                                             _mm512_loadu_ps(gathered + t + 16),
                                             _mm512_loadu_ps(gathered + t)));
    }
}

/* The right shift (negative: left) per word that brings the high code bits of byte
 * 2w + m, nibble n, of half h to bit 4 (Q5_K) or bits 4-5 (Q6_K), for word lanes in the
 * low (upper = 0) or high 256 bits. */
INL int high_shift(int32_t fmt, int h, int m, int n, int upper) {
    if (fmt == QF_Q6_K) /* qh bits 2 (byte / 32) + 4 n of byte (byte % 32) */
        return 8 * m + 2 * upper + 4 * n - 4;
    return 8 * m + 4 * h + 2 * upper + n - 4; /* Q5_K: bit 2 (2h + byte / 32) + n */
}

/* v's words shifted right by lo (the low 256 bits) or hi (the high 256 bits); left by
 * -lo and -hi where they are negative (both are then). */
INL __m512i shift_words(__m512i v, int lo, int hi) {
    const __m512i halves = _mm512_inserti64x4(_mm512_set1_epi16((short)(lo < 0 ? -lo : lo)),
                                              _mm256_set1_epi16((short)(hi < 0 ? -hi : hi)), 1);
    return lo < 0 ? _mm512_sllv_epi16(v, halves) : _mm512_srlv_epi16(v, halves);
}

INL void direct_rows_spread_bf(int32_t fmt, int R, const uint16_t *xp, const v8f *sums,
                               int64_t k, const uint8_t *w, int64_t ws, int64_t j0, int64_t j1,
                               const float *bias, float *y, int64_t ldy) {
    const int64_t nb = k / 256;
    const int BB = blk_bytes(fmt);
    const int low_at = fmt == QF_Q4_K ? 16 : fmt == QF_Q5_K ? 48 : 0;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                            15);
    /* the codes' values as bfloat16 words: Q4_K's index i (bit 4 the next nibble's) is
     * i & 15, Q5_K's i, Q6_K's (64 through two tables) i - 32 */
    __m512i table0, table1 = _mm512_setzero_si512();
    {
        uint16_t t[64];
        for (int i = 0; i < 64; i++) {
            const float v = fmt == QF_Q4_K ? (float)(i & 15) : fmt == QF_Q5_K ? (float)(i & 31)
                                                                              : (float)(i - 32);
            t[i] = (uint16_t)(f32_bits(v) >> 16);
        }
        table0 = _mm512_loadu_si512((const void *)t);
        table1 = _mm512_loadu_si512((const void *)(t + 32));
    }
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = w + j * ws;
        __m512 acc[DIRECT_MAX_ROWS][2];
        v8f mins[DIRECT_MAX_ROWS];
        for (int r = 0; r < R; r++) {
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            mins[r] = (v8f){0};
        }
        for (int64_t blk = 0; blk < nb; blk++) {
            const uint8_t *b = row + blk * BB;
            quire_prefetch_span(b, BB);
            const __m512 scales = spread_scales(fmt, R, b, sums + blk, nb, mins);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m512i z = _mm512_loadu_si512((const void *)(b + low_at + 64 * h));
                const __m512i qh = spread_high_bytes(fmt, b, h);
#pragma GCC unroll 2
                for (int n = 0; n < 2; n++) {
                    const __m512 a = _mm512_permutexvar_ps(spread_scale(fmt, h, n, lanes),
                                                           scales);
                    __m512 dot[DIRECT_MAX_ROWS];
                    for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_ps();
#pragma GCC unroll 2
                    for (int m = 0; m < 2; m++) {
                        __m512i idx = _mm512_srli_epi16(z, 8 * m + 4 * n);
                        __m512i q;
                        if (fmt == QF_Q4_K) {
                            q = _mm512_permutexvar_epi16(idx, table0);
                        } else {
                            const __m512i high = shift_words(
                                qh, high_shift(fmt, h, m, n, 0), high_shift(fmt, h, m, n, 1));
                            idx = _mm512_ternarylogic_epi32(idx, high, low4, 0xE4);
                            q = fmt == QF_Q5_K ? _mm512_permutexvar_epi16(idx, table0)
                                               : _mm512_permutex2var_epi16(table0, idx, table1);
                        }
                        const uint16_t *xv = xp + blk * 256 + (4 * h + 2 * n + m) * 32;
                        for (int r = 0; r < R; r++)
                            dot[r] = _mm512_dpbf16_ps(
                                dot[r], (__m512bh)q,
                                (__m512bh)_mm512_loadu_si512((const void *)(xv + r * k)));
                    }
                    for (int r = 0; r < R; r++) acc[r][n] = _mm512_fmadd_ps(a, dot[r], acc[r][n]);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const float sum = spread_sum(fmt, acc[r][0], acc[r][1], mins[r]);
            y[r * ldy + j] = bias ? sum + bias[j] : sum;
        }
    }
}

/* direct_rows_spread_bf for R rows of x over weight rows [j0, j1); false where the
 * format is not a K-quant's or the spread rows could not be allocated. */
static int direct_spread_bf(int32_t fmt, int R, const float *x, int64_t k, const uint8_t *w,
                            int64_t ws, int64_t j0, int64_t j1, const float *bias, float *y,
                            int64_t ldy) {
    if (fmt != QF_Q4_K && fmt != QF_Q5_K && fmt != QF_Q6_K)
        return 0;
    const int64_t nb = k / 256;
    uint16_t *xp =
        (uint16_t *)spread_scratch((size_t)(R * k) * 2 + (size_t)(R * nb) * sizeof(v8f));
    if (!xp)
        return 0;
    v8f *sums = (v8f *)(xp + R * k); /* k is a multiple of 256: 64-byte aligned */
    for (int r = 0; r < R; r++) spread_x_bf(fmt, x + r * k, k, xp + r * k, sums + r * nb);
#define SPREAD_FMT(F)                                                                      \
    case F:                                                                                \
        BY_ROWS(direct_rows_spread_bf, F, xp, sums, k, w, ws, j0, j1, bias, y, ldy)        \
        break;
    switch (fmt) {
        SPREAD_FMT(QF_Q4_K) SPREAD_FMT(QF_Q5_K) SPREAD_FMT(QF_Q6_K)
    default: break;
    }
#undef SPREAD_FMT
    return 1;
}

/* 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1) with bfloat16 rows, two blocks a register:
 * the 16 code bytes of blocks b and b + 1 widened to words (lanes 0-15, 16-31), whose low
 * nibbles are weights 0-15 of each block and whose high nibbles (after a shift) weights
 * 16-31, each (with Q5's fifth bit added under a mask of its qh bits) indexing a word
 * permute of the codes' values (less 8 or 16 for the _0 formats, as their weights are).
 * vdpbf16ps sums both halves of the blocks into one register, lanes 0-7 block b's and
 * 8-15 block b + 1's, scaled by each block's d; the _1 formats' minima multiply the
 * blocks' sums of the rounded row. A pair's x is laid out [b 0-15, b+1 0-15, b 16-31,
 * b+1 16-31]; an odd last block pairs with zeros (codes, x and scales). The products
 * are the exact weights' times the rounded rows, as the K-quants' are. A pair's four
 * half scales [d_b, m_b, d_b+1, m_b+1] come in one 64-bit move and one conversion
 * (not a broadcast each), and its minima take a 128-bit multiply-add against the sums
 * [0, s_b, 0, s_b+1]: the one-row products are bound by the vector pipes, not memory. */
INL int blk32_codes(int32_t fmt) {
    return fmt == QF_Q4_0 ? 2 : fmt == QF_Q4_1 ? 4 : fmt == QF_Q5_0 ? 6 : 8;
}

/* A row of x rounded to bfloat16 in the pairs' order (64 words a pair), and with sums
 * each pair's rounded block sums as [0, b, 0, b + 1] (the _1 formats'). */
static void pairs_x_bf(const float *x, int64_t k, uint16_t *xp, float *sums) {
    const int64_t nb = k / 32;
    for (int64_t p = 0; p < (nb + 1) / 2; p++) {
        float g[64];
        for (int half = 0; half < 2; half++)
            for (int b = 0; b < 2; b++)
                for (int i = 0; i < 16; i++) {
                    const int64_t blk = 2 * p + b;
                    g[32 * half + 16 * b + i] = blk < nb ? x[blk * 32 + 16 * half + i] : 0.0f;
                }
        float total[2] = {0.0f, 0.0f};
        for (int t = 0; t < 64; t += 32) {
            const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(g + t + 16),
                                                               _mm512_loadu_ps(g + t));
            _mm512_storeu_si512(xp + p * 64 + t, words);
            for (int b = 0; b < 2; b++) /* the rounded values back, summed per block */
                total[b] += hsumv((vf)_mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(b ? _mm512_extracti64x4_epi64(words, 1)
                                            : _mm512_castsi512_si256(words)), 16)));
        }
        sums[p * 4] = sums[p * 4 + 2] = 0.0f;
        sums[p * 4 + 1] = total[0];
        sums[p * 4 + 3] = total[1];
    }
}

/* A pair's half scales [d0, m0, d1, m1] as four floats: d at p0 and p1, m two bytes after
 * each (the _1 formats; zero for the others, and for a missing p1). */
INL __m128 pair_scales(const uint8_t *p0, const uint8_t *p1, int minimum) {
    uint32_t h0 = 0, h1 = 0;
    if (minimum) {
        memcpy(&h0, p0, 4);
        if (p1)
            memcpy(&h1, p1, 4);
    } else {
        uint16_t d0, d1 = 0;
        memcpy(&d0, p0, 2);
        if (p1)
            memcpy(&d1, p1, 2);
        h0 = d0;
        h1 = d1;
    }
    return _mm_maskz_cvtph_ps(0xF, _mm_cvtsi64_si128((long long)((uint64_t)h1 << 32 | h0)));
}

INL void direct_rows_blocks_bf(int32_t fmt, int R, const uint16_t *xp, const float *sums,
                               int64_t k, const uint8_t *w, int64_t ws, int64_t j0,
                               int64_t j1, const float *bias, float *y, int64_t ldy) {
    const int64_t nb = k / 32, np = (nb + 1) / 2;
    const int BB = blk_bytes(fmt), at = blk32_codes(fmt);
    const int five = fmt == QF_Q5_0 || fmt == QF_Q5_1, minimum = fmt == QF_Q4_1 ||
                                                                 fmt == QF_Q5_1;
    __m512i table;
    {
        uint16_t t[32];
        for (int i = 0; i < 32; i++) {
            const int v = five ? i - (fmt == QF_Q5_0 ? 16 : 0)
                               : (i & 15) - (fmt == QF_Q4_0 ? 8 : 0);
            t[i] = (uint16_t)(f32_bits((float)v) >> 16);
        }
        table = _mm512_loadu_si512((const void *)t);
    }
    const __m512i low4 = _mm512_set1_epi16(0x0F), sixteen = _mm512_set1_epi16(16);
    const __m512i d_lanes = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = w + j * ws;
        __m512 acc[DIRECT_MAX_ROWS][2];
        __m128 mins[DIRECT_MAX_ROWS];
        for (int r = 0; r < R; r++) {
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            mins[r] = _mm_setzero_ps();
        }
        for (int64_t p = 0; p < np; p++) {
            const uint8_t *b0 = row + 2 * p * BB;
            const uint8_t *b1 = 2 * p + 1 < nb ? b0 + BB : NULL;
            quire_prefetch_span(b0, 2 * BB);
            const __m128i q0 = _mm_loadu_si128((const void *)(b0 + at));
            const __m128i q1 = b1 ? _mm_loadu_si128((const void *)(b1 + at))
                                  : _mm_setzero_si128();
            const __m512i z = _mm512_cvtepu8_epi16(
                _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1));
            __m512i lo = z, hi = _mm512_srli_epi16(z, 4);
            if (five) { /* bit i of a block's qh: weight i's fifth bit */
                const int qh_at = fmt == QF_Q5_0 ? 2 : 4;
                uint32_t h0, h1 = 0;
                memcpy(&h0, b0 + qh_at, 4);
                if (b1)
                    memcpy(&h1, b1 + qh_at, 4);
                lo = _mm512_and_si512(z, low4);
                lo = _mm512_mask_add_epi16(lo, (__mmask32)((h0 & 0xFFFFu) | (h1 << 16)), lo,
                                           sixteen);
                hi = _mm512_mask_add_epi16(hi, (__mmask32)((h0 >> 16) | (h1 & 0xFFFF0000u)),
                                           hi, sixteen);
            }
            const __m512i qlo = _mm512_permutexvar_epi16(lo, table);
            const __m512i qhi = _mm512_permutexvar_epi16(hi, table);
            const __m128 dm = pair_scales(b0, b1, minimum);
            const __m512 d = _mm512_permutexvar_ps(d_lanes, _mm512_castps128_ps512(dm));
            const uint16_t *xv = xp + p * 64;
            for (int r = 0; r < R; r++) {
                const uint16_t *xr = xv + r * np * 64;
                __m512 dot = _mm512_dpbf16_ps(
                    _mm512_setzero_ps(), (__m512bh)qlo,
                    (__m512bh)_mm512_loadu_si512((const void *)xr));
                dot = _mm512_dpbf16_ps(dot, (__m512bh)qhi,
                                       (__m512bh)_mm512_loadu_si512((const void *)(xr + 32)));
                acc[r][p & 1] = _mm512_fmadd_ps(d, dot, acc[r][p & 1]);
                if (minimum)
                    mins[r] = _mm_fmadd_ps(dm, _mm_loadu_ps(sums + (r * np + p) * 4), mins[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            float sum = hsumv((vf)_mm512_add_ps(acc[r][0], acc[r][1]));
            if (minimum) {
                const __m128 m2 = _mm_add_ps(mins[r], _mm_movehl_ps(mins[r], mins[r]));
                sum += _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
            }
            y[r * ldy + j] = bias ? sum + bias[j] : sum;
        }
    }
}

/* direct_rows_blocks_bf for R rows of x over weight rows [j0, j1); false where the
 * format is not one of its four or the laid-out rows could not be allocated. */
static int direct_blocks_bf(int32_t fmt, int R, const float *x, int64_t k, const uint8_t *w,
                            int64_t ws, int64_t j0, int64_t j1, const float *bias, float *y,
                            int64_t ldy) {
    if (fmt != QF_Q4_0 && fmt != QF_Q4_1 && fmt != QF_Q5_0 && fmt != QF_Q5_1)
        return 0;
    const int64_t np = (k / 32 + 1) / 2;
    uint16_t *xp = (uint16_t *)spread_scratch((size_t)(R * np) * (64 * 2 + 4 * 4));
    if (!xp)
        return 0;
    float *sums = (float *)(xp + R * np * 64); /* 128 bytes a pair: 64-byte aligned */
    for (int r = 0; r < R; r++)
        pairs_x_bf(x + r * k, k, xp + r * np * 64, sums + r * np * 4);
#define BLOCKS_FMT(F)                                                                      \
    case F:                                                                                \
        BY_ROWS(direct_rows_blocks_bf, F, xp, sums, k, w, ws, j0, j1, bias, y, ldy)        \
        break;
    switch (fmt) {
        BLOCKS_FMT(QF_Q4_0) BLOCKS_FMT(QF_Q4_1) BLOCKS_FMT(QF_Q5_0) BLOCKS_FMT(QF_Q5_1)
    default: break;
    }
#undef BLOCKS_FMT
    return 1;
}
#endif

#define KMIN_FMT(F)                                                                        \
    case F:                                                                                \
        BY_ROWS(direct_rows_kmin, F, x, k, w, ws, j0, j1, bias, y, ldy)                    \
        break;

#define DIRECT_FMT(F)                                                                      \
    case F:                                                                                \
        BY_ROWS(direct_rows, F, x, k, w, ws, j0, j1, rs, bias, y, ldy)                     \
        break;

static void direct(int32_t fmt, int R, const float *x, int64_t k, const uint8_t *w, int64_t ws,
                   int64_t j0, int64_t j1, const float *rs, const float *bias, float *y,
                   int64_t ldy, int bf16) {
#if defined(__AVX512BF16__)
    if (bf16 && (direct_spread_bf(fmt, R, x, k, w, ws, j0, j1, bias, y, ldy) ||
                 direct_blocks_bf(fmt, R, x, k, w, ws, j0, j1, bias, y, ldy)))
        return;
#else
    (void)bf16;
#endif
    switch (fmt) {
        DIRECT_FMT(QF_F32) DIRECT_FMT(QF_F16) DIRECT_FMT(QF_BF16) DIRECT_FMT(QF_INT8)
        DIRECT_FMT(QF_FP8) DIRECT_FMT(QF_Q4_0) DIRECT_FMT(QF_Q4_1) DIRECT_FMT(QF_Q5_0)
        DIRECT_FMT(QF_Q5_1) DIRECT_FMT(QF_Q8_0) DIRECT_FMT(QF_Q2_K) DIRECT_FMT(QF_Q3_K)
    case QF_Q4_K: case QF_Q5_K: case QF_Q6_K:
#if NL == 16
        if (direct_spread(fmt, R, x, k, w, ws, j0, j1, bias, y, ldy))
            break;
#endif
        switch (fmt) {
            KMIN_FMT(QF_Q4_K) KMIN_FMT(QF_Q5_K) DIRECT_FMT(QF_Q6_K)
        default: break;
        }
        break;
    default: break;
    }
}

/* ---- the panel path ---- */

/* Weights [c0, c0 + len) of one row into out (c0 a multiple of the block). */
INL void dq_span(int32_t fmt, const uint8_t *row, float rs, int64_t c0, int64_t len,
                 float *out) {
    const int B = blk_vals(fmt), BB = blk_bytes(fmt), NV = B / NL;
    const int64_t nb = len / B;
    const uint8_t *p = row + c0 / B * BB;
    for (int64_t blk = 0; blk < nb; blk++) {
        vf v[256 / NL];
        dq_block(fmt, p + blk * BB, rs, v);
        for (int t = 0; t < NV; t++) stf(out + blk * B + NL * t, v[t]);
    }
    for (int64_t c = nb * B; c < len; c++) out[c] = dq_one(fmt, row, c0 + c, rs);
}

#define SPAN_FMT(F)                                                                        \
    case F: dq_span(F, row, rs, c0, len, out); break;

static void dequant_span(int32_t fmt, const uint8_t *row, float rs, int64_t c0, int64_t len,
                         float *out) {
    switch (fmt) {
        SPAN_FMT(QF_F32) SPAN_FMT(QF_F16) SPAN_FMT(QF_BF16) SPAN_FMT(QF_INT8)
        SPAN_FMT(QF_FP8) SPAN_FMT(QF_Q4_0) SPAN_FMT(QF_Q4_1) SPAN_FMT(QF_Q5_0)
        SPAN_FMT(QF_Q5_1) SPAN_FMT(QF_Q8_0) SPAN_FMT(QF_Q2_K) SPAN_FMT(QF_Q3_K)
        SPAN_FMT(QF_Q4_K) SPAN_FMT(QF_Q5_K) SPAN_FMT(QF_Q6_K)
    default: break;
    }
}

/* rows [16][len] (KC floats apart) to panel [len][16]. */
static void transpose16(const float *rows, int64_t len, float *panel) {
    int64_t c = 0;
#if defined(__AVX512F__)
    typedef int32_t v16i __attribute__((vector_size(64)));
    for (; c + 16 <= len; c += 16) {
        vf r[16];
        for (int i = 0; i < 16; i++) r[i] = ldf(rows + i * KC + c);
        static const v16i A8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
        static const v16i A4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
        static const v16i A2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
        static const v16i A1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
#define STAGE(D, A)                                                                        \
    for (int i = 0; i < 16; i++)                                                           \
        if (!(i & D)) {                                                                    \
            const vf a = r[i], b = r[i + D];                                               \
            r[i] = __builtin_shuffle(a, b, A);                                             \
            r[i + D] = __builtin_shuffle(a, b, A + D);                                     \
        }
        STAGE(8, A8) STAGE(4, A4) STAGE(2, A2) STAGE(1, A1)
#undef STAGE
        for (int i = 0; i < 16; i++) stf(panel + (c + i) * 16, r[i]);
    }
#elif defined(__AVX2__)
    typedef int32_t v8i_ __attribute__((vector_size(32)));
    for (; c + 8 <= len; c += 8)
        for (int h = 0; h < 2; h++) {
            v8f r[8];
            for (int i = 0; i < 8; i++) r[i] = load8(rows + (8 * h + i) * KC + c);
            static const v8i_ A4 = {0, 1, 2, 3, 8, 9, 10, 11};
            static const v8i_ A2 = {0, 1, 8, 9, 4, 5, 12, 13};
            static const v8i_ A1 = {0, 8, 2, 10, 4, 12, 6, 14};
#define STAGE(D, A)                                                                        \
    for (int i = 0; i < 8; i++)                                                            \
        if (!(i & D)) {                                                                    \
            const v8f a = r[i], b = r[i + D];                                              \
            r[i] = __builtin_shuffle(a, b, A);                                             \
            r[i + D] = __builtin_shuffle(a, b, A + D);                                     \
        }
            STAGE(4, A4) STAGE(2, A2) STAGE(1, A1)
#undef STAGE
            for (int i = 0; i < 8; i++) memcpy(panel + (c + i) * 16 + 8 * h, &r[i], 32);
        }
#endif
    for (; c < len; c++)
        for (int i = 0; i < 16; i++) panel[c * 16 + i] = rows[i * KC + c];
}

/* The panel path for the calling thread's share of panels; 0, or 3 without memory. */
static int panel_share(int32_t fmt, const float *x, int64_t m, int64_t k, const uint8_t *w,
                       int64_t ws, int64_t n, const float *rs, const float *bias, float *y,
                       int64_t ldy, int64_t p_begin, int64_t p_end) {
    if (p_begin >= p_end)
        return 0;
    float *tmp = quire_thread_scratch((size_t)16 * KC + (size_t)4 * 16 * KC);
    if (tmp == NULL)
        return 3;
    float *panels = tmp + 16 * KC;
    int64_t np;
    for (int64_t p = p_begin; p < p_end; p += np) {
        np = p_end - p < 4 ? p_end - p : 4;
        const int64_t j0 = 16 * p, cols = n - j0 < 16 * np ? n - j0 : 16 * np;
        for (int64_t c0 = 0; c0 < k; c0 += KC) {
            const int64_t len = k - c0 < KC ? k - c0 : KC;
            for (int64_t q = 0; q < np; q++) {
                for (int64_t r = 0; r < 16; r++) {
                    const int64_t j = j0 + 16 * q + r;
                    if (j < n)
                        dequant_span(fmt, w + j * ws, rs ? rs[j] : 0.0f, c0, len,
                                     tmp + r * KC);
                    else
                        memset(tmp + r * KC, 0, sizeof(float) * len);
                }
                transpose16(tmp, len, panels + q * 16 * KC);
            }
            quire_panel_block(x + c0, k, m, len, panels, 16 * KC, np, cols, y + j0, ldy,
                              c0 > 0);
        }
        if (bias)
            for (int64_t i = 0; i < m; i++)
                for (int64_t c = 0; c < cols; c++) y[i * ldy + j0 + c] += bias[j0 + c];
    }
    return 0;
}

/* The direct path for any m rows over weight rows [j0, j1): DIRECT_MAX_ROWS rows of x
 * at a time, DIRECT_CHUNK weight rows at a time, so each chunk is read from memory once
 * and from cache by the other groups. */
static void direct_groups(int32_t fmt, const float *x, int64_t m, int64_t k,
                          const uint8_t *w, int64_t w_stride, int64_t j0, int64_t j1,
                          const float *row_scales, const float *bias, float *y,
                          int64_t ldy, int bf16) {
    if (m <= DIRECT_MAX_ROWS) {
        direct(fmt, (int)m, x, k, w, w_stride, j0, j1, row_scales, bias, y, ldy, bf16);
        return;
    }
    for (int64_t c = j0; c < j1; c += DIRECT_CHUNK) {
        const int64_t c1 = j1 - c < DIRECT_CHUNK ? j1 : c + DIRECT_CHUNK;
        for (int64_t r0 = 0; r0 < m; r0 += DIRECT_MAX_ROWS) {
            const int64_t rows = m - r0 < DIRECT_MAX_ROWS ? m - r0 : DIRECT_MAX_ROWS;
            direct(fmt, (int)rows, x + r0 * k, k, w, w_stride, c, c1, row_scales, bias,
                   y + r0 * ldy, ldy, bf16);
        }
    }
}

/* The direct path for any rows, called by every thread of a team that is already
 * running (the fused decode layer's): each thread a contiguous share of the n outputs,
 * no barrier (the caller places one). fmt and k were checked by the caller. */
void quire_quant_rows_team(int32_t fmt, const float *x, int64_t m, int64_t k,
                           const uint8_t *w, int64_t w_stride, int64_t n,
                           const float *row_scales, const float *bias, float *y,
                           int64_t ldy) {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    direct_groups(fmt, x, m, k, w, w_stride, n * t / team, n * (t + 1) / team, row_scales,
                  bias, y, ldy, 0);
}

/* quire_quant_rows_team with the rows rounded to bfloat16 (direct_rows_spread_bf) on the
 * formats quire_quant_rows_bf16_fits takes; the caller checked that it does. */
void quire_quant_rows_bf16_team(int32_t fmt, const float *x, int64_t m, int64_t k,
                                const uint8_t *w, int64_t w_stride, int64_t n,
                                const float *bias, float *y, int64_t ldy) {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    direct_groups(fmt, x, m, k, w, w_stride, n * t / team, n * (t + 1) / team, NULL, bias,
                  y, ldy, 1);
}

int quire_quant_rows_bf16_fits(int32_t fmt, int64_t k) {
#if defined(__AVX512BF16__)
    if (fmt == QF_Q4_0 || fmt == QF_Q4_1 || fmt == QF_Q5_0 || fmt == QF_Q5_1)
        return k > 0 && k % 32 == 0;
    return (fmt == QF_Q4_K || fmt == QF_Q5_K || fmt == QF_Q6_K) && k > 0 && k % 256 == 0;
#else
    (void)fmt, (void)k;
    return 0;
#endif
}

/* The one-call entry: m rows (any number; callers give few, as the direct path suits)
 * over the n outputs in parallel; 4 where quire_quant_rows_bf16_fits says no. */
int quire_quant_rows_bf16(int32_t fmt, const float *x, int64_t m, int64_t k, const uint8_t *w,
                          int64_t w_stride, int64_t n, const float *bias, float *y,
                          int64_t ldy) {
    if (!quire_quant_rows_bf16_fits(fmt, k) || m < 0 || n < 0)
        return 4;
#pragma omp parallel
    quire_quant_rows_bf16_team(fmt, x, m, k, w, w_stride, n, bias, y, ldy);
    return 0;
}

/* Rows up to which quire_quant_gemm_f32 takes the direct path: DIRECT_BATCH_ROWS, but
 * DIRECT_MAX_ROWS for Q6_K below AVX-512, where its direct rows dequantise every weight
 * (no spread path) and lose to the panels from 5 rows on. */
static int64_t direct_batch_rows(int32_t fmt) {
#if NL == 16
    (void)fmt;
    return DIRECT_BATCH_ROWS;
#else
    return fmt == QF_Q6_K ? DIRECT_MAX_ROWS : DIRECT_BATCH_ROWS;
#endif
}

int64_t quire_quant_direct_rows(int32_t fmt) { return direct_batch_rows(fmt); }

/* Whether quire_quant_gemm_f32 takes fmt with rows of k weights. */
int quire_quant_fits(int32_t fmt, int64_t k) {
    return blk_vals(fmt) != 0 && k > 0 && k % true_block(fmt) == 0;
}

int quire_quant_gemm_f32(int32_t fmt, const float *x, int64_t m, int64_t k, const uint8_t *w,
                         int64_t w_stride, int64_t n, const float *row_scales,
                         const float *bias, float *y, int64_t ldy) {
    if (blk_vals(fmt) == 0)
        return 1;
    if (k % true_block(fmt) || k < 0)
        return 2;
    if (m <= 0 || n <= 0)
        return 0;
    int failed = 0;
    if (m <= direct_batch_rows(fmt)) {
#pragma omp parallel
        {
            const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
            direct_groups(fmt, x, m, k, w, w_stride, n * t / team, n * (t + 1) / team,
                          row_scales, bias, y, ldy, 0);
        }
        return 0;
    }
    const int64_t num_panels = (n + 15) / 16;
#pragma omp parallel reduction(| : failed)
    {
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        failed |= panel_share(fmt, x, m, k, w, w_stride, n, row_scales, bias, y, ldy,
                              num_panels * t / team, num_panels * (t + 1) / team);
    }
    return failed ? 3 : 0;
}

/* ---- bfloat16 activations (levels with AVX512_BF16) ---- */

#if defined(__AVX512BF16__)
#define BF_ROWS 6
#define BF_PANELS 4

/* len floats (len even) rounded to bfloat16 (nearest even), stored in order: as 32-bit
 * words, len / 2 pairs of neighbouring weights, low half first. */
static void round_to_pairs(const float *src, int64_t len, uint32_t *dst) {
    int64_t c = 0;
    for (; c + 32 <= len; c += 32)
        _mm512_storeu_si512(dst + c / 2, (__m512i)_mm512_cvtne2ps_pbh(
                                             _mm512_loadu_ps(src + c + 16),
                                             _mm512_loadu_ps(src + c)));
    for (; c < len; c += 16) {
        const int64_t left = len - c < 16 ? len - c : 16;
        const __mmask16 mk = (__mmask16)((1u << left) - 1);
        _mm256_mask_storeu_epi16((uint16_t *)dst + c, mk,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, src + c)));
    }
}

/* Weights [c0, c0 + len) of one row of a format of 32 or 256-weight blocks, rounded to
 * bfloat16 pairs as round_to_pairs does, straight from each block's registers (no float
 * copy of the row in between). */
INL void dq_pairs(int32_t fmt, const uint8_t *row, int64_t c0, int64_t len, uint32_t *out) {
    const int B = blk_vals(fmt), BB = blk_bytes(fmt), NV = B / NL;
    const uint8_t *p = row + c0 / B * BB;
    for (int64_t blk = 0; blk < len / B; blk++) {
        vf v[256 / NL];
        dq_block(fmt, p + blk * BB, 0.0f, v);
        for (int t = 0; t < NV; t += 2)
            _mm512_storeu_si512(out + (blk * B + NL * t) / 2,
                                (__m512i)_mm512_cvtne2ps_pbh((__m512)v[t + 1], (__m512)v[t]));
    }
}

#define PAIRS_FMT(F)                                                                       \
    case F: dq_pairs(F, row, c0, len, out); return 1;

/* dq_pairs for the block formats (1 when taken); the one-weight formats return 0. */
static int dequant_pairs(int32_t fmt, const uint8_t *row, int64_t c0, int64_t len,
                         uint32_t *out) {
    switch (fmt) {
        PAIRS_FMT(QF_Q4_0) PAIRS_FMT(QF_Q4_1) PAIRS_FMT(QF_Q5_0) PAIRS_FMT(QF_Q5_1)
        PAIRS_FMT(QF_Q8_0) PAIRS_FMT(QF_Q2_K) PAIRS_FMT(QF_Q3_K) PAIRS_FMT(QF_Q4_K)
        PAIRS_FMT(QF_Q5_K) PAIRS_FMT(QF_Q6_K)
    default: return 0;
    }
}
#undef PAIRS_FMT

/* MR rows of x (bfloat16, ldx apart) by NP pair panels (pstride pairs apart) over k2
 * pairs, added into (or, for the first chunk, stored to) y's columns [0, cols). */
INL void bf_tile(int MR, int NP, const uint16_t *x, int64_t ldx, const uint32_t *b,
                 int64_t pstride, int64_t k2, float *y, int64_t ldy, int64_t cols,
                 int accumulate) {
    __m512 acc[BF_ROWS][BF_PANELS];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NP; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k2; i++) {
        __m512bh w[BF_PANELS];
        for (int j = 0; j < NP; j++)
            w[j] = (__m512bh)_mm512_loadu_si512(b + j * pstride + 16 * i);
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * i, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NP; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
        }
    }
    for (int j = 0; j < NP; j++) {
        const int64_t c = 16 * j;
        if (c >= cols)
            break;
        const __mmask16 mk = cols - c >= 16 ? (__mmask16)0xffff
                                            : (__mmask16)((1u << (cols - c)) - 1);
        for (int r = 0; r < MR; r++) {
            __m512 v = acc[r][j];
            if (accumulate)
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, y + r * ldy + c));
            _mm512_mask_storeu_ps(y + r * ldy + c, mk, v);
        }
    }
}

#define BF_ROW_CASES(NP)                                                                   \
    switch (mr) {                                                                          \
    case 6: bf_tile(6, NP, ARGS); break;                                                   \
    case 5: bf_tile(5, NP, ARGS); break;                                                   \
    case 4: bf_tile(4, NP, ARGS); break;                                                   \
    case 3: bf_tile(3, NP, ARGS); break;                                                   \
    case 2: bf_tile(2, NP, ARGS); break;                                                   \
    default: bf_tile(1, NP, ARGS); break;                                                  \
    }

/* Rows [0, m) of x (ldx apart) by np pair panels over k2 pairs into y's columns
 * [0, cols), BF_ROWS rows by up to BF_PANELS panels at a time (bf_tile). */
static void bf_rows(const uint16_t *x, int64_t ldx, int64_t m, const uint32_t *b,
                    int64_t pstride, int64_t np, int64_t k2, float *y, int64_t ldy,
                    int64_t cols, int accumulate) {
    for (; np > BF_PANELS; np -= BF_PANELS, cols -= 16 * BF_PANELS) {
        bf_rows(x, ldx, m, b, pstride, BF_PANELS, k2, y, ldy, cols, accumulate);
        b += BF_PANELS * pstride;
        y += 16 * BF_PANELS;
    }
    for (int64_t r0 = 0; r0 < m; r0 += BF_ROWS) {
        const int64_t mr = m - r0 < BF_ROWS ? m - r0 : BF_ROWS;
#define ARGS x + r0 * ldx, ldx, b, pstride, k2, y + r0 * ldy, ldy, cols, accumulate
        if (np == 4) {
            BF_ROW_CASES(4)
        } else if (np == 3) {
            BF_ROW_CASES(3)
        } else if (np == 2) {
            BF_ROW_CASES(2)
        } else {
            BF_ROW_CASES(1)
        }
#undef ARGS
    }
}
#undef BF_ROW_CASES

/* Weights [c0, c0 + len) of the 16 weight rows from j0 as one pair panel's K2 rows at
 * out ([len / 2][16] words, zero past n): each row dequantised and rounded to pairs into
 * rows ([16][KC] words), then transposed; row is a float row's scratch [KC]. */
static void bf_fill_panel(int32_t fmt, const uint8_t *w, int64_t ws, const float *rs,
                          int64_t n, int64_t j0, int64_t c0, int64_t len, float *row,
                          uint32_t *rows, uint32_t *out) {
    for (int64_t r = 0; r < 16; r++) {
        const int64_t j = j0 + r;
        if (j < n && blk_vals(fmt) >= 32) {
            dequant_pairs(fmt, w + j * ws, c0, len, rows + r * KC);
        } else if (j < n) {
            dequant_span(fmt, w + j * ws, rs ? rs[j] : 0.0f, c0, len, row);
            round_to_pairs(row, len, rows + r * KC);
        } else {
            memset(rows + r * KC, 0, sizeof(uint32_t) * (len / 2));
        }
    }
    /* pairs are 32-bit words: the float transpose moves them whole */
    transpose16((const float *)rows, len / 2, (float *)out);
}

/* The bfloat16 panel path for the calling thread's share of panels: as panel_share, with
 * each K chunk's dequantised weights rounded to bfloat16 pairs; 0, or 3 without memory. */
static int bf16_panel_share(int32_t fmt, const uint16_t *x, int64_t m, int64_t k,
                            const uint8_t *w, int64_t ws, int64_t n, const float *rs,
                            const float *bias, float *y, int64_t ldy, int64_t p_begin,
                            int64_t p_end) {
    if (p_begin >= p_end)
        return 0;
    /* one row's floats [KC], 16 rows of pairs [16][KC] (KC / 2 used, so that transpose16
     * reads them as floats KC apart), then BF_PANELS pair panels [KC / 2][16] */
    float *row = quire_thread_scratch((size_t)17 * KC + (size_t)BF_PANELS * 8 * KC);
    if (row == NULL)
        return 3;
    uint32_t *rows = (uint32_t *)(row + KC), *pairs = rows + 16 * KC;
    int64_t np;
    for (int64_t p = p_begin; p < p_end; p += np) {
        np = p_end - p < BF_PANELS ? p_end - p : BF_PANELS;
        const int64_t j0 = 16 * p, cols = n - j0 < 16 * np ? n - j0 : 16 * np;
        for (int64_t c0 = 0; c0 < k; c0 += KC) {
            const int64_t len = k - c0 < KC ? k - c0 : KC, pstride = 8 * len;
            for (int64_t q = 0; q < np; q++)
                bf_fill_panel(fmt, w, ws, rs, n, j0 + 16 * q, c0, len, row, rows,
                              pairs + q * pstride);
            bf_rows(x + c0, k, m, pairs, pstride, np, len / 2, y + j0, ldy, cols, c0 > 0);
        }
        if (bias)
            for (int64_t i = 0; i < m; i++)
                for (int64_t c = 0; c < cols; c++) y[i * ldy + j0 + c] += bias[j0 + c];
    }
    return 0;
}

/* Panels a group takes on AMX tiles. Each group reads all m rows of x once, so for rows
 * too many to stay in L2 beside the group (m k bfloat16 above AMX_X_IN_L2 bytes: a
 * prompt step's) the groups are as wide as AMX_GROUP_BYTES of whole-K pairs allow, at
 * most AMX_GROUP_MAX panels, so x streams from L3 fewer times; else 8 panels (128
 * columns) while K is short enough that their whole-K pairs stay below 512 KB, and 4
 * past that (figures in docs/bench.md). */
#define AMX_X_IN_L2 (512 << 10)
#define AMX_GROUP_BYTES (1 << 20)
#define AMX_GROUP_MAX 32
static int64_t amx_group(int64_t k, int64_t m) {
    const int64_t narrow = k <= 2048 ? 8 : 4;
    if (m * k * 2 <= AMX_X_IN_L2)
        return narrow;
    const int64_t wide = AMX_GROUP_BYTES / (32 * k); /* a panel's whole-K pairs: 32 k bytes */
    return wide > AMX_GROUP_MAX ? AMX_GROUP_MAX : wide > narrow ? wide : narrow;
}

/* The same on AMX tiles (amx_tiles.c): a group's panels are dequantised over the whole
 * of K first, then each 32 rows of x run every K block on tiles, the sums kept in the
 * tiles (no float sums written back between K chunks) and stored once: straight into y
 * where the rows, K and the columns are whole tiles and there is no bias, else into a
 * [32][16 G] buffer copied to y with the bias; rows past the last whole 16 as one more
 * tile, padded with zero rows; what is left of K past whole 32-value blocks with
 * bf_tile. */
static int bf16_amx_share(int32_t fmt, const uint16_t *x, int64_t m, int64_t k,
                          const uint8_t *w, int64_t ws, int64_t n, const float *rs,
                          const float *bias, float *y, int64_t ldy, int64_t p_begin,
                          int64_t p_end) {
    if (p_begin >= p_end)
        return 0;
    const int64_t G = amx_group(k, m), pstride = 8 * k, ldc = 16 * G, kt = k / 32;
    /* rows past the last whole 16: padded with zeros to a tile of their own, since one
     * AMX tile of 16 rows takes less time than vdpbf16ps takes for 8 (bf_rows) */
    const int64_t t0 = m & ~(int64_t)15, tail = kt > 0 ? m - t0 : 0;
    /* one row's floats [KC], 16 rows of pairs [16][KC], G whole-K pair panels, the sums,
     * the padded tail rows [16][k] */
    float *row = quire_thread_scratch((size_t)17 * KC + (size_t)G * pstride + 32 * ldc +
                                      (tail ? 8 * (size_t)k : 0));
    if (row == NULL)
        return 3;
    uint32_t *rows = (uint32_t *)(row + KC), *pairs = rows + 16 * KC;
    float *acc = (float *)(pairs + G * pstride);
    uint16_t *padded = (uint16_t *)(acc + 32 * ldc);
    if (tail) {
        memcpy(padded, x + t0 * k, sizeof(uint16_t) * (size_t)(tail * k));
        memset(padded + tail * k, 0, sizeof(uint16_t) * (size_t)((16 - tail) * k));
    }
    quire_amx_begin();
    int64_t np;
    for (int64_t p = p_begin; p < p_end; p += np) {
        np = p_end - p < G ? p_end - p : G;
        const int64_t j0 = 16 * p, cols = n - j0 < 16 * np ? n - j0 : 16 * np;
        for (int64_t c0 = 0; c0 < k; c0 += KC)
            for (int64_t q = 0; q < np; q++)
                bf_fill_panel(fmt, w, ws, rs, n, j0 + 16 * q, c0, k - c0 < KC ? k - c0 : KC,
                              row, rows, pairs + q * pstride + 8 * c0);
        for (int64_t r0 = 0; r0 < m; r0 += 32) {
            const int64_t mr = m - r0 < 32 ? m - r0 : 32, m16 = mr & ~(int64_t)15;
            const uint16_t *xr = x + r0 * k;
            if (bias == NULL && m16 == mr && 32 * kt == k && cols == 16 * np) {
                /* whole tiles, no bias: the tiles are stored straight into y */
                quire_amx_pairs(xr, k, m16, pairs, pstride, np, kt, y + r0 * ldy + j0, ldy, 0);
                continue;
            }
            if (m16 > 0 && kt > 0)
                quire_amx_pairs(xr, k, m16, pairs, pstride, np, kt, acc, ldc, 0);
            if (m16 > 0 && k > 32 * kt)
                bf_rows(xr + 32 * kt, k, m16, pairs + 256 * kt, pstride, np, k / 2 - 16 * kt,
                        acc, ldc, ldc, kt > 0);
            if (mr > m16 && tail) { /* the last rows, as a padded tile */
                quire_amx_pairs(padded, k, 16, pairs, pstride, np, kt, acc + m16 * ldc, ldc,
                                0);
                if (k > 32 * kt)
                    bf_rows(xr + m16 * k + 32 * kt, k, mr - m16, pairs + 256 * kt, pstride,
                            np, k / 2 - 16 * kt, acc + m16 * ldc, ldc, ldc, 1);
            } else if (mr > m16) {
                bf_rows(xr + m16 * k, k, mr - m16, pairs, pstride, np, k / 2, acc + m16 * ldc,
                        ldc, ldc, 0);
            }
            for (int64_t i = 0; i < mr; i++)
                for (int64_t c = 0; c < cols; c++)
                    y[(r0 + i) * ldy + j0 + c] = acc[i * ldc + c] + (bias ? bias[j0 + c] : 0);
        }
    }
    quire_amx_end();
    return 0;
}

int quire_quant_gemm_bf16_available(void) { return 1; }

/* The calling thread's buffer for float32 rows rounded to bfloat16 (shared with its
 * team for one call of quire_quant_gemm_bf16_f32; quire_thread_scratch is the team
 * members' own). */
static __thread void *rounded_rows; /* uint16_t (bfloat16) rows */
static __thread size_t rounded_bytes;

/* Every entry's body, for a team already running: the parts' outputs side by side in y
 * (part p's bias at bias + its first output), their 16-column panels shared out over the
 * team as one run, so a layer's parts (q, k, v) take one parallel region. x holds
 * bfloat16 rows, or with xf float32 ones, which the team first rounds into x (nearest
 * even, as torch rounds), each thread some rows. Every thread of the team calls it with
 * the same arguments; it returns the thread's own failure (3: no scratch) and ends in a
 * barrier, so y is whole on return. */
int quire_quant_gemm_bf16_team(int64_t nparts, const struct quire_qpart *parts, uint16_t *x,
                               const float *xf, int64_t m, int64_t k, const float *bias,
                               float *y, int64_t ldy) {
    int64_t num_panels = 0;
    for (int64_t p = 0; p < nparts; p++)
        num_panels += (parts[p].rows + 15) / 16;
    const int amx = quire_amx_ready();
    int failed = 0;
    if (xf != NULL) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            round_to_pairs(xf + r * k, k, (uint32_t *)(x + r * k));
    }
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t g0 = num_panels * t / team, g1 = num_panels * (t + 1) / team;
    /* this thread's panels [g0, g1) of the run, part by part */
    for (int64_t p = 0, first = 0, col = 0; p < nparts && first < g1;
         col += parts[p].rows, first += (parts[p].rows + 15) / 16, p++) {
        const struct quire_qpart *q = &parts[p];
        const int64_t count = (q->rows + 15) / 16;
        const int64_t p0 = g0 > first ? g0 - first : 0;
        const int64_t p1 = g1 - first < count ? g1 - first : count;
        if (p0 >= p1)
            continue;
        const float *b = bias ? bias + col : NULL;
        failed |= amx ? bf16_amx_share(q->fmt, x, m, k, q->w, q->w_stride, q->rows, q->scales,
                                       b, y + col, ldy, p0, p1)
                      : bf16_panel_share(q->fmt, x, m, k, q->w, q->w_stride, q->rows,
                                         q->scales, b, y + col, ldy, p0, p1);
    }
#pragma omp barrier
    return failed;
}

/* quire_quant_gemm_bf16_team in a parallel region of its own. */
static int bf16_gemm(int64_t nparts, const struct quire_qpart *parts, uint16_t *x,
                     const float *xf, int64_t m, int64_t k, const float *bias, float *y,
                     int64_t ldy) {
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    failed |= quire_quant_gemm_bf16_team(nparts, parts, x, xf, m, k, bias, y, ldy);
    return failed ? 3 : 0;
}

static int bf16_gemm_fits(int32_t fmt, int64_t k) {
    if (blk_vals(fmt) == 0)
        return 1;
    if (k % true_block(fmt) || k < 0)
        return 2;
    if (k & 1)
        return 4; /* pairs need an even K (every block format has one) */
    return 0;
}

int quire_quant_bf16_fits(int32_t fmt, int64_t k) { return bf16_gemm_fits(fmt, k) == 0; }

int quire_quant_gemm_bf16(int32_t fmt, const uint16_t *x, int64_t m, int64_t k,
                          const uint8_t *w, int64_t w_stride, int64_t n,
                          const float *row_scales, const float *bias, float *y, int64_t ldy) {
    const int bad = bf16_gemm_fits(fmt, k);
    if (bad || m <= 0 || n <= 0)
        return bad;
    const struct quire_qpart part = {fmt, n, w, w_stride, row_scales, 0};
    return bf16_gemm(1, &part, (uint16_t *)x, NULL, m, k, bias, y, ldy);
}

/* Float32 rows for bf16_gemm: the calling thread's buffer grown to m * k (0, or 3 when
 * memory is short). */
static int rounded_room(int64_t m, int64_t k) {
    const size_t bytes = (size_t)m * (size_t)k * sizeof(uint16_t);
    return quire_grown(&rounded_rows, &rounded_bytes, bytes) == NULL ? 3 : 0;
}

/* The same product for float32 rows x, rounded to bfloat16 inside the call: one parallel
 * region where rounding them first (torch's .to) took a second one a call. */
int quire_quant_gemm_bf16_f32(int32_t fmt, const float *x, int64_t m, int64_t k,
                              const uint8_t *w, int64_t w_stride, int64_t n,
                              const float *row_scales, const float *bias, float *y,
                              int64_t ldy) {
    const int bad = bf16_gemm_fits(fmt, k);
    if (bad || m <= 0 || n <= 0)
        return bad;
    if (rounded_room(m, k))
        return 3;
    const struct quire_qpart part = {fmt, n, w, w_stride, row_scales, 0};
    return bf16_gemm(1, &part, rounded_rows, x, m, k, bias, y, ldy);
}

/* A layer's parts (all k wide) in one call: x float32 (x_f32, rounded in the call) or
 * bfloat16 rows, y [m, sum of rows] (ldy apart), no bias (the layer adds its own after
 * rounding the result to the rows' dtype, as it does part by part). Returns as
 * quire_quant_gemm_bf16, for the first part that does not fit. */
int quire_quant_gemm_bf16_parts(int64_t nparts, const struct quire_qpart *parts,
                                const void *x, int32_t x_f32, int64_t m, int64_t k, float *y,
                                int64_t ldy) {
    for (int64_t p = 0; p < nparts; p++) {
        const int bad = bf16_gemm_fits(parts[p].fmt, k);
        if (bad)
            return bad;
    }
    if (m <= 0 || nparts <= 0)
        return 0;
    if (!x_f32)
        return bf16_gemm(nparts, parts, (uint16_t *)x, NULL, m, k, NULL, y, ldy);
    if (rounded_room(m, k))
        return 3;
    return bf16_gemm(nparts, parts, rounded_rows, x, m, k, NULL, y, ldy);
}

#else

int quire_quant_gemm_bf16_available(void) { return 0; }

int quire_quant_bf16_fits(int32_t fmt, int64_t k) {
    (void)fmt, (void)k;
    return 0;
}

int quire_quant_gemm_bf16_team(int64_t nparts, const struct quire_qpart *parts, uint16_t *x,
                               const float *xf, int64_t m, int64_t k, const float *bias,
                               float *y, int64_t ldy) {
    (void)nparts, (void)parts, (void)x, (void)xf, (void)m, (void)k, (void)bias, (void)y;
    (void)ldy;
    return 4;
}

/* Levels without AVX512_BF16: never taken (the caller checks availability first). */
int quire_quant_gemm_bf16(int32_t fmt, const uint16_t *x, int64_t m, int64_t k,
                          const uint8_t *w, int64_t w_stride, int64_t n,
                          const float *row_scales, const float *bias, float *y, int64_t ldy) {
    (void)fmt, (void)x, (void)m, (void)k, (void)w, (void)w_stride, (void)n;
    (void)row_scales, (void)bias, (void)y, (void)ldy;
    return 4;
}

int quire_quant_gemm_bf16_f32(int32_t fmt, const float *x, int64_t m, int64_t k,
                              const uint8_t *w, int64_t w_stride, int64_t n,
                              const float *row_scales, const float *bias, float *y,
                              int64_t ldy) {
    (void)fmt, (void)x, (void)m, (void)k, (void)w, (void)w_stride, (void)n;
    (void)row_scales, (void)bias, (void)y, (void)ldy;
    return 4;
}

int quire_quant_gemm_bf16_parts(int64_t nparts, const struct quire_qpart *parts,
                                const void *x, int32_t x_f32, int64_t m, int64_t k, float *y,
                                int64_t ldy) {
    (void)nparts, (void)parts, (void)x, (void)x_f32, (void)m, (void)k, (void)y, (void)ldy;
    return 4;
}
#endif

/* ---- int8 activations ---- */

/* Row r of x [m, k] as int8 (kp bytes, zero past k), its scale and the sum of its values. */
static void quantize_row(const float *x, int64_t k, int64_t kp, int8_t *q, float *scale,
                         int32_t *sum) {
    float amax = 0.0f;
    int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the same IEEE operations 16 at a time: max |x|, x / s rounded half to even */
    __m512 mx = _mm512_setzero_ps();
    for (; c + 16 <= k; c += 16) mx = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + c)), mx);
    amax = _mm512_reduce_max_ps(mx);
#endif
    for (; c < k; c++) {
        const float a = fabsf(x[c]);
        amax = a > amax ? a : amax;
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    int32_t total = 0;
    c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 sv = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    __m512i tv = _mm512_setzero_si512();
    for (; c + 16 <= k; c += 16) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + c), sv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i iv = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(r, hi), lo));
        _mm_storeu_si128((__m128i *)(q + c), _mm512_cvtepi32_epi8(iv));
        tv = _mm512_add_epi32(tv, iv);
    }
    total = _mm512_reduce_add_epi32(tv);
#endif
    for (; c < k; c++) {
        float t = nearbyintf(x[c] / s);
        t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
        q[c] = (int8_t)t;
        total += q[c];
    }
    memset(q + k, 0, (size_t)(kp - k));
    *scale = s;
    *sum = total;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define I8_STEP 64
typedef __m512i iv;
INL iv ld_iv(const void *p) { return _mm512_loadu_si512(p); }
INL int32_t iv_sum(iv a) { return _mm512_reduce_add_epi32(a); }
#if defined(__AVX512VNNI__)
#define I8_OFFSET 1 /* sums carry 128 * sum(x): subtracted at the end */
INL iv w_prep(iv w) { return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)); }
INL iv i8_dot(iv acc, iv wp, iv xv) { return _mm512_dpbusd_epi32(acc, wp, xv); }
#else
#define I8_OFFSET 0
INL iv w_prep(iv w) { return w; }
INL iv i8_dot(iv acc, iv w, iv xv) {
    const iv xs = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(w), _mm512_setzero_si512(), xv);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), xs),
                                                   _mm512_set1_epi16(1)));
}
#endif
#elif defined(__AVX2__)
#define I8_STEP 32
#define I8_OFFSET 0
typedef __m256i iv;
INL iv ld_iv(const void *p) { return _mm256_loadu_si256(p); }
INL int32_t iv_sum(iv a) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}
INL iv w_prep(iv w) { return w; }
INL iv i8_dot(iv acc, iv w, iv xv) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(
                                     _mm256_maddubs_epi16(_mm256_abs_epi8(w),
                                                          _mm256_sign_epi8(xv, w)),
                                     _mm256_set1_epi16(1)));
}
#endif

#if defined(I8_STEP)
#define I8_MR 4
#define I8_NR 4
/* out[r][q] = sum_c qx[r][c] * w_q[c] for MR activation rows (kp bytes apart, zero past
 * k) and NR weight rows; the last partial step reads the weights from a zeroed copy. */
INL void i8_tile(int MR, int NR, const int8_t *qx, int64_t kp, const uint8_t *const *wr,
                 int64_t k, int32_t out[I8_MR][I8_NR]) {
    iv acc[I8_MR][I8_NR];
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < NR; q++) acc[r][q] = (iv){0};
    int64_t c = 0;
    for (; c + I8_STEP <= k; c += I8_STEP) {
        iv wv[I8_NR];
        for (int q = 0; q < NR; q++) wv[q] = w_prep(ld_iv(wr[q] + c));
        for (int r = 0; r < MR; r++) {
            const iv xv = ld_iv(qx + r * kp + c);
            for (int q = 0; q < NR; q++) acc[r][q] = i8_dot(acc[r][q], wv[q], xv);
        }
    }
    if (c < k) {
        iv wv[I8_NR];
        for (int q = 0; q < NR; q++) {
            uint8_t buf[I8_STEP] = {0};
            memcpy(buf, wr[q] + c, (size_t)(k - c));
            wv[q] = w_prep(ld_iv(buf));
        }
        for (int r = 0; r < MR; r++) {
            const iv xv = ld_iv(qx + r * kp + c);
            for (int q = 0; q < NR; q++) acc[r][q] = i8_dot(acc[r][q], wv[q], xv);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int q = 0; q < NR; q++) out[r][q] = iv_sum(acc[r][q]);
}

#define I8_NR_CASES(MR)                                                                    \
    switch (nr) {                                                                          \
    case 4: i8_tile(MR, 4, qx, kp, wr, k, out); break;                                     \
    case 3: i8_tile(MR, 3, qx, kp, wr, k, out); break;                                     \
    case 2: i8_tile(MR, 2, qx, kp, wr, k, out); break;                                     \
    default: i8_tile(MR, 1, qx, kp, wr, k, out); break;                                    \
    }

static void i8_block(int mr, int nr, const int8_t *qx, int64_t kp, const uint8_t *const *wr,
                     int64_t k, int32_t out[I8_MR][I8_NR]) {
    switch (mr) {
    case 4: I8_NR_CASES(4) break;
    case 3: I8_NR_CASES(3) break;
    case 2: I8_NR_CASES(2) break;
    default: I8_NR_CASES(1) break;
    }
}
#else
#define I8_MR 4
#define I8_NR 4
#define I8_OFFSET 0
#define I8_STEP 1
static void i8_block(int mr, int nr, const int8_t *qx, int64_t kp, const uint8_t *const *wr,
                     int64_t k, int32_t out[I8_MR][I8_NR]) {
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < nr; q++) {
            int32_t acc = 0;
            for (int64_t c = 0; c < k; c++) acc += (int32_t)qx[r * kp + c] * (int8_t)wr[q][c];
            out[r][q] = acc;
        }
}
#endif

/* y[i][j] from row i's and weight row j's exact int32 sum, as the reference scales it. */
INL void i8_put(float *y, int64_t ldy, int64_t i, int64_t j, int32_t acc, const float *sx,
                const float *row_scales, const float *bias) {
    const float v = (float)((double)acc * (double)sx[i] * (double)row_scales[j]);
    y[i * ldy + j] = bias ? v + bias[j] : v;
}

/* Rows [r0, r1) of qx times weight rows [j0, j0 + I8_NR) (fewer at n) into y. */
static void i8_group(const int8_t *qx, int64_t kp, int64_t r0, int64_t r1, const uint8_t *w,
                     int64_t w_stride, int64_t k, int64_t j0, int64_t n, const float *sx,
                     const int32_t *sumx, const float *row_scales, const float *bias,
                     float *y, int64_t ldy) {
    const int nr = n - j0 < I8_NR ? (int)(n - j0) : I8_NR;
    const uint8_t *wr[I8_NR];
    for (int q = 0; q < I8_NR; q++) wr[q] = w + (j0 + (q < nr ? q : 0)) * w_stride;
    for (int64_t i0 = r0; i0 < r1; i0 += I8_MR) {
        const int mr = r1 - i0 < I8_MR ? (int)(r1 - i0) : I8_MR;
        int32_t out[I8_MR][I8_NR];
        i8_block(mr, nr, qx + i0 * kp, kp, wr, k, out);
        for (int r = 0; r < mr; r++)
            for (int q = 0; q < nr; q++)
                i8_put(y, ldy, i0 + r, j0 + q, out[r][q] - (I8_OFFSET ? 128 * sumx[i0 + r] : 0),
                       sx, row_scales, bias);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define I8_AMX 1
/* w8a8 per row on AMX-INT8 tiles (the amx level, once Linux grants the tile state):
 * every product of a row's int8 values with a weight row is an int32 sum over the whole
 * of k, so whole 16 rows times 16 weight rows are one C tile that TDPBSSD (signed by
 * signed bytes) adds 64 values of k into at a time, with nothing to scale in between:
 * the sums are exact and scaled at the end as below, so the results are the other
 * levels' bit for bit. The weight's rows are laid out a pair of 16-row panels at a time
 * in AMX's B-tile layout (for each 64 bytes of k, 16 rows of 64 bytes: row t holds bytes
 * 4t .. 4t + 3 of each of the 16 weight rows; zero past k and past n), in each thread's
 * scratch; 32 rows of x by two panels use all 8 tiles (C 0-3, A 4-5, B 6-7, as
 * amx_tiles.c's configuration has them). Rows short of 16 go to i8_block. */

/* Each thread's two panels, kept between calls (quire_grown). */
static __thread void *i8_panels;
static __thread size_t i8_panel_bytes;

/* r[i] (16 dwords each) transposed in registers: afterwards lane i of r[t] is dword t
 * of the input r[i]. */
INL void i8_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane now holds a 4 x 4 block transposed: move the blocks */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Weight rows [j0, j0 + nr) (nr <= 32) into two panels of kp / 64 blocks of 1024 bytes. */
static void i8_amx_pack(const uint8_t *w, int64_t w_stride, int64_t k, int64_t kp, int64_t j0,
                        int nr, uint8_t *panels) {
    const int64_t blocks = kp / 64;
    for (int half = 0; half < 2; half++) {
        uint8_t *panel = panels + half * blocks * 1024;
        for (int64_t b = 0; b < blocks; b++) {
            __m512i col[16];
            for (int q = 0; q < 16; q++) {
                const int j = 16 * half + q;
                const int64_t c0 = 64 * b, left = k - c0;
                const __mmask64 keep = left >= 64 ? ~(__mmask64)0
                                       : ((__mmask64)1 << left) - 1;
                col[q] = j < nr ? _mm512_maskz_loadu_epi8(keep, w + (j0 + j) * w_stride + c0)
                                : _mm512_setzero_si512();
            }
            /* dword t of column q to lane q of row t: a 16 x 16 dword transpose */
            i8_transpose16(col);
            for (int t = 0; t < 16; t++) _mm512_store_si512(panel + b * 1024 + 64 * t, col[t]);
        }
    }
}

/* Rows [i0, i0 + 16 * R2) (R2 = 1 or 2) of qx times the two panels: y's columns
 * [j0, j0 + nr). */
static void i8_amx_rows(int R2, const int8_t *qx, int64_t kp, const uint8_t *panels,
                        int64_t i0, int64_t j0, int nr, const float *sx,
                        const float *row_scales, const float *bias, float *y, int64_t ldy) {
    const int64_t blocks = kp / 64;
    const uint8_t *p0 = panels, *p1 = panels + blocks * 1024;
    const int8_t *a = qx + i0 * kp;
    _tile_zero(0);
    _tile_zero(1);
    if (R2 == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t b = 0; b < blocks; b++) {
        _tile_loadd(4, a + 64 * b, kp);
        _tile_loadd(6, p0 + 1024 * b, 64);
        _tile_loadd(7, p1 + 1024 * b, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        if (R2 == 2) {
            _tile_loadd(5, a + 16 * kp + 64 * b, kp);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        }
    }
    int32_t acc[32][32] __attribute__((aligned(64)));
    _tile_stored(0, &acc[0][0], 128);
    _tile_stored(1, &acc[0][16], 128);
    if (R2 == 2) {
        _tile_stored(2, &acc[16][0], 128);
        _tile_stored(3, &acc[16][16], 128);
    }
    for (int r = 0; r < 16 * R2; r++)
        for (int q = 0; q < nr; q++) i8_put(y, ldy, i0 + r, j0 + q, acc[r][q], sx, row_scales, bias);
}
#else
#define I8_AMX 0
#endif

int quire_quant_gemm_i8(const float *x, int64_t m, int64_t k, const uint8_t *w,
                        int64_t w_stride, int64_t n, const float *row_scales,
                        const float *bias, float *y, int64_t ldy) {
    if (k < 0 || k > I8_MAX_K)
        return 2;
    if (m <= 0 || n <= 0)
        return 0;
    const int64_t kp = (k + 63) / 64 * 64;
    /* qx [m][kp], then the scales and sums */
    const size_t floats = ((size_t)m * kp + 3) / 4 + 2 * (size_t)m;
    float *scratch = quire_thread_scratch(floats);
    if (scratch == NULL)
        return 3;
    int8_t *qx = (int8_t *)scratch;
    float *sx = scratch + ((size_t)m * kp + 3) / 4;
    int32_t *sumx = (int32_t *)(sx + m);
    const int64_t groups = (n + I8_NR - 1) / I8_NR;
#if I8_AMX
    const int amx = m >= 16 && quire_amx_ready();
#endif
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) quantize_row(x + i * k, k, kp, qx + i * kp, sx + i,
                                                   sumx + i);
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
#if I8_AMX
        if (amx) {
            /* pairs of 16-row panels of the weight shared out; whole 16 rows of x on the
             * tiles, the rest (m mod 16) on i8_block */
            const int64_t pairs = (n + 31) / 32, m16 = m / 16 * 16;
            uint8_t *panels = NULL;
            if (pairs * t / team < pairs * (t + 1) / team) {
                panels = quire_grown(&i8_panels, &i8_panel_bytes, (size_t)kp * 32);
                if (panels == NULL) {
#pragma omp atomic write
                    failed = 1;
                }
            }
            if (panels != NULL)
                quire_amx_begin();
            for (int64_t g = pairs * t / team; g < pairs * (t + 1) / team && panels; g++) {
                const int64_t j0 = 32 * g;
                const int nr = n - j0 < 32 ? (int)(n - j0) : 32;
                i8_amx_pack(w, w_stride, k, kp, j0, nr, panels);
                int64_t i0 = 0;
                for (; i0 + 32 <= m16; i0 += 32)
                    i8_amx_rows(2, qx, kp, panels, i0, j0, nr, sx, row_scales, bias, y, ldy);
                if (i0 < m16)
                    i8_amx_rows(1, qx, kp, panels, i0, j0, nr, sx, row_scales, bias, y, ldy);
                for (int64_t c0 = j0; c0 < j0 + nr && m16 < m; c0 += I8_NR)
                    i8_group(qx, kp, m16, m, w, w_stride, k, c0, n, sx, sumx, row_scales, bias,
                             y, ldy);
            }
            if (panels != NULL)
                quire_amx_end();
        } else
#endif
        {
            for (int64_t g = groups * t / team; g < groups * (t + 1) / team; g++)
                i8_group(qx, kp, 0, m, w, w_stride, k, g * I8_NR, n, sx, sumx, row_scales,
                         bias, y, ldy);
        }
    }
    return failed ? 3 : 0;
}
