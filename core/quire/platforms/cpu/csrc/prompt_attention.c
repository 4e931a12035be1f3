/*
 * Causal attention of several tokens per sequence for the cpu platform, float32 or
 * bfloat16, float32 arithmetic: whole prompts over their own keys and values (rows of
 * the layer's projection), and chunks after a cached prefix (prefix-cache hits,
 * chunked prefill) over their sequence's pages.
 *
 * torch's SDPA takes one call per prompt for fresh prompts (is_causal cannot mix
 * lengths) and runs its small blocks at about 25 GFLOP/s; for chunks it needs the
 * pages gathered into a padded copy and a mask first. This reads q, k and v where they
 * are and works as small products.
 *
 * First every key tile (PA_KT positions of one KV head) is transposed to [D, PA_KT]
 * float32, and values widened or gathered into float32 rows where they are not already
 * (bfloat16, or pages), once per call. Then the work items: (prompt,
 * KV head, block of PA_QB query positions) over the team, a prompt's later (longer)
 * blocks first. An item's query rows are the G query heads of its KV head (GQA) times
 * its positions, and they share every tile:
 *   scores  PA_RB query rows by a tile's two vectors of keys in registers, the head
 *           dimension in the loop (no horizontal sums);
 *   softmax each row over its own span (causal, and within a sliding window if any);
 *   values  PA_RB rows by up to PA_NV vectors of the head dimension in registers, each
 *           value row loaded once for them.
 * Sums run in another order than the reference's, so results agree with it to float32
 * rounding; bfloat16 outputs are rounded to nearest even, as torch rounds.
 *
 * Chunks over bfloat16 pages may have float32 rows (quire_chunk_attention_f32_bf16kv, a
 * float32 model with bfloat16 pages), and chunks over int8 or fp8 pages have float32 rows
 * (quire_chunk_attention_quant, each head row dequantised with its scale as it is
 * gathered); every other entry's rows and keys share a type.
 *
 * Layout: token t's query heads at q + t * q_stride ([Hq, D], contiguous); sequence p's
 * new tokens are rows starts[p] .. starts[p] + lens[p] - 1, at positions ctx[p] -
 * lens[p] .. ctx[p] - 1 of its ctx[p] (ctx = lens for a fresh prompt), and its rows of
 * out follow the previous sequence's ([T, Hq, D] contiguous, in the order given). Keys
 * and values: rows of [Hkv, D] at k/v + t * kv_stride for a fresh prompt's token t; or
 * pages, position j in slot table_p[j / block_size] * block_size + j % block_size of
 * the cache halves k/v ([slots, Hkv, D]). Query head h reads KV head h / G.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* Query positions per work item. */
#define PA_QB 16
/* Keys per tile: two vectors. */
#define PA_KT (2 * VW)
/* Query rows in registers at a time. */
#define PA_RB 4
/* Vectors of the head dimension in registers at a time in the values pass: 4 rows by 4
 * vectors fills half of avx512's 32 registers; 16-register levels take 2. */
#if VW == 16
#define PA_NV 4
#else
#define PA_NV 2
#endif

/* What an item reads and writes, with its element types. */
struct pa_args {
    const void *q, *k, *v;
    void *out;
    int64_t q_stride, kv_stride, hq, hkv, d, window;
    float scale;
    int bf16;    /* q and out hold bfloat16 (else float32) */
    /* pages: [num_seqs, table_stride] block tables; NULL for rows of the projection */
    const int64_t *tables;
    int64_t table_stride, block_size;
    int kv_type; /* what k and v hold: QUIRE_KV_F32, _BF16 (rows too), _I8 or _FP8 */
};

/* Where position t of sequence p (its first token row `first`) keeps its keys and
 * values, in elements from k/v: the start of its [Hkv, D] row. */
static inline int64_t pa_key_row(const struct pa_args *a, int64_t p, int64_t first,
                                 int64_t t) {
    if (a->tables == NULL)
        return (first + t) * a->kv_stride;
    const int64_t *table = a->tables + p * a->table_stride, bs = a->block_size;
    return (table[t / bs] * bs + t % bs) * kv_slot_elems(a->kv_type, a->hkv, a->d);
}

/* One position's hkv head rows of d (a query head's row: hkv 1), from base + i elements,
 * widened (or dequantised) into dst as hkv * d floats. */
