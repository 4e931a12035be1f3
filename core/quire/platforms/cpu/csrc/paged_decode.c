/*
 * Paged decode attention for the cpu platform: one query token per sequence, float32.
 *
 * Reads each sequence's keys and values straight from their pages, once, instead of
 * gathering them into a padded copy first (what the torch path has to do). Work is
 * split over sequences with OpenMP; a sequence's task reads each of its slots as one
 * contiguous row of all KV heads (a page is then one contiguous run of memory, which
 * the prefetcher follows) and serves every query head from it. Splitting by (sequence,
 * KV head) instead read 1/Hkv of each row per task and measured 1.7-3x slower.
 *
 * Layout (see quire/platforms/cpu/attention.py): the cache of one layer is
 * [2, num_blocks, block_size, Hkv, D]; k_cache and v_cache point at its two halves.
 * Query and output are [B, Hq, D], contiguous. Query head h reads KV head h / G.
 *
 * Arithmetic: scores, softmax and the weighted sum in float32, as the reference; only
 * the order of the sums differs (dot products in four 8-wide partial sums, the
 * weighted sum normalised at the end), so results agree with it to float32 rounding.
 *
 * Built at run time by quire/platforms/cpu/native.py with the system C compiler;
 * OpenMP resolves to the libgomp torch has already loaded (same soname), so this
 * shares torch's thread pool and thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* Float32 pages: the helpers of cpu_kernels.h as they are. */
#define KV_T float
#define KV_LOAD8 load8
#define KV_SLOT_ROW slot_row
#define KV_PREFETCH prefetch_row
#define KV_DOT dot
#define KV_AXPY axpy
#define ATTEND_NAME quire_attend_heads
#define ATTEND_ROWS4 rows4
#include "attend_heads.h"

/* bfloat16 pages: half the bytes read per position, widened to float32 on load (a
 * bfloat16 is a float32's upper 16 bits, so the widening is exact). */
#define KV_T uint16_t
#define KV_LOAD8 load8_bf16
#define KV_SLOT_ROW slot_row_bf16
#define KV_PREFETCH prefetch_row_bf16
#define KV_DOT kv_dot_bf16
#define KV_AXPY kv_axpy_bf16
#define ATTEND_NAME quire_attend_heads_bf16
#define ATTEND_ROWS4 rows4_bf16
#include "attend_heads.h"

/* Both entry points: every sequence's query heads over its pages, sequences over the
 * team. Returns 0 on success, 1 when scratch memory could not be allocated (the caller
 * falls back to the torch path). */
static int paged_decode(int kv_bf16, const float *q, const void *k_cache, const void *v_cache,
                        const int64_t *block_tables, int64_t table_stride,
                        const int64_t *seq_lens, int64_t num_seqs, int64_t hq, int64_t hkv,
                        int64_t d, int64_t block_size, float scale, int64_t window,
                        float *out) {
    const int64_t groups = hq / hkv; /* query heads per KV head (GQA) */
    const int64_t row = hkv * d; /* elements between consecutive slots */
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t len = seq_lens[s];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int64_t n = len - start;
        float *os = out + s * hq * d;
        if (n <= 0) {
            memset(os, 0, sizeof(float) * hq * d);
            continue;
        }
        float *scores = malloc(sizeof(float) * hq * n);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attend_heads_kv(kv_bf16, q + s * hq * d, k_cache, v_cache,
                        block_tables + s * table_stride, start, n, 0, hq, groups, row, d,
                        block_size, scale, scores, os);
        free(scores);
    }
    return failed;
}

/* Float32 pages. */
int quire_paged_decode_f32(
    const float *q, const float *k_cache, const float *v_cache,
    const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
    int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
    float scale, int64_t window, float *out) {
    return paged_decode(0, q, k_cache, v_cache, block_tables, table_stride, seq_lens,
                        num_seqs, hq, hkv, d, block_size, scale, window, out);
}

/* bfloat16 pages (float32 query and output). */
int quire_paged_decode_bf16(
    const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
    int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
    float scale, int64_t window, float *out) {
    return paged_decode(1, q, k_cache, v_cache, block_tables, table_stride, seq_lens,
                        num_seqs, hq, hkv, d, block_size, scale, window, out);
}
