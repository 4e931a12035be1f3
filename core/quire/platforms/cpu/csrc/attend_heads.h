/*
 * The body of paged decode attention for one sequence's query heads, for one KV element
 * type: included by paged_decode.c once per type (float32 first, bfloat16, int8, fp8),
 * with
 *   KV_T          the cache's element type
 *   KV_QUANT      0 for float pages; for quantised ones (each head row of d elements
 *                 followed by a float16 scale per QUIRE_KV_GROUP of them) their
 *                 QUIRE_KV_I8 or QUIRE_KV_FP8
 *   KV_LOADW(p)   float pages: VW elements at p as a vwf (cpu_kernels.h)
 *   KV_GET(p)     float pages: the element at p as a float
 *   ATTEND_NAME   the entry point's name; ATTEND_(x) names its helpers
 * defined (and paged_decode.c's ATTEND_TILE, slot_cursor, tile_offsets and prefetch_tile
 * before it), and undefines them at the end. Queries, scores and outputs are float32 for
 * every type: only the cache is read narrower. No include guard: it is included per type.
 *
 * Quantised pages: each tile's rows of one KV head are dequantised once (every group
 * widened and times its scale) into a float32 tile in L1, which the query heads of its
 * group then read with the float32 instantiation's passes (tile_scores_f32,
 * tile_values_f32): the widening and scaling is paid once per KV head, not per query
 * head, and the scales need no table.
 *
 * The query heads go over the positions a tile at a time, so each tile's K (then V)
 * slices are read from memory once and from L1 by every head of their group (GQA);
 * passes: scores, softmax, weighted sum of V.
 */

#if !KV_QUANT /* quantised tiles are read dequantised, by the float32 passes */
/* The scores of query head qh against the keys of one tile (m slots at offs, this KV
 * head's slice of each row at k): unscaled dot products into sc. */
static inline void ATTEND_(tile_scores)(const float *qh, const KV_T *k, const int64_t *offs,
                                        int64_t m, int64_t d, float *sc) {
    const int64_t dv = d - d % VW;
    int64_t t = 0;
    for (; t + 4 <= m; t += 4) {
        const KV_T *k0 = k + offs[t], *k1 = k + offs[t + 1], *k2 = k + offs[t + 2],
                   *k3 = k + offs[t + 3];
        vwf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < dv; i += VW) {
            const vwf qv = loadw(qh + i);
            a0 = fmaw(qv, KV_LOADW(k0 + i), a0);
            a1 = fmaw(qv, KV_LOADW(k1 + i), a1);
            a2 = fmaw(qv, KV_LOADW(k2 + i), a2);
            a3 = fmaw(qv, KV_LOADW(k3 + i), a3);
        }
        sum4w(a0, a1, a2, a3, sc + t);
        for (int64_t i = dv; i < d; ++i) {
            sc[t] += qh[i] * KV_GET(k0 + i);
            sc[t + 1] += qh[i] * KV_GET(k1 + i);
            sc[t + 2] += qh[i] * KV_GET(k2 + i);
            sc[t + 3] += qh[i] * KV_GET(k3 + i);
        }
    }
    for (; t < m; ++t) {
        const KV_T *kt = k + offs[t];
        vwf a = {0};
        for (int64_t i = 0; i < dv; i += VW) a = fmaw(loadw(qh + i), KV_LOADW(kt + i), a);
        float total = hsumw(a);
        for (int64_t i = dv; i < d; ++i) total += qh[i] * KV_GET(kt + i);
        sc[t] = total;
    }
}

#if KV_BF16_DOT
/* tile_scores for bfloat16 pages by vdpbf16ps, d a multiple of 32: the query as three
 * bfloat16 parts (qh: hi, mid, lo, d words each) whose sum is the float32 query exactly,
 * each part's products with a key exact in float32 and summed there, so the scores are
 * the float32 kernel's up to the order of the sums, at 6 instructions for 64 elements
 * where widening the keys and multiplying takes 12. */
