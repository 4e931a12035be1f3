/*
 * Paged decode attention for the cpu platform: one query token per sequence, float32,
 * bfloat16, int8 or fp8 pages (the quantised ones with a scale per token and KV head:
 * quire/ops/kv_quant.py), float32 arithmetic.
 *
 * Reads each sequence's keys and values straight from their pages, once, instead of
 * gathering them into a padded copy first (what the torch path has to do). Work is
 * split over sequences with OpenMP, and where there are too few sequences for the team
 * over parts of their positions, combined after (attend_parts_team: a lone
 * sequence's long context); attend_heads.h is the body, per KV head and its group of
 * query heads (figures in docs/bench.md).
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

/* A walk over a sequence's slots as attend_heads.h reads them, its keys' tiles then its
 * values', one tile at a time (tiles_ahead_step), whose current tile is asked for into
 * L2 a share per query head (tiles_ahead_share), as the next tile's is into L1. */
struct tiles_ahead {
    struct slot_cursor cur;
    const int64_t *table;
    int64_t start, n, block_size, row, left, m;
    const void *v_span, *base; /* base: the keys' span, then the values' */
    int64_t offs[ATTEND_TILE];
};

static inline struct tiles_ahead tiles_ahead_at(const int64_t *table, int64_t start,
                                                int64_t n, int64_t block_size, int64_t row,
                                                const void *k_span, const void *v_span) {
    return (struct tiles_ahead){.cur = slot_cursor_at(table, start, block_size),
                                .table = table, .start = start, .n = n,
                                .block_size = block_size, .row = row, .left = n,
                                .v_span = v_span, .base = k_span};
}

/* The walk's next tile (none, m = 0, after the values' last). */
static inline void tiles_ahead_step(struct tiles_ahead *a) {
    if (a->left == 0 && a->base != a->v_span) {
        a->base = a->v_span, a->left = a->n;
        a->cur = slot_cursor_at(a->table, a->start, a->block_size);
    }
    a->m = tile_offsets(&a->cur, a->left, a->row, a->offs);
    a->left -= a->m;
}

/* Share i of `heads` of the current tile's slots, `bytes` from each, into L2. */
static inline void tiles_ahead_share(const struct tiles_ahead *a, size_t elem, int64_t i,
                                     int64_t heads, int64_t bytes) {
    for (int64_t t = i * a->m / heads; t < (i + 1) * a->m / heads; ++t) {
        const char *p = (const char *)a->base + a->offs[t] * (int64_t)elem;
        for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, 2);
    }
}

/* Float32 pages. */
#define KV_T float
#define KV_LOADW loadw
#define KV_GET(p) (*(p))
#define KV_QUANT 0
#define KV_BF16_DOT 0
#define ATTEND_NAME quire_attend_heads
#define ATTEND_(x) x##_f32
#include "attend_heads.h"

/* bfloat16 pages: half the bytes read per position, widened to float32 on load (a
 * bfloat16 is a float32's upper 16 bits, so the widening is exact). */
#define KV_T uint16_t
#define KV_LOADW loadw_bf16
#define KV_GET(p) bf16_to_f32(*(p))
#define KV_QUANT 0
#if defined(__AVX512BF16__) /* keys by vdpbf16ps (attend_heads.h's tile_scores_dot) */
#define KV_BF16_DOT 1
#else
#define KV_BF16_DOT 0
#endif
#define ATTEND_NAME quire_attend_heads_bf16
#define ATTEND_(x) x##_bf16
#include "attend_heads.h"

/* int8 pages: a quarter of float32's bytes (plus a float16 scale per 16), widened exactly
 * and times their group's scale. */
#define KV_T int8_t
#define KV_QUANT QUIRE_KV_I8
#define KV_BF16_DOT 0
#define ATTEND_NAME quire_attend_heads_i8
#define ATTEND_(x) x##_i8
#include "attend_heads.h"

/* fp8 (e4m3fn) pages, the same way. */
#define KV_T uint8_t
#define KV_QUANT QUIRE_KV_FP8
#define KV_BF16_DOT 0
#define ATTEND_NAME quire_attend_heads_fp8
#define ATTEND_(x) x##_fp8
#include "attend_heads.h"

