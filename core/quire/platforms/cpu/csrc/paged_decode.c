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
        const int64_t *table = block_tables + s * table_stride;
        const float *qs = q + s * hq * d;
        float *os = out + s * hq * d;
        memset(os, 0, sizeof(float) * hq * d);
        if (n <= 0) continue;
        float *scores = malloc(sizeof(float) * hq * n);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        float maxes[hq];
        for (int64_t h = 0; h < hq; ++h) maxes[h] = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
            const float *k = slot_row(k_cache, table, start + j, block_size, row);
            if (j + PREFETCH_AHEAD < n)
                prefetch_row(slot_row(k_cache, table, start + j + PREFETCH_AHEAD, block_size, row), row);
            for (int64_t h = 0; h < hq; ++h) {
                const float sc = dot(qs + h * d, k + (h / groups) * d, d) * scale;
                scores[h * n + j] = sc;
                if (sc > maxes[h]) maxes[h] = sc;
            }
        }
        float sums[hq];
        for (int64_t h = 0; h < hq; ++h) {
            float total = 0.0f;
            float *sg = scores + h * n;
            for (int64_t j = 0; j < n; ++j) {
                sg[j] = expf(sg[j] - maxes[h]);
                total += sg[j];
            }
            sums[h] = total;
        }
        for (int64_t j = 0; j < n; ++j) {
            const float *v = slot_row(v_cache, table, start + j, block_size, row);
            if (j + PREFETCH_AHEAD < n)
                prefetch_row(slot_row(v_cache, table, start + j + PREFETCH_AHEAD, block_size, row), row);
            for (int64_t h = 0; h < hq; ++h)
                axpy(os + h * d, scores[h * n + j], v + (h / groups) * d, d);
        }
        for (int64_t h = 0; h < hq; ++h) {
            const float inv = 1.0f / sums[h];
            for (int64_t i = 0; i < d; ++i) os[h * d + i] *= inv;
        }
        free(scores);
    }
    return failed;
}