static inline void ATTEND_(tile_scores_dot)(const uint16_t *qh, const KV_T *k,
                                            const int64_t *offs, int64_t m, int64_t d,
                                            float *sc) {
    int64_t t = 0;
    for (; t + 4 <= m; t += 4) {
        __m512 a[4][3];
        for (int u = 0; u < 4; ++u)
            for (int p = 0; p < 3; ++p) a[u][p] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 32)
            for (int u = 0; u < 4; ++u) {
                const __m512bh kv =
                    (__m512bh)_mm512_loadu_si512((const void *)(k + offs[t + u] + i));
                for (int p = 0; p < 3; ++p)
                    a[u][p] = _mm512_dpbf16_ps(
                        a[u][p], (__m512bh)_mm512_loadu_si512((const void *)(qh + p * d + i)),
                        kv);
            }
        sum4w((vwf)(a[0][0] + a[0][1] + a[0][2]), (vwf)(a[1][0] + a[1][1] + a[1][2]),
              (vwf)(a[2][0] + a[2][1] + a[2][2]), (vwf)(a[3][0] + a[3][1] + a[3][2]), sc + t);
    }
    for (; t < m; ++t) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 32) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(k + offs[t] + i));
            for (int p = 0; p < 3; ++p)
                a = _mm512_dpbf16_ps(
                    a, (__m512bh)_mm512_loadu_si512((const void *)(qh + p * d + i)), kv);
        }
        sc[t] = hsumw((vwf)a);
    }
}

/* A float32 row of d as three bfloat16 rows (hi, mid, lo) summing to it exactly: each
 * the nearest bfloat16 to what the ones before leave (a float32's 24 significant bits
 * are three times eight; a part below bfloat16's normal range would be flushed by
 * vdpbf16ps, one of 2^-126 or less). */
static inline void ATTEND_(split3)(const float *x, int64_t d, uint16_t *out) {
    for (int64_t i = 0; i < d; i += 16) {
        __m512 rest = _mm512_loadu_ps(x + i);
        for (int p = 0; p < 3; ++p) {
            const __m256bh part = _mm512_cvtneps_pbh(rest);
            _mm256_storeu_si256((void *)(out + p * d + i), (__m256i)part);
            rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32((__m256i)part), 16)));
        }
    }
}
#endif

/* o[0 .. nv * VW) = (first ? 0 : o) + the sum over the tile of p[t] times its V slice:
 * nv <= 4 accumulators in registers, in two sets (even and odd slots) so the FMAs do not
 * wait on each other. */
static inline __attribute__((always_inline)) void ATTEND_(tile_weigh)(
    const float *p, const KV_T *v, const int64_t *offs, int64_t m, int nv, int first,
    float *o) {
    vwf a[4], b[4];
    for (int c = 0; c < nv; ++c) {
        a[c] = first ? (vwf){0} : loadw(o + c * VW);
        b[c] = (vwf){0};
    }
    int64_t t = 0;
    for (; t + 2 <= m; t += 2) {
        const KV_T *v0 = v + offs[t], *v1 = v + offs[t + 1];
        const vwf p0 = splatw(p[t]), p1 = splatw(p[t + 1]);
        for (int c = 0; c < nv; ++c) {
            a[c] = fmaw(p0, KV_LOADW(v0 + c * VW), a[c]);
            b[c] = fmaw(p1, KV_LOADW(v1 + c * VW), b[c]);
        }
    }
    if (t < m) {
        const KV_T *v0 = v + offs[t];
        const vwf p0 = splatw(p[t]);
        for (int c = 0; c < nv; ++c) a[c] = fmaw(p0, KV_LOADW(v0 + c * VW), a[c]);
    }
    for (int c = 0; c < nv; ++c) storew(o + c * VW, a[c] + b[c]);
}

/* One query head's share of a V tile: its whole row of out, vector slabs then the
 * scalar rest. */
static inline void ATTEND_(tile_values)(const float *p, const KV_T *v, const int64_t *offs,
                                        int64_t m, int64_t d, int first, float *oh) {
    const int64_t dv = d - d % VW;
    int64_t i = 0;
    for (; i + 4 * VW <= dv; i += 4 * VW)
        ATTEND_(tile_weigh)(p, v + i, offs, m, 4, first, oh + i);
    if (i < dv)
        ATTEND_(tile_weigh)(p, v + i, offs, m, (int)((dv - i) / VW), first, oh + i);
    for (i = dv; i < d; ++i) {
        float total = first ? 0.0f : oh[i];
        for (int64_t t = 0; t < m; ++t) total += p[t] * KV_GET(v + offs[t] + i);
        oh[i] = total;
    }
}

#endif