static inline void pa_widen(const void *base, int kv_type, int64_t i, int64_t hkv, int64_t d,
                            float *dst) {
    const int64_t n = hkv * d;
    if (kv_type == QUIRE_KV_F32) {
        memcpy(dst, (const float *)base + i, sizeof(float) * n);
    } else if (kv_type == QUIRE_KV_BF16) {
        const uint16_t *src = (const uint16_t *)base + i;
        int64_t j = 0;
        for (; j + VW <= n; j += VW) storew(dst + j, loadw_bf16(src + j));
        for (; j < n; ++j) dst[j] = bf16_to_f32(src[j]);
    } else {
        for (int64_t h = 0; h < hkv; ++h)
            dequant_kv_row(kv_type, (const uint8_t *)base + i + h * kv_head_elems(kv_type, d),
                           d, dst + h * d);
    }
}

/* Bytes of a KV element. */
static inline int64_t pa_elem(int kv_type) {
    return kv_type == QUIRE_KV_F32 ? 4 : kv_type == QUIRE_KV_BF16 ? 2 : 1;
}

/* The first key row r reads (its window's start). */
static inline int64_t pa_first_key(int64_t r, int64_t window) {
    return window > 0 && r >= window ? r - window + 1 : 0;
}

/* Scores of rows [x0, x0 + rb) (rb <= PA_RB) against one transposed tile kt [d, PA_KT]:
 * into s + x * ns + k0, PA_KT of them per row. */
static inline void pa_tile_scores(const float *qs, int64_t d, const float *kt, int64_t x0,
                                  int64_t rb, float *s, int64_t ns, int64_t k0) {
    vwf acc[PA_RB][2];
    for (int64_t r = 0; r < PA_RB; ++r) acc[r][0] = acc[r][1] = (vwf){0};
    const float *q0 = qs + x0 * d;
    if (rb == PA_RB) { /* the common case, unrolled over the rows */
        const float *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
        for (int64_t i = 0; i < d; ++i) {
            const vwf a = loadw(kt + i * PA_KT), b = loadw(kt + i * PA_KT + VW);
            vwf qv = splatw(q0[i]);
            acc[0][0] = fmaw(qv, a, acc[0][0]), acc[0][1] = fmaw(qv, b, acc[0][1]);
            qv = splatw(q1[i]);
            acc[1][0] = fmaw(qv, a, acc[1][0]), acc[1][1] = fmaw(qv, b, acc[1][1]);
            qv = splatw(q2[i]);
            acc[2][0] = fmaw(qv, a, acc[2][0]), acc[2][1] = fmaw(qv, b, acc[2][1]);
            qv = splatw(q3[i]);
            acc[3][0] = fmaw(qv, a, acc[3][0]), acc[3][1] = fmaw(qv, b, acc[3][1]);
        }
    } else {
        for (int64_t i = 0; i < d; ++i) {
            const vwf a = loadw(kt + i * PA_KT), b = loadw(kt + i * PA_KT + VW);
            for (int64_t r = 0; r < rb; ++r) {
                const vwf qv = splatw(q0[r * d + i]);
                acc[r][0] = fmaw(qv, a, acc[r][0]);
                acc[r][1] = fmaw(qv, b, acc[r][1]);
            }
        }
    }
    for (int64_t r = 0; r < rb; ++r) {
        float *row = s + (x0 + r) * ns + k0;
        storew(row, acc[r][0]);
        storew(row + VW, acc[r][1]);
    }
}

/* os[x][c0 .. c0 + nv * VW) += the tile's weights times its m value rows (vs, vst
 * floats apart), for rows [x0, x0 + rb). */