/* Every entry point: every sequence's query heads over its pages of kv_type
 * (quire_attend_rows_team). Returns 0 on success, 1 when scratch memory could not be
 * allocated (the caller falls back to the torch path). */
static int paged_decode(int kv_type, const float *q, const void *k_cache, const void *v_cache,
                        const int64_t *block_tables, int64_t table_stride,
                        const int64_t *seq_lens, int64_t num_seqs, int64_t hq, int64_t hkv,
                        int64_t d, int64_t block_size, float scale, int64_t window,
                        float *out) {
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n = (window > 0 && seq_lens[s] > window) ? window : seq_lens[s];
        longest = n > longest ? n : longest;
    }
    const int64_t per_thread = hq * longest;
    float *scratch = quire_thread_scratch((size_t)(omp_get_max_threads() * per_thread) + 1);
    if (scratch == NULL)
        return 1;
#pragma omp parallel
    quire_attend_rows_team(kv_type, q, hq * d, k_cache, v_cache, block_tables, table_stride,
                           seq_lens, num_seqs, window, hq, hkv, d, block_size, scale,
                           scratch + omp_get_thread_num() * per_thread, out, hq * d);
    return 0;
}

/* Split attention (flash-decoding's): a lone sequence, or a few, has fewer items than
 * a team has threads to keep busy, and a long context is most of a step there. Cutting
 * each sequence's positions into parts of at least SPLIT_MIN gives the team several
 * items each. An item takes every head of its part: the pages hold a slot's KV heads
 * side by side, so a part reads whole slot rows, in order (an item per KV head read
 * a strided third of each, slower with cold pages), and each KV head's keys and
 * values once for all its query heads. Each part's outputs are left undivided with
 * each head's top score and softmax total, and a head's parts are then combined:
 * out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c, M the parts' largest top. A
 * sequence of one part writes its output directly. */
#define SPLIT_MIN 64

/* How many positions a part takes: enough parts for SPLIT_ITEMS items a thread, none
 * shorter than SPLIT_MIN (a part's fixed costs: its queries' setup, the combine). Two
 * items a thread beat four at every shape measured, and equalled one while leaving
 * slack for a thread that starts late; SPLIT_MIN from 32 to 128 measured the same
 * (docs/bench.md). */
#define SPLIT_ITEMS 2
static int64_t split_part(int64_t rows, const int64_t *lens, int64_t threads) {
    int64_t total = 0;
    for (int64_t r = 0; r < rows; r++) total += lens[r];
    const int64_t want = SPLIT_ITEMS * threads, part = (total + want - 1) / want;
    return part > SPLIT_MIN ? part : SPLIT_MIN;
}

/* A buffer for the parts' outputs and stats, the team's for a call: each thread keeps
 * its own, grown as needed, and the one that takes the call's `single` lends it. */
static __thread void *split_buffer;
static __thread size_t split_held;

/* Inside a parallel region: quire_attend_rows_team's rows, row r over positions
 * [starts[r], starts[r] + lens[r]) (a row of none gets zeros), each row whole or, where
 * `split` (the same on every thread), in parts over the team; scores: the calling
 * thread's own, hq * max(lens) floats (a part needs hq * its positions, a whole row
 * more). Rows are whole where the parts' buffer could not be had too. Ends in a
 * barrier. */