/* Elements of a head row in the pages (d, or d + d / 8 with its float16 scales). */
#define ATTEND_HEAD(d) ((d) + (KV_QUANT ? 2 * (d) / QUIRE_KV_GROUP : 0))

#if KV_QUANT
/* The m rows of one KV head in a tile (at p + offs[t]: d elements, then their float16
 * scales) as float32 rows of d at out, each group times its scale; int8 groups stay in
 * the Hadamard basis (the queries and outputs are rotated instead: once a head, not once
 * a row read). */
static inline void ATTEND_(dequant_tile)(const KV_T *p, const int64_t *offs, int64_t m,
                                         int64_t d, float *out) {
    for (int64_t t = 0; t < m; ++t)
        dequant_kv_row_basis(KV_QUANT, (const uint8_t *)(p + offs[t]), d, out + t * d, 0);
}
#endif

/* The query heads of KV head g among [h_begin, h_end): [*h0, *h1). */
static inline void ATTEND_(group_heads)(int64_t g, int64_t groups, int64_t h_begin,
                                        int64_t h_end, int64_t *h0, int64_t *h1) {
    *h0 = g * groups > h_begin ? g * groups : h_begin;
    *h1 = (g + 1) * groups < h_end ? (g + 1) * groups : h_end;
}

/* Query heads [h_begin, h_end) of one sequence, over its positions start .. start + n - 1
 * (n >= 1). q and out point at the sequence's [Hq, D] rows; scores has room for
 * (h_end - h_begin) * n floats. With stats, those positions are a part of the
 * sequence's (paged_decode.c's attend_parts_team): outputs undivided, stats per head.
 *
 * Two walks over the positions a tile at a time, keys then values. A tile's slots are
 * read for every KV head the heads use at once (their slices are adjacent in a slot's
 * row: one contiguous span per slot), and each slice is read from memory once and from
 * L1 by every query head of its group (quantised pages: dequantised per KV head into a
 * float32 tile first, which its query heads read through the float32 passes). The next
 * tile (after the last key tile, the first value tile) is prefetched a share per head,
 * between the heads' work: a burst of prefetches would fill the core's miss buffers and
 * stall it, where shares keep memory busy while it computes. The tile after that is asked
 * for into L2 the same way (struct tiles_ahead): a step reads its pages from memory, and
 * one tile's distance left each tile's first reads waiting on it (docs/bench.md). */