static inline __attribute__((always_inline)) void pa_tile_values(
    const float *s, int64_t ns, int64_t k0, const float *vs, int64_t vst, int64_t m,
    int64_t d, int64_t x0, int64_t rb, int64_t c0, int nv, float *os) {
    vwf acc[PA_RB][PA_NV];
    for (int64_t r = 0; r < rb; ++r)
        for (int c = 0; c < nv; ++c) acc[r][c] = loadw(os + (x0 + r) * d + c0 + c * VW);
    for (int64_t t = 0; t < m; ++t) {
        vwf v[PA_NV];
        for (int c = 0; c < nv; ++c) v[c] = loadw(vs + t * vst + c0 + c * VW);
        for (int64_t r = 0; r < rb; ++r) {
            const vwf p = splatw(s[(x0 + r) * ns + k0 + t]);
            for (int c = 0; c < nv; ++c) acc[r][c] = fmaw(p, v[c], acc[r][c]);
        }
    }
    for (int64_t r = 0; r < rb; ++r)
        for (int c = 0; c < nv; ++c) storew(os + (x0 + r) * d + c0 + c * VW, acc[r][c]);
}

/* Rows [x0, x0 + rb) of one tile's values: PA_NV-vector slabs of the head dimension,
 * then the scalar rest. */
static inline __attribute__((always_inline)) void pa_rows_values(
    const float *s, int64_t ns, int64_t k0, const float *vt, int64_t vst, int64_t m,
    int64_t d, int64_t x0, int64_t rb, float *os) {
    const int64_t dv = d - d % VW;
    int64_t c0 = 0;
    for (; c0 + PA_NV * VW <= dv; c0 += PA_NV * VW)
        pa_tile_values(s, ns, k0, vt, vst, m, d, x0, rb, c0, PA_NV, os);
    if (c0 < dv)
        pa_tile_values(s, ns, k0, vt, vst, m, d, x0, rb, c0, (int)((dv - c0) / VW), os);
    for (int64_t x = x0; x < x0 + rb; ++x)
        for (int64_t i = dv; i < d; ++i) {
            float total = os[x * d + i];
            for (int64_t t = 0; t < m; ++t) total += s[x * ns + k0 + t] * vt[t * vst + i];
            os[x * d + i] = total;
        }
}

/* What the items share, prepared once per call: every key tile transposed, and the
 * values as float32 rows. */
struct pa_prepared {
    /* tile j of prompt p, KV head g: [d, PA_KT] at kt + ((tile_base[p] + j) * hkv + g)
     * * d * PA_KT, positions past the prompt's end zero */
    float *kt;
    const int64_t *tile_base;
    /* position t of prompt p, KV head g: d floats at v + (v_base[p] + t) * v_stride + g * d */
    const float *v;
    const int64_t *v_base;
    int64_t v_stride;
};

/* Key tile j of sequence p (its first token row `first`, n positions of keys), for
 * every KV head: transposed into dst, [d, PA_KT] per head one after another; with
 * v_rows, its value rows widened (or copied) there too (hkv * d floats per position).
 * A position's heads are one contiguous row, read whole, the next rows prefetched (a
 * projection's stride or a page apart, too far for the hardware's prefetcher). */
static void pa_prepare_tile(const struct pa_args *a, int64_t p, int64_t first, int64_t n,
                            int64_t j, float *dst, float *v_rows) {
    const int64_t d = a->d, width = a->hkv * d, k0 = j * PA_KT;
    const int64_t m = n - k0 < PA_KT ? n - k0 : PA_KT;
    const int64_t elem = pa_elem(a->kv_type), ahead = 4;
    const int64_t bytes = kv_slot_elems(a->kv_type, a->hkv, d) * elem;
    float row[width];
    for (int64_t t = 0; t < PA_KT; ++t) {
        if (t + ahead < m) {
            const int64_t next = pa_key_row(a, p, first, k0 + t + ahead) * elem;
            for (int64_t c = 0; c < bytes; c += 64) {
                __builtin_prefetch((const char *)a->k + next + c);
                if (v_rows != NULL)
                    __builtin_prefetch((const char *)a->v + next + c);
            }
        }
        const int64_t at = t < m ? pa_key_row(a, p, first, k0 + t) : 0;
        if (t < m)
            pa_widen(a->k, a->kv_type, at, a->hkv, d, row);
        else
            memset(row, 0, sizeof(float) * width);
        for (int64_t g = 0; g < a->hkv; ++g)
            for (int64_t i = 0; i < d; ++i) dst[(g * d + i) * PA_KT + t] = row[g * d + i];
        if (v_rows != NULL && t < m)
            pa_widen(a->v, a->kv_type, at, a->hkv, d, v_rows + (k0 + t) * width);
    }
}

