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

/* The rows of positions pos .. pos + 3 in one half of the cache, and a prefetch of the
 * rows of the next four positions PREFETCH_AHEAD on (those before end). */
static inline void rows4(const float *half, const int64_t *table, int64_t pos, int64_t end,
                         int64_t block_size, int64_t row, const float *out[4]) {
    for (int t = 0; t < 4; ++t)
        out[t] = slot_row(half, table, pos + t, block_size, row);
    for (int64_t t = 4; t < 8; ++t)
        if (pos + t + PREFETCH_AHEAD < end)
            prefetch_row(slot_row(half, table, pos + t + PREFETCH_AHEAD, block_size, row), row);
}

/* Query heads [h_begin, h_end) of one sequence, over its positions start .. start + n - 1
 * (n >= 1). q and out point at the sequence's [Hq, D] rows; scores has room for
 * (h_end - h_begin) * n floats. */
void quire_attend_heads(const float *q, const float *k_cache, const float *v_cache,
                        const int64_t *table, int64_t start, int64_t n, int64_t h_begin,
                        int64_t h_end, int64_t groups, int64_t row, int64_t d,
                        int64_t block_size, float scale, float *scores, float *out) {
    const int64_t heads = h_end - h_begin;
    float maxes[heads];
    for (int64_t h = 0; h < heads; ++h) maxes[h] = -INFINITY;
    int64_t j = 0;
    if (d % 8 == 0) {
        /* four positions at a time: one 8-wide partial sum per position and head, the
         * four reduced together, each query vector loaded once for the four */
        for (; j + 4 <= n; j += 4) {
            const float *ks[4];
            rows4(k_cache, table, start + j, start + n, block_size, row, ks);
            const float *k0 = ks[0], *k1 = ks[1], *k2 = ks[2], *k3 = ks[3];
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t head = h_begin + h;
                const float *qh = q + head * d;
                const int64_t kv = (head / groups) * d;
                v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t i = 0; i < d; i += 8) {
                    const v8f qv = load8(qh + i);
                    a0 += qv * load8(k0 + kv + i);
                    a1 += qv * load8(k1 + kv + i);
                    a2 += qv * load8(k2 + kv + i);
                    a3 += qv * load8(k3 + kv + i);
                }
                float *sc = scores + h * n + j;
                sum4(a0, a1, a2, a3, sc);
                for (int t = 0; t < 4; ++t) {
                    sc[t] *= scale;
                    if (sc[t] > maxes[h]) maxes[h] = sc[t];
                }
            }
        }
    }
    for (; j < n; ++j) {
        const float *k = slot_row(k_cache, table, start + j, block_size, row);
        if (j + PREFETCH_AHEAD < n)
            prefetch_row(slot_row(k_cache, table, start + j + PREFETCH_AHEAD, block_size, row), row);
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t head = h_begin + h;
            const float sc = dot(q + head * d, k + (head / groups) * d, d) * scale;
            scores[h * n + j] = sc;
            if (sc > maxes[h]) maxes[h] = sc;
        }
    }
    float sums[heads];
    for (int64_t h = 0; h < heads; ++h) {
        float *sg = scores + h * n;
        v8f acc = {0};
        j = 0;
        for (; j + 8 <= n; j += 8) {
            const v8f e = exp8(load8(sg + j) - maxes[h]);
            memcpy(sg + j, &e, sizeof e);
            acc += e;
        }
        float total = hsum(acc);
        for (; j < n; ++j) {
            sg[j] = expf(sg[j] - maxes[h]);
            total += sg[j];
        }
        sums[h] = total;
    }
    memset(out + h_begin * d, 0, sizeof(float) * heads * d);
    j = 0;
    if (d % 8 == 0) {
        /* four positions at a time: each output vector loaded and stored once for four */
        for (; j + 4 <= n; j += 4) {
            const float *vs[4];
            rows4(v_cache, table, start + j, start + n, block_size, row, vs);
            const float *v0 = vs[0], *v1 = vs[1], *v2 = vs[2], *v3 = vs[3];
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t head = h_begin + h;
                const int64_t kv = (head / groups) * d;
                const float *p = scores + h * n + j;
                const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
                float *oh = out + head * d;
                for (int64_t i = 0; i < d; i += 8) {
                    const v8f o = load8(oh + i) + ((p0 * load8(v0 + kv + i) + p1 * load8(v1 + kv + i)) +
                                                   (p2 * load8(v2 + kv + i) + p3 * load8(v3 + kv + i)));
                    memcpy(oh + i, &o, sizeof o);
                }
            }
        }
    }
    for (; j < n; ++j) {
        const float *v = slot_row(v_cache, table, start + j, block_size, row);
        if (j + PREFETCH_AHEAD < n)
            prefetch_row(slot_row(v_cache, table, start + j + PREFETCH_AHEAD, block_size, row), row);
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t head = h_begin + h;
            axpy(out + head * d, scores[h * n + j], v + (head / groups) * d, d);
        }
    }
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / sums[h];
        float *oh = out + (h_begin + h) * d;
        for (int64_t i = 0; i < d; ++i) oh[i] *= inv;
    }
}

/*
 * Returns 0 on success, 1 when scratch memory could not be allocated (the caller
 * falls back to the torch path).
 */
int quire_paged_decode_f32(
    const float *q, const float *k_cache, const float *v_cache,
    const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
    int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
    float scale, int64_t window, float *out) {
    const int64_t groups = hq / hkv; /* query heads per KV head (GQA) */
    const int64_t row = hkv * d; /* floats between consecutive slots */
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
        quire_attend_heads(q + s * hq * d, k_cache, v_cache, block_tables + s * table_stride,
                           start, n, 0, hq, groups, row, d, block_size, scale, scores, os);
        free(scores);
    }
    return failed;
}
