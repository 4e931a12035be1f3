/*
 * Paged decode attention for the cpu platform: one query token per sequence, float32,
 * bfloat16, int8 or fp8 pages (the quantised ones with a scale per token and KV head:
 * quire/ops/kv_quant.py), float32 arithmetic.
 *
 * Reads each sequence's keys and values straight from their pages, once, instead of
 * gathering them into a padded copy first (what the torch path has to do). Work is
 * split over sequences with OpenMP (over (sequence, KV head) pairs when there are too
 * few sequences for the team); attend_heads.h is the body, per KV head and its group
 * of query heads (figures in docs/bench.md).
 *
 * Layout (see quire/platforms/cpu/attention.py): the cache of one layer is
 * [2, num_blocks, block_size, Hkv, D]; k_cache and v_cache point at its two halves.
 * Query and output are [B, Hq, D], contiguous. Query head h reads KV head h / G.
 *
 * Arithmetic: scores, softmax and the weighted sum in float32, as the reference; only
 * the order of the sums differs (dot products in vector partial sums, fused
 * multiply-adds where the ISA level has them), so results agree with it to float32
 * rounding.
 *
 * Built at run time by quire/platforms/cpu/native.py with the system C compiler;
 * OpenMP resolves to the libgomp torch has already loaded (same soname), so this
 * shares torch's thread pool and thread count.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"


/* Positions in tiles of ATTEND_TILE: a tile's K (then V) slices stay in L1 while every
 * query head of a KV head's group reads them. */
#define ATTEND_TILE 32

/* Where a walk over a sequence's slots stands: its block table, the index of the block
 * it is in and the slot within it (no division per position). */
struct slot_cursor {
    const int64_t *table;
    int64_t block, offset, block_size;
};

static inline struct slot_cursor slot_cursor_at(const int64_t *table, int64_t pos,
                                                int64_t block_size) {
    return (struct slot_cursor){table, pos / block_size, pos % block_size, block_size};
}

/* The element offsets (slot * row) of the next min(ATTEND_TILE, left) positions into
 * offs, the cursor moved past them; returns how many (0 when left <= 0). Reads no table
 * entry beyond the last position's. */
static inline int64_t tile_offsets(struct slot_cursor *c, int64_t left, int64_t row,
                                   int64_t *offs) {
    const int64_t m = left < ATTEND_TILE ? (left > 0 ? left : 0) : ATTEND_TILE;
    for (int64_t t = 0; t < m; ++t) {
        if (c->offset == c->block_size)
            c->block++, c->offset = 0;
        offs[t] = (c->table[c->block] * c->block_size + c->offset++) * row;
    }
    return m;
}

/* Prefetch `bytes` from base + offs[t] elements of `elem` bytes, for the m slots. */
static inline void prefetch_tile(const void *base, size_t elem, const int64_t *offs,
                                 int64_t m, int64_t bytes) {
    for (int64_t t = 0; t < m; ++t) {
        const char *p = (const char *)base + offs[t] * (int64_t)elem;
        for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c);
    }
}

/* Float32 pages. */
#define KV_T float
#define KV_LOADW loadw
#define KV_GET(p) (*(p))
#define KV_QUANT 0
#define ATTEND_NAME quire_attend_heads
#define ATTEND_(x) x##_f32
#include "attend_heads.h"

/* bfloat16 pages: half the bytes read per position, widened to float32 on load (a
 * bfloat16 is a float32's upper 16 bits, so the widening is exact). */
#define KV_T uint16_t
#define KV_LOADW loadw_bf16
#define KV_GET(p) bf16_to_f32(*(p))
#define KV_QUANT 0
#define ATTEND_NAME quire_attend_heads_bf16
#define ATTEND_(x) x##_bf16
#include "attend_heads.h"

/* int8 pages: a quarter of float32's bytes (plus a float16 scale per 16), widened exactly
 * and times their group's scale. */
#define KV_T int8_t
#define KV_QUANT QUIRE_KV_I8
#define ATTEND_NAME quire_attend_heads_i8
#define ATTEND_(x) x##_i8
#include "attend_heads.h"

/* fp8 (e4m3fn) pages, the same way. */
#define KV_T uint8_t
#define KV_QUANT QUIRE_KV_FP8
#define ATTEND_NAME quire_attend_heads_fp8
#define ATTEND_(x) x##_fp8
#include "attend_heads.h"

