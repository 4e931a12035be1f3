/*
 * The body of paged decode attention for one sequence's query heads, for one KV element
 * type: included by paged_decode.c once per type (float32, bfloat16), with
 *   KV_T          the cache's element type
 *   KV_LOAD8(p)   eight elements at p as a v8f
 *   KV_SLOT_ROW   the first element of a position's row (cpu_kernels.h's slot_row)
 *   KV_PREFETCH   prefetch_row for that type
 *   KV_DOT, KV_AXPY  dot(q, kv, n) and out += w * kv, kv of that type
 *   ATTEND_NAME, ATTEND_ROWS4  the names of the entry point and its helper
 * defined, and undefines them at the end. Queries, scores and outputs are float32 for
 * every type: only the cache is read narrower. No include guard: it is included twice.
 */
/* The rows of positions pos .. pos + 3 in one half of the cache, and a prefetch of the
 * rows of the next four positions PREFETCH_AHEAD on (those before end). */
static inline void ATTEND_ROWS4(const KV_T *half, const int64_t *table, int64_t pos, int64_t end,
                         int64_t block_size, int64_t row, const KV_T *out[4]) {
    for (int t = 0; t < 4; ++t)
        out[t] = KV_SLOT_ROW(half, table, pos + t, block_size, row);
    for (int64_t t = 4; t < 8; ++t)
        if (pos + t + PREFETCH_AHEAD < end)
            KV_PREFETCH(KV_SLOT_ROW(half, table, pos + t + PREFETCH_AHEAD, block_size, row), row);
}

/* Query heads [h_begin, h_end) of one sequence, over its positions start .. start + n - 1
 * (n >= 1). q and out point at the sequence's [Hq, D] rows; scores has room for
 * (h_end - h_begin) * n floats. */
void ATTEND_NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache,
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
            const KV_T *ks[4];
            ATTEND_ROWS4(k_cache, table, start + j, start + n, block_size, row, ks);
            const KV_T *k0 = ks[0], *k1 = ks[1], *k2 = ks[2], *k3 = ks[3];
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t head = h_begin + h;
                const float *qh = q + head * d;
                const int64_t kv = (head / groups) * d;
                v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int64_t i = 0; i < d; i += 8) {
                    const v8f qv = load8(qh + i);
                    a0 += qv * KV_LOAD8(k0 + kv + i);
                    a1 += qv * KV_LOAD8(k1 + kv + i);
                    a2 += qv * KV_LOAD8(k2 + kv + i);
                    a3 += qv * KV_LOAD8(k3 + kv + i);
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
        const KV_T *k = KV_SLOT_ROW(k_cache, table, start + j, block_size, row);
        if (j + PREFETCH_AHEAD < n)
            KV_PREFETCH(KV_SLOT_ROW(k_cache, table, start + j + PREFETCH_AHEAD, block_size, row), row);
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t head = h_begin + h;
            const float sc = KV_DOT(q + head * d, k + (head / groups) * d, d) * scale;
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
            const KV_T *vs[4];
            ATTEND_ROWS4(v_cache, table, start + j, start + n, block_size, row, vs);
            const KV_T *v0 = vs[0], *v1 = vs[1], *v2 = vs[2], *v3 = vs[3];
            for (int64_t h = 0; h < heads; ++h) {
                const int64_t head = h_begin + h;
                const int64_t kv = (head / groups) * d;
                const float *p = scores + h * n + j;
                const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
                float *oh = out + head * d;
                for (int64_t i = 0; i < d; i += 8) {
                    const v8f o = load8(oh + i) + ((p0 * KV_LOAD8(v0 + kv + i) + p1 * KV_LOAD8(v1 + kv + i)) +
                                                   (p2 * KV_LOAD8(v2 + kv + i) + p3 * KV_LOAD8(v3 + kv + i)));
                    memcpy(oh + i, &o, sizeof o);
                }
            }
        }
    }
    for (; j < n; ++j) {
        const KV_T *v = KV_SLOT_ROW(v_cache, table, start + j, block_size, row);
        if (j + PREFETCH_AHEAD < n)
            KV_PREFETCH(KV_SLOT_ROW(v_cache, table, start + j + PREFETCH_AHEAD, block_size, row), row);
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t head = h_begin + h;
            KV_AXPY(out + head * d, scores[h * n + j], v + (head / groups) * d, d);
        }
    }
    for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / sums[h];
        float *oh = out + (h_begin + h) * d;
        for (int64_t i = 0; i < d; ++i) oh[i] *= inv;
    }
}

#undef KV_T
#undef KV_LOAD8
#undef KV_SLOT_ROW
#undef KV_PREFETCH
#undef KV_DOT
#undef KV_AXPY
#undef ATTEND_NAME
#undef ATTEND_ROWS4