static void attend_parts_team(int kv_type, const float *q, int64_t q_stride,
                              const void *k_cache, const void *v_cache, const int64_t *tables,
                              int64_t table_stride, const int64_t *starts, const int64_t *lens,
                              int64_t rows, int split, int64_t hq, int64_t hkv, int64_t d,
                              int64_t block_size, float scale, float *scores, float *out,
                              int64_t out_stride) {
    const int64_t groups = hq / hkv, row = kv_slot_elems(kv_type, hkv, d);
    /* items: row r's parts from first[r], each with a slot in the buffer: its output
     * [hq, d] and 2 hq stats */
    int64_t first[split ? rows + 1 : 1], part = 0, items = rows;
    const int64_t per_item = hq * (d + 2);
    float *parts = NULL;
    if (split) {
        part = split_part(rows, lens, omp_get_num_threads());
        first[0] = 0;
        for (int64_t r = 0; r < rows; r++)
            first[r + 1] = first[r] + (lens[r] + part - 1) / part;
        items = first[rows];
#pragma omp single copyprivate(parts)
        parts = items > rows
                    ? quire_grown(&split_buffer, &split_held, sizeof(float) * items * per_item)
                    : NULL;
        split = parts != NULL;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < (split ? items : rows); i++) {
        int64_t r = i;
        if (split)
            for (r = 0; first[r + 1] <= i; r++) {
            }
        if (lens[r] < 1) { /* a whole row of none (a split one has no item) */
            memset(out + r * out_stride, 0, sizeof(float) * hq * d);
            continue;
        }
        const int64_t chunks = split ? first[r + 1] - first[r] : 1, c = split ? i - first[r] : 0;
        const int64_t start = starts[r] + c * part;
        const int64_t n = chunks == 1 ? lens[r]
                                      : (lens[r] - c * part < part ? lens[r] - c * part : part);
        const float *qr = q + r * q_stride;
        const int64_t *table = tables + r * table_stride;
        if (chunks == 1)
            attend_heads_kv(kv_type, qr, k_cache, v_cache, table, start, n, 0, hq, groups,
                            row, d, block_size, scale, scores, out + r * out_stride);
        else
            attend_heads_kv_part(kv_type, qr, k_cache, v_cache, table, start, n, 0, hq,
                                 groups, row, d, block_size, scale, scores,
                                 parts + i * per_item, parts + i * per_item + hq * d);
    }
    if (!split)
        return; /* the loop's barrier ends the call */
    /* every head of a row with several parts: its parts combined; a row of none: zeros */
#pragma omp for schedule(static)
    for (int64_t x = 0; x < rows * hq; x++) {
        const int64_t r = x / hq, h = x % hq, chunks = first[r + 1] - first[r];
        float *dst = out + r * out_stride + h * d;
        if (chunks == 0)
            memset(dst, 0, sizeof(float) * d);
        if (chunks <= 1)
            continue;
        const float *base = parts + first[r] * per_item;
        float top = -INFINITY;
        for (int64_t c = 0; c < chunks; c++) {
            const float m = base[c * per_item + hq * d + 2 * h];
            top = m > top ? m : top;
        }
        float total = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float *o = base + c * per_item;
            const float w = expf(o[hq * d + 2 * h] - top);
            total += w * o[hq * d + 2 * h + 1];
            for (int64_t e = 0; e < d; e++) dst[e] = (c ? dst[e] : 0.0f) + w * o[h * d + e];
        }
        const float inv = 1.0f / total;
        for (int64_t e = 0; e < d; e++) dst[e] *= inv;
    }
}

/* Inside a parallel region: one token's attention for each of `rows` sequences (query
 * row r at q + r * q_stride, output at out + r * out_stride, both [hq, d]) over the
 * last min(seq_lens[r], window) positions (window 0: all) of the pages tables + r *
 * table_stride lists; a sequence of no positions gets zeros. With fewer than 4 rows a
 * thread, the positions are split over the team; with more, each row's heads are an
 * item (attend_parts_team). scores: the calling thread's own, hq * (the longest span)
 * floats. Ends in a barrier. */
void quire_attend_rows_team(int kv_type, const float *q, int64_t q_stride,
                            const void *k_cache, const void *v_cache, const int64_t *tables,
                            int64_t table_stride, const int64_t *seq_lens, int64_t rows,
                            int64_t window, int64_t hq, int64_t hkv, int64_t d,
                            int64_t block_size, float scale, float *scores, float *out,
                            int64_t out_stride) {
    const int64_t threads = omp_get_num_threads();
    int64_t starts[rows], lens[rows];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = seq_lens[r] > 0 ? seq_lens[r] : 0;
        lens[r] = window > 0 && len > window ? window : len;
        starts[r] = len - lens[r];
    }
    attend_parts_team(kv_type, q, q_stride, k_cache, v_cache, tables, table_stride, starts,
                      lens, rows, threads > 1 && rows < 4 * threads, hq, hkv, d, block_size,
                      scale, scores, out, out_stride);
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