/* Every entry point: every sequence's query heads over its pages of kv_type, (sequence,
 * KV head) pairs over the team. Returns 0 on success, 1 when scratch memory could not be
 * allocated (the caller falls back to the torch path). */
static int paged_decode(int kv_type, const float *q, const void *k_cache, const void *v_cache,
                        const int64_t *block_tables, int64_t table_stride,
                        const int64_t *seq_lens, int64_t num_seqs, int64_t hq, int64_t hkv,
                        int64_t d, int64_t block_size, float scale, int64_t window,
                        float *out) {
    const int64_t groups = hq / hkv; /* query heads per KV head (GQA) */
    const int64_t row = kv_slot_elems(kv_type, hkv, d); /* elements between slots */
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n = (window > 0 && seq_lens[s] > window) ? window : seq_lens[s];
        longest = n > longest ? n : longest;
    }
    /* (sequence, KV head) pairs when there are too few sequences to share out alone (64
     * sequences measured the same either way) */
    const int64_t threads = omp_get_max_threads();
    const int64_t split = threads > 1 && num_seqs < 4 * threads ? hkv : 1, heads = hq / split;
    const int64_t per_item = heads * longest, items = num_seqs * split;
    float *scratch = quire_thread_scratch((size_t)(threads * per_item) + 1);
    if (scratch == NULL)
        return 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
        const int64_t s = i / split, h_begin = (i % split) * heads, h_end = h_begin + heads;
        const int64_t len = seq_lens[s];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        float *os = out + s * hq * d;
        if (len - start <= 0) {
            memset(os + h_begin * d, 0, sizeof(float) * (h_end - h_begin) * d);
            continue;
        }
        attend_heads_kv(kv_type, q + s * hq * d, k_cache, v_cache,
                        block_tables + s * table_stride, start, len - start, h_begin, h_end,
                        groups, row, d, block_size, scale,
                        scratch + omp_get_thread_num() * per_item, os);
    }
    return 0;
}

/* Float32 pages. */
int quire_paged_decode_f32(
    const float *q, const float *k_cache, const float *v_cache,
    const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
    int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
    float scale, int64_t window, float *out) {
    return paged_decode(QUIRE_KV_F32, q, k_cache, v_cache, block_tables, table_stride, seq_lens,
                        num_seqs, hq, hkv, d, block_size, scale, window, out);
}

/* bfloat16 pages (float32 query and output). */
int quire_paged_decode_bf16(
    const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
    int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
    float scale, int64_t window, float *out) {
    return paged_decode(QUIRE_KV_BF16, q, k_cache, v_cache, block_tables, table_stride, seq_lens,
                        num_seqs, hq, hkv, d, block_size, scale, window, out);
}

/* int8 or fp8 pages (kv_type QUIRE_KV_I8 or QUIRE_KV_FP8), [.., hkv, d + d / 8] bytes
 * per slot; float32 query and output. */
int quire_paged_decode_quant(
    int32_t kv_type, const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
    const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
    int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
    float scale, int64_t window, float *out) {
    if (!kv_quantized(kv_type) || kv_type > QUIRE_KV_FP8 || d % QUIRE_KV_GROUP)
        return 1;
    return paged_decode(kv_type, q, k_cache, v_cache, block_tables, table_stride, seq_lens,
                        num_seqs, hq, hkv, d, block_size, scale, window, out);
}

/* n tokens' keys and values (float32, hkv heads of d per row, rows k_stride and v_stride
 * floats apart) written to their slots of int8 or fp8 pages, quantised per group of 16
 * as quire.ops.kv_quant.write_kv does (bit for bit), tokens over the team. Returns 1 for
 * a kv_type that is not quantised or a d that is not a multiple of 16. */
int quire_write_kv_quant(int32_t kv_type, uint8_t *k_cache, uint8_t *v_cache,
                         const int64_t *slots, int64_t n, int64_t hkv, int64_t d,
                         const float *k, int64_t k_stride, const float *v, int64_t v_stride) {
    if (!kv_quantized(kv_type) || kv_type > QUIRE_KV_FP8 || d % QUIRE_KV_GROUP)
        return 1;
#pragma omp parallel for schedule(static) if (n * hkv * d > 16384)
    for (int64_t t = 0; t < n; ++t) {
        store_kv_row(k_cache, kv_type, slots[t], hkv, d, k + t * k_stride);
        store_kv_row(v_cache, kv_type, slots[t], hkv, d, v + t * v_stride);
    }
    return 0;
}