/* Positions [r0, r1) of sequence p (its new tokens from row `first`, the first at
 * position `prefix`; their out rows from `out_row`) for the query heads of KV head g.
 * scratch: pa_scratch floats. */
static void pa_item(const struct pa_args *a, const struct pa_prepared *pre, int64_t p,
                    int64_t first, int64_t prefix, int64_t out_row, int64_t g, int64_t r0,
                    int64_t r1, float *scratch) {
    const int64_t d = a->d, groups = a->hq / a->hkv, qb = r1 - r0, rows = groups * qb;
    const int64_t k_begin = pa_first_key(r0, a->window) / PA_KT * PA_KT;
    const int64_t ns = (r1 + PA_KT - 1) / PA_KT * PA_KT; /* score row stride */
    float *qs = scratch, *s = qs + rows * d, *os = s + rows * ns;
    const float *tiles = pre->kt + pre->tile_base[p] * a->hkv * d * PA_KT;
    const float *vs = pre->v + pre->v_base[p] * pre->v_stride + g * d;
    const int64_t vst = pre->v_stride;
    /* query rows x = head-in-group * qb + position - r0, widened */
    for (int64_t x = 0; x < rows; ++x) {
        const int64_t h = g * groups + x / qb, r = r0 + x % qb;
        pa_widen(a->q, a->bf16 ? QUIRE_KV_BF16 : QUIRE_KV_F32,
                 (first + r - prefix) * a->q_stride + h * d, 1, d, qs + x * d);
    }
    /* scores, a tile at a time */
    for (int64_t k0 = k_begin; k0 < r1; k0 += PA_KT) {
        const float *kt = tiles + ((k0 / PA_KT) * a->hkv + g) * d * PA_KT;
        for (int64_t x0 = 0; x0 < rows; x0 += PA_RB)
            pa_tile_scores(qs, d, kt, x0, rows - x0 < PA_RB ? rows - x0 : PA_RB, s, ns, k0);
    }
    /* softmax over each row's span: scores outside it set to -inf, so it runs over
     * whole tiles (no scalar tail) and leaves them zero, and the values pass can run
     * every row of a group over the same keys */
    for (int64_t x = 0; x < rows; ++x) {
        const int64_t r = r0 + x % qb, lo = pa_first_key(r, a->window);
        float *row = s + x * ns;
        for (int64_t t = k_begin; t < lo; ++t) row[t] = -INFINITY;
        for (int64_t t = r + 1; t < ns; ++t) row[t] = -INFINITY;
        softmax_row(row + k_begin, ns - k_begin, a->scale);
    }
    /* the weighted sum of values, the same tiles */
    memset(os, 0, sizeof(float) * rows * d);
    for (int64_t k0 = k_begin; k0 < r1; k0 += PA_KT) {
        const int64_t m = r1 - k0 < PA_KT ? r1 - k0 : PA_KT;
        const float *vt = vs + k0 * vst;
        for (int64_t x0 = 0; x0 < rows; x0 += PA_RB) {
            if (rows - x0 >= PA_RB) /* constant rows: the accumulators stay in registers */
                pa_rows_values(s, ns, k0, vt, vst, m, d, x0, PA_RB, os);
            else
                pa_rows_values(s, ns, k0, vt, vst, m, d, x0, rows - x0, os);
        }
    }
    /* out rows */
    for (int64_t x = 0; x < rows; ++x) {
        const int64_t h = g * groups + x / qb, r = r0 + x % qb;
        const int64_t at = ((out_row + r - prefix) * a->hq + h) * d;
        if (a->bf16) {
            uint16_t *dst = (uint16_t *)a->out + at;
            for (int64_t i = 0; i < d; ++i) dst[i] = f32_to_bf16(os[x * d + i]);
        } else {
            memcpy((float *)a->out + at, os + x * d, sizeof(float) * d);
        }
    }
}

/* Floats of scratch an item of a prompt of up to `longest` tokens takes. */
static int64_t pa_scratch(int64_t groups, int64_t d, int64_t longest) {
    const int64_t rows = groups * PA_QB, ns = (longest + PA_KT - 1) / PA_KT * PA_KT;
    return rows * d * 2 + rows * ns;
}