void ATTEND_NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache,
                 const int64_t *table, int64_t start, int64_t n, int64_t h_begin,
                 int64_t h_end, int64_t groups, int64_t row, int64_t d, int64_t block_size,
                 float scale, float *scores, float *out, float *stats) {
    const int64_t kv_begin = h_begin / groups, kv_end = (h_end + groups - 1) / groups;
    const int64_t hd = ATTEND_HEAD(d); /* elements from one head row to the next */
    const int64_t span = (kv_end - kv_begin) * hd * (int64_t)sizeof(KV_T);
    const int64_t heads = h_end - h_begin;
    const KV_T *k_span = k_cache + kv_begin * hd, *v_span = v_cache + kv_begin * hd;
    int64_t tile_a[ATTEND_TILE], tile_b[ATTEND_TILE];
#if KV_QUANT
    int64_t rows[ATTEND_TILE]; /* the dequantised tile's rows of d */
    float tile[ATTEND_TILE * d];
    for (int64_t t = 0; t < ATTEND_TILE; ++t) rows[t] = t * d;
#endif
    const float *q_rows = q + h_begin * d; /* head h_begin + i at q_rows + i * d */
#if KV_QUANT == QUIRE_KV_I8
    /* int8 keys and values are read in the Hadamard basis: so are the queries, (H q) .
     * k' = q . k, and the outputs are taken back from it at the end */
    float q_basis[heads * d];
    memcpy(q_basis, q_rows, sizeof(float) * heads * d);
    for (int64_t i = 0; i < heads; ++i) hadamard16_row(q_basis + i * d, d);
    q_rows = q_basis;
#endif
#if KV_BF16_DOT
    /* every head's query in three bfloat16 parts, where d is whole 32-word registers */
    const int dot = d % 32 == 0;
    uint16_t q_parts[dot ? heads * 3 * d : 1];
    if (dot)
        for (int64_t i = 0; i < heads; ++i)
            ATTEND_(split3)(q_rows + i * d, d, q_parts + i * 3 * d);
#endif
    /* scores; the walk two tiles ahead of the one being read (L2), beside the next
     * tile's shares (L1) */
    struct tiles_ahead far = tiles_ahead_at(table, start, n, block_size, row, k_span, v_span);
    tiles_ahead_step(&far), tiles_ahead_step(&far);
    struct slot_cursor cur = slot_cursor_at(table, start, block_size);
    int64_t *offs = tile_a, *next = tile_b;
    for (int64_t j = 0, m = tile_offsets(&cur, n, row, offs);;) {
        const int64_t m_next = tile_offsets(&cur, n - j - m, row, next);
        const KV_T *ahead = k_span;
        int64_t m_ahead = m_next;
        if (m_next == 0) {
            struct slot_cursor first = slot_cursor_at(table, start, block_size);
            ahead = v_span, m_ahead = tile_offsets(&first, n, row, next);
        }
        tiles_ahead_step(&far);
        for (int64_t g = kv_begin; g < kv_end; ++g) {
#if KV_QUANT
            ATTEND_(dequant_tile)(k_cache + g * hd, offs, m, d, tile);
#endif
            int64_t h0, h1;
            ATTEND_(group_heads)(g, groups, h_begin, h_end, &h0, &h1);
            for (int64_t h = h0; h < h1; ++h) {
                const int64_t i = h - h_begin;
                tiles_ahead_share(&far, sizeof(KV_T), i, heads, span);
                prefetch_tile(ahead, sizeof(KV_T), next + i * m_ahead / heads,
                              (i + 1) * m_ahead / heads - i * m_ahead / heads, span);
#if KV_QUANT
                tile_scores_f32(q_rows + i * d, tile, rows, m, d, scores + i * n + j);
#else
#if KV_BF16_DOT
                if (dot)
                    ATTEND_(tile_scores_dot)(q_parts + i * 3 * d, k_cache + g * hd, offs, m,
                                             d, scores + i * n + j);
                else
#endif
                    ATTEND_(tile_scores)(q_rows + i * d, k_cache + g * hd, offs, m, d,
                                         scores + i * n + j);
#endif
            }
        }
        if (m_next == 0)
            break;
        int64_t *const done = offs;
        offs = next, next = done, j += m, m = m_next;
    }
    for (int64_t h = h_begin; h < h_end; ++h)
        softmax_row_part(scores + (h - h_begin) * n, n, scale,
                         stats ? stats + 2 * (h - h_begin) : NULL);
    /* the weighted sum of V, the same way */
    cur = slot_cursor_at(table, start, block_size);
    offs = tile_a, next = tile_b;
    for (int64_t j = 0, m = tile_offsets(&cur, n, row, offs);;) {
        const int64_t m_next = tile_offsets(&cur, n - j - m, row, next);
        tiles_ahead_step(&far);
        for (int64_t g = kv_begin; g < kv_end; ++g) {
#if KV_QUANT
            ATTEND_(dequant_tile)(v_cache + g * hd, offs, m, d, tile);
#endif
            int64_t h0, h1;
            ATTEND_(group_heads)(g, groups, h_begin, h_end, &h0, &h1);
            for (int64_t h = h0; h < h1; ++h) {
                const int64_t i = h - h_begin;
                tiles_ahead_share(&far, sizeof(KV_T), i, heads, span);
                prefetch_tile(v_span, sizeof(KV_T), next + i * m_next / heads,
                              (i + 1) * m_next / heads - i * m_next / heads, span);
#if KV_QUANT
                tile_values_f32(scores + i * n + j, tile, rows, m, d, j == 0, out + h * d);
#else
                ATTEND_(tile_values)(scores + i * n + j, v_cache + g * hd, offs, m, d,
                                     j == 0, out + h * d);
#endif
            }
        }
        if (m_next == 0)
            break;
        int64_t *const done = offs;
        offs = next, next = done, j += m, m = m_next;
    }
#if KV_QUANT == QUIRE_KV_I8
    for (int64_t h = h_begin; h < h_end; ++h) hadamard16_row(out + h * d, d);
#endif
}

#undef KV_T
#if !KV_QUANT
#undef KV_LOADW
#undef KV_GET
#endif
#undef KV_QUANT
#undef KV_BF16_DOT
#undef ATTEND_HEAD
#undef ATTEND_NAME
#undef ATTEND_