/* The team prepares the tiles, then takes the items. ctx NULL: fresh prompts (ctx =
 * lens). Returns 0; 1 when the shapes disagree; 2 when memory is short (nothing
 * written: the caller takes the torch path). */
static int chunk_attention(const struct pa_args *a, const int64_t *starts,
                           const int64_t *lens, const int64_t *ctx, int64_t num_seqs) {
    const int64_t hkv = a->hkv, d = a->d;
    if (hkv <= 0 || d <= 0 || a->hq % hkv || num_seqs <= 0)
        return 1;
    if (ctx == NULL)
        ctx = lens;
    /* per sequence: first item, first out row, first tile, first gathered value row */
    int64_t *base = malloc(sizeof(int64_t) * 4 * (size_t)(num_seqs + 1));
    if (base == NULL)
        return 2;
    int64_t *first_item = base, *out_rows = base + num_seqs + 1;
    int64_t *tile_base = out_rows + num_seqs + 1, *v_base = tile_base + num_seqs + 1;
    int64_t longest = 0;
    first_item[0] = out_rows[0] = tile_base[0] = v_base[0] = 0;
    for (int64_t p = 0; p < num_seqs; ++p) {
        if (lens[p] <= 0 || ctx[p] < lens[p]) {
            free(base);
            return 1;
        }
        longest = ctx[p] > longest ? ctx[p] : longest;
        first_item[p + 1] = first_item[p] + (lens[p] + PA_QB - 1) / PA_QB * hkv;
        out_rows[p + 1] = out_rows[p] + lens[p];
        tile_base[p + 1] = tile_base[p] + (ctx[p] + PA_KT - 1) / PA_KT;
        v_base[p + 1] = v_base[p] + ctx[p];
    }
    const int64_t items = first_item[num_seqs], tiles = tile_base[num_seqs];
    const int64_t per_thread = pa_scratch(a->hq / hkv, d, longest);
    const int64_t threads = omp_get_max_threads();
    const int64_t kt_floats = tiles * hkv * d * PA_KT;
    /* float32 rows of a projection are read where they are; bfloat16 ones and pages are
     * gathered into float32 rows of hkv * d */
    const int gather = a->kv_type != QUIRE_KV_F32 || a->tables != NULL;
    const int64_t v_floats = gather ? v_base[num_seqs] * hkv * d : 0;
    float *scratch = quire_thread_scratch((size_t)(threads * per_thread + kt_floats + v_floats));
    if (scratch == NULL) {
        free(base);
        return 2;
    }
    float *kt = scratch + threads * per_thread, *v_rows = gather ? kt + kt_floats : NULL;
    const struct pa_prepared pre = {
        kt, tile_base, gather ? v_rows : (const float *)a->v, gather ? v_base : starts,
        gather ? hkv * d : a->kv_stride};
#pragma omp parallel
    {
        int64_t p = 0;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            while (tile_base[p + 1] <= tile) ++p;
            while (tile_base[p] > tile) --p;
            pa_prepare_tile(a, p, starts[p], ctx[p], tile - tile_base[p],
                            kt + tile * hkv * d * PA_KT,
                            v_rows == NULL ? NULL : v_rows + v_base[p] * hkv * d);
        }
        float *mine = scratch + omp_get_thread_num() * per_thread;
        p = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; ++i) {
            while (first_item[p + 1] <= i) ++p; /* items ascend per thread */
            while (first_item[p] > i) --p;
            const int64_t local = i - first_item[p], blocks = (lens[p] + PA_QB - 1) / PA_QB;
            const int64_t block = blocks - 1 - local / hkv, g = local % hkv;
            const int64_t prefix = ctx[p] - lens[p], r0 = prefix + block * PA_QB;
            const int64_t r1 = r0 + PA_QB < ctx[p] ? r0 + PA_QB : ctx[p];
            pa_item(a, &pre, p, starts[p], prefix, out_rows[p], g, r0, r1, mine);
        }
    }
    free(base);
    return 0;
}

/* Fresh prompts, float32 rows; window 0 for none. */
int quire_prompt_attention_f32(const float *q, const float *k, const float *v,
                               int64_t q_stride, int64_t kv_stride, const int64_t *starts,
                               const int64_t *lens, int64_t num_prompts, int64_t hq,
                               int64_t hkv, int64_t d, float scale, int64_t window,
                               float *out) {
    const struct pa_args a = {q, k, v, out, q_stride, kv_stride, hq, hkv, d, window, scale,
                              0, NULL, 0, 1, QUIRE_KV_F32};
    return chunk_attention(&a, starts, lens, NULL, num_prompts);
}

/* Fresh prompts, bfloat16 rows and out. */
int quire_prompt_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                int64_t q_stride, int64_t kv_stride, const int64_t *starts,
                                const int64_t *lens, int64_t num_prompts, int64_t hq,
                                int64_t hkv, int64_t d, float scale, int64_t window,
                                uint16_t *out) {
    const struct pa_args a = {q, k, v, out, q_stride, kv_stride, hq, hkv, d, window, scale,
                              1, NULL, 0, 1, QUIRE_KV_BF16};
    return chunk_attention(&a, starts, lens, NULL, num_prompts);
}

/* Chunks over pages (their keys and values already written), float32 cache and rows;
 * ctx[p]: the sequence's length with its chunk. */
int quire_chunk_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                              const float *v_cache, const int64_t *tables,
                              int64_t table_stride, int64_t block_size,
                              const int64_t *starts, const int64_t *lens, const int64_t *ctx,
                              int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d,
                              float scale, int64_t window, float *out) {
    const struct pa_args a = {q, k_cache, v_cache, out, q_stride, 0, hq, hkv, d, window,
                              scale, 0, tables, table_stride, block_size, QUIRE_KV_F32};
    return chunk_attention(&a, starts, lens, ctx, num_seqs);
}

/* The same with a bfloat16 cache, rows and out. */
int quire_chunk_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                               const uint16_t *v_cache, const int64_t *tables,
                               int64_t table_stride, int64_t block_size,
                               const int64_t *starts, const int64_t *lens,
                               const int64_t *ctx, int64_t num_seqs, int64_t hq,
                               int64_t hkv, int64_t d, float scale, int64_t window,
                               uint16_t *out) {
    const struct pa_args a = {q, k_cache, v_cache, out, q_stride, 0, hq, hkv, d, window,
                              scale, 1, tables, table_stride, block_size, QUIRE_KV_BF16};
    return chunk_attention(&a, starts, lens, ctx, num_seqs);
}

/* Float32 rows and out over a bfloat16 cache (a float32 model with bfloat16 pages):
 * the pages widened as the bfloat16 entry widens them, the rows read as the float32
 * entry reads them. */
int quire_chunk_attention_f32_bf16kv(const float *q, int64_t q_stride,
                                     const uint16_t *k_cache, const uint16_t *v_cache,
                                     const int64_t *tables, int64_t table_stride,
                                     int64_t block_size, const int64_t *starts,
                                     const int64_t *lens, const int64_t *ctx,
                                     int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d,
                                     float scale, int64_t window, float *out) {
    const struct pa_args a = {q, k_cache, v_cache, out, q_stride, 0, hq, hkv, d, window,
                              scale, 0, tables, table_stride, block_size, QUIRE_KV_BF16};
    return chunk_attention(&a, starts, lens, ctx, num_seqs);
}

/* Float32 rows and out over int8 or fp8 pages (kv_type QUIRE_KV_I8 or QUIRE_KV_FP8,
 * [slots, hkv, d + d / 8] bytes): each position's head rows dequantised (element times
 * its group's scale, in float32, as quire.ops.kv_quant.dequantize) as they are gathered. */
int quire_chunk_attention_quant(int32_t kv_type, const float *q, int64_t q_stride,
                                const uint8_t *k_cache, const uint8_t *v_cache,
                                const int64_t *tables, int64_t table_stride,
                                int64_t block_size, const int64_t *starts,
                                const int64_t *lens, const int64_t *ctx, int64_t num_seqs,
                                int64_t hq, int64_t hkv, int64_t d, float scale,
                                int64_t window, float *out) {
    if (!kv_quantized(kv_type) || kv_type > QUIRE_KV_FP8 || d % QUIRE_KV_GROUP)
        return 1;
    const struct pa_args a = {q, k_cache, v_cache, out, q_stride, 0, hq, hkv, d, window,
                              scale, 0, tables, table_stride, block_size, kv_type};
    return chunk_attention(&a, starts, lens, ctx, num_seqs);
}
