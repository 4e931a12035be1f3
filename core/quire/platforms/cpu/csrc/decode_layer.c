/*
 * A whole pre-norm decoder layer for one token of one sequence, float32 (cpu
 * platform): the step of a lone decoding sequence. The layer is described by a
 * struct quire_layer_desc (the norms it has, its activation), built from the
 * description the model publishes (quire/ops/layer_spec.py), so every family with
 * this shape (Llama, Qwen3's q/k norms, Gemma's sandwich norms and GELU) runs here.
 *
 * Run op by op from Python, such a layer is ~20 small torch operators and C calls;
 * for SmolLM2-135M their dispatch took ~290 us of a ~600 us layer. Here it is one call
 * and one OpenMP parallel region, the phases separated by the team's barriers:
 *
 *   h = residual + x                  (the residual stream; x alone on the first layer)
 *   a = rms_norm(h) * w_in
 *   q, k, v = W_qkv a (+ bias)        rows over threads
 *   q, k = rms_norm per head          (when the layer has q/k norms)
 *   q, k = rotary(q, k)               x * cos + roll(x, D/2) * sin, the model's tables
 *   cache[slot] = k, v
 *   o = attention(q, the sequence's pages)   query heads over threads
 *   o = rms_norm(o) * w_attn_out      (when it has one: Gemma's post-attention norm)
 *   h2 = h + W_o o (+ bias)           rows over threads; h2 is returned as the residual
 *   a2 = rms_norm(h2) * w_pre_mlp
 *   out = W_down (act(W_gate a2) * W_up a2)   rows over threads; act SiLU or GELU-tanh
 *   out = rms_norm(out) * w_mlp_out   (when it has one)
 *
 * Each thread computes the norms before the QKV and gate/up products itself, into its
 * own copy of the rows (and keeps its own copy of the residual stream h), so that no
 * thread waits for another there; a quantised gate/up pair gives each thread the same
 * share of gate and up rows, so the activation follows without a barrier too.
 * quire_decode_stack_f32 runs a lone sequence's step through consecutive layers in one
 * call and one parallel region (quire/platforms/cpu/fused_stack.py).
 *
 * A layer whose MLP is not a gated pair of products (mixture of experts) says
 * mlp_external: the layer then stops at a2, returned in out, and the caller runs the MLP.
 *
 * KV pages may hold bfloat16, int8 or fp8 (desc->kv_type, which the caller sets for each
 * step: a bfloat16 model's, or kv_cache_dtype's): this token's key and value are rounded
 * (or quantised, a scale per KV head) into them and the attention reads them widened;
 * everything else stays float32, the caller converting the layer's input and output rows.
 *
 * The same operations as the model's op-by-op layer with the cpu platform's kernels
 * (compact_gemv.c, rms_norm.c, paged_decode.c), in the same order; the products and
 * norms sum in their own orders, so results agree with the op-by-op path to float32
 * rounding. Norm weights arrive with any offset (Gemma's 1 + w) already added.
 * quire/platforms/cpu/fused_decode.py decides which layers qualify.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_kernels.h"

/* What distinguishes one family's layer from another's; NULL norms are absent. */
struct quire_layer_desc {
    float eps;             /* every norm's */
    int32_t activation;    /* QUIRE_ACT_SILU or QUIRE_ACT_GELU_TANH */
    const float *norm_in, *norm_pre_mlp;   /* [hidden] */
    const float *q_norm, *k_norm;          /* [d], over each head; both or neither */
    const float *attn_out_norm, *mlp_out_norm; /* [hidden] */
    int32_t mlp_external;  /* stop at the MLP's input; gate_up and down may be NULL */
    int32_t kv_type;       /* what the KV pages hold: QUIRE_KV_F32, _BF16, _I8 or _FP8 */
};

#define QUIRE_ACT_SILU 0
#define QUIRE_ACT_GELU_TANH 1

/* A linear layer's compact weight (quire/platforms/cpu/compact.py's layout); with format
 * QUIRE_FORMAT_PANELS, its float32 panels (NativeKernels.pack_panels) in codes; with
 * QUIRE_FORMAT_QUANT, num_parts quantised parts (struct quire_qpart, in output order) in
 * codes: a GGUF layer's blocks as stored (quire/quantization), q, k and v each in its
 * own format. A layer may mix the kinds. */
struct quire_linear {
    int32_t format;
    int64_t out_features, in_features;
    const void *codes;
    const float *scales, *offsets, *bias; /* offsets: a4 only; bias may be NULL */
    int64_t num_parts;                    /* QUIRE_FORMAT_QUANT only */
};

#define QUIRE_FORMAT_PANELS 3
#define QUIRE_FORMAT_QUANT 4

/* Each thread's share of y = W x (+ bias) for a quantised weight's parts, m rows of x
 * (in_features apart) into m rows of y (out_features apart): of every part the rows
 * [rows * t / team, rows * (t + 1) / team), each block read once for all m rows. No
 * barrier: a caller that reads other threads' outputs places one. */
static void quant_parts_share(const struct quire_linear *w, const float *x, int64_t m,
                              float *y) {
    const struct quire_qpart *part = w->codes;
    for (int64_t p = 0, at = 0; p < w->num_parts; at += part[p].rows, p++) {
        const float *bias = w->bias ? w->bias + at : NULL;
        if (part[p].acts == QUIRE_ACTS_Q8)
            quire_quant_rows_q8_team(part[p].fmt, x, m, w->in_features, part[p].w,
                                     part[p].w_stride, part[p].rows, bias, y + at,
                                     w->out_features);
        else if (part[p].acts == QUIRE_ACTS_BF16)
            quire_quant_rows_bf16_team(part[p].fmt, x, m, w->in_features, part[p].w,
                                       part[p].w_stride, part[p].rows, bias, y + at,
                                       w->out_features);
        else
            quire_quant_rows_team(part[p].fmt, x, m, w->in_features, part[p].w,
                                  part[p].w_stride, part[p].rows, part[p].scales, bias,
                                  y + at, w->out_features);
    }
}

/* y = W x (+ bias) for m rows of x (in_features apart) into m rows of y (out_features
 * apart), weight rows split over the team: each weight row or block read once for all m
 * rows where the kernel takes several (the blocks' direct path, panels); call inside a
 * parallel region. x may be each thread's own copy of the rows. Ends in a barrier. */
static void gemm_rows_team(const struct quire_linear *w, const float *x, int64_t m, float *y) {
    if (w->format == QUIRE_FORMAT_PANELS) {
        quire_panel_gemm_team(x, m, w->in_features, (const float *)w->codes, w->out_features,
                              w->bias, y);
        return;
    }
    if (w->format == QUIRE_FORMAT_QUANT) {
        quant_parts_share(w, x, m, y);
#pragma omp barrier
        return;
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < w->out_features; j++)
        for (int64_t r = 0; r < m; r++) {
            const float v = quire_compact_dot(w->format, x + r * w->in_features,
                                              w->in_features, w->codes, w->scales,
                                              w->offsets, j);
            y[r * w->out_features + j] = w->bias ? v + w->bias[j] : v;
        }
}

/* Whether a part's activations (QUIRE_ACTS_*) are known and their kernel takes it. */
static int acts_fit(int32_t acts, int32_t fmt, int64_t k) {
    switch (acts) {
    case QUIRE_ACTS_F32: return 1;
    case QUIRE_ACTS_Q8: return quire_quant_q8_fits(fmt, k);
    case QUIRE_ACTS_BF16: return quire_quant_rows_bf16_fits(fmt, k);
    default: return 0;
    }
}

/* Whether a quantised weight's parts fit its shape and the kernels. */
static int linear_fits(const struct quire_linear *w) {
    if (w->format != QUIRE_FORMAT_QUANT)
        return 1;
    const struct quire_qpart *part = w->codes;
    int64_t rows = 0;
    for (int64_t p = 0; p < w->num_parts; p++) {
        if (!quire_quant_fits(part[p].fmt, w->in_features) || part[p].rows <= 0 ||
            !acts_fit(part[p].acts, part[p].fmt, w->in_features))
            return 0;
        rows += part[p].rows;
    }
    return w->num_parts > 0 && rows == w->out_features;
}

/* out = silu(g) * u = g / (1 + e^-g) * u over n values. Eight at a time with exp8 (one
 * expf call per value was a tenth of a 64-row decode step); exp8 takes x <= 88, and
 * e^-g past that overflows float32 anyway, so -g is capped there: the result is then
 * g / 1.7e38 * u instead of -0 * u, both zero to any tolerance. */
static void silu_mul(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f gv = load8(g + i);
        const v8f neg = -gv;
        const v8i below = (v8i)(neg < 88.0f); /* all ones where -g < 88 */
        const v8f capped = (v8f)(((v8i)neg & below) | ((v8i)((v8f){0} + 88.0f) & ~below));
        const v8f v = gv / (1.0f + exp8(capped)) * load8(u + i);
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < n; i++)
        out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* out = gelu_tanh(g) * u = 0.5 g (1 + tanh(c (g + 0.044715 g^3))) * u over n values,
 * tanh(y) = 1 - 2 / (e^2y + 1); 2y is capped at 88 (tanh is 1 to float32 there long
 * before), and exp8 flushes below -87 to 0 (tanh -1). */
static void gelu_tanh_mul(const float *g, const float *u, int64_t n, float *out) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f gv = load8(g + i);
        const v8f y2 = 2.0f * c * (gv + 0.044715f * gv * gv * gv);
        const v8i below = (v8i)(y2 < 88.0f);
        const v8f capped = (v8f)(((v8i)y2 & below) | ((v8i)((v8f){0} + 88.0f) & ~below));
        const v8f t = 1.0f - 2.0f / (exp8(capped) + 1.0f);
        const v8f v = 0.5f * gv * (1.0f + t) * load8(u + i);
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < n; i++)
        out[i] = 0.5f * g[i] * (1.0f + tanhf(c * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
}

static void act_mul(int32_t activation, const float *g, const float *u, int64_t n,
                    float *out) {
    if (activation == QUIRE_ACT_GELU_TANH)
        gelu_tanh_mul(g, u, n, out);
    else
        silu_mul(g, u, n, out);
}

/* Each of `heads` rows of d normalised in place by the per-head weight (q/k norms). */
static void norm_heads(float *x, int64_t heads, int64_t d, const float *weight, float eps) {
    for (int64_t h = 0; h < heads; h++)
        quire_rms_norm_row(x + h * d, weight, eps, d, x + h * d);
}

/* Whether the description is one this file computes. */
static int desc_fits(const struct quire_layer_desc *desc) {
    return desc->norm_in && desc->norm_pre_mlp && !desc->q_norm == !desc->k_norm &&
           (desc->activation == QUIRE_ACT_SILU || desc->activation == QUIRE_ACT_GELU_TANH) &&
           !(desc->mlp_external && desc->mlp_out_norm);
}

/* x * cos + roll(x, d / 2) * sin over each of `heads` rows of d, in place. */
static void rotate(float *x, int64_t heads, int64_t d, const float *cos, const float *sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *r = x + h * d;
        for (int64_t i = 0; i < half; i++) {
            const float a = r[i], b = r[i + half];
            const float lo = a * cos[i], lo2 = b * sin[i];
            const float hi = b * cos[i + half], hi2 = a * sin[i + half];
            r[i] = lo + lo2;
            r[i + half] = hi + hi2;
        }
    }
}

/* A row's q and k heads (hq + hkv rows of d at q) normalised by the layer's q/k norms,
 * when it has them, and rotated. */
static void norm_rotate_qk(const struct quire_layer_desc *desc, float *q, int64_t hq,
                           int64_t hkv, int64_t d, const float *cos, const float *sin) {
    if (desc->q_norm) {
        norm_heads(q, hq, d, desc->q_norm, desc->eps);
        norm_heads(q + hq * d, hkv, d, desc->k_norm, desc->eps);
    }
    rotate(q, hq + hkv, d, cos, sin);
}

/* Whether a quantised gate_up's parts are its gate rows then its up rows, `inter` each:
 * quant_parts_share then gives each thread the same share of both, so the thread can
 * apply the activation to its share without waiting for the others. */
static int pairs_split_alike(const struct quire_linear *gate_up, int64_t inter) {
    if (gate_up->format != QUIRE_FORMAT_QUANT || gate_up->num_parts != 2)
        return 0;
    const struct quire_qpart *part = gate_up->codes;
    return part[0].rows == inter && part[1].rows == inter;
}

/* out = W_down (act(W_gate a) * W_up a) for `rows` rows of a (then its own norm, when the
 * layer has one), each product on the weight's compact encoding, its blocks or its
 * panels. a may be each thread's own copy; gu: 2 inter floats a row of scratch, act:
 * inter. Team function; ends in a barrier. */
static void mlp_rows_team(const struct quire_layer_desc *desc,
                          const struct quire_linear *gate_up, const struct quire_linear *down,
                          const float *a, int64_t rows, int64_t hidden, int64_t inter,
                          float *gu, float *act, float *out) {
    if (pairs_split_alike(gate_up, inter)) {
        /* this thread's gate and up rows, then their activation, one barrier for both */
        const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = inter * t / team, hi = inter * (t + 1) / team;
        quant_parts_share(gate_up, a, rows, gu);
        for (int64_t r = 0; r < rows && lo < hi; r++)
            act_mul(desc->activation, gu + r * 2 * inter + lo, gu + r * 2 * inter + inter + lo,
                    hi - lo, act + r * inter + lo);
#pragma omp barrier
    } else if (gate_up->format == QUIRE_FORMAT_PANELS || gate_up->format == QUIRE_FORMAT_QUANT ||
               rows > 1) {
        gemm_rows_team(gate_up, a, rows, gu);
#pragma omp for schedule(static) collapse(2)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i0 = 0; i0 < inter; i0 += 8)
                act_mul(desc->activation, gu + r * 2 * inter + i0,
                        gu + r * 2 * inter + inter + i0, inter - i0 < 8 ? inter - i0 : 8,
                        act + r * inter + i0);
    } else {
        /* one row on a compact encoding: eight gate/up pairs at a time, so that the
         * activation takes eight lanes */
#pragma omp for schedule(static)
        for (int64_t i0 = 0; i0 < inter; i0 += 8) {
            const int64_t n8 = inter - i0 < 8 ? inter - i0 : 8;
            float g[8], u[8];
            for (int64_t k = 0; k < n8; k++) {
                const int64_t i = i0 + k;
                g[k] = quire_compact_dot(gate_up->format, a, hidden, gate_up->codes,
                                         gate_up->scales, gate_up->offsets, i);
                u[k] = quire_compact_dot(gate_up->format, a, hidden, gate_up->codes,
                                         gate_up->scales, gate_up->offsets, inter + i);
                if (gate_up->bias) {
                    g[k] += gate_up->bias[i];
                    u[k] += gate_up->bias[inter + i];
                }
            }
            act_mul(desc->activation, g, u, n8, act + i0);
        }
    }
    gemm_rows_team(down, act, rows, out);
    if (desc->mlp_out_norm) {
#pragma omp single
        for (int64_t r = 0; r < rows; r++)
            quire_rms_norm_row(out + r * hidden, desc->mlp_out_norm, desc->eps, hidden,
                               out + r * hidden);
    }
}

/* One decoder layer of the one-sequence path: what it computes (desc), its weights, its
 * KV pages (the layer's two halves, [num_blocks * block_size, hkv, d]), its attention
 * window (0: none) and scale. An element of quire_decode_stack_f32's array. */
struct quire_stack_layer {
    const struct quire_layer_desc *desc;
    const struct quire_linear *qkv, *o, *gate_up, *down;
    void *k_cache, *v_cache;
    int64_t window;
    float scale;
};

/* The step every layer of a call shares: its rows, the sequence's pages and the heads. */
struct rows_step {
    int64_t rows, hidden, hq, hkv, d, cos_stride, seq_len, block_size;
    const int64_t *slots, *table;
};

/* Whether a layer fits the step: its description, shapes and kernels; its MLP's width
 * (0 for an external MLP) in *inter. */
static int layer_fits(const struct quire_stack_layer *l, const struct rows_step *s,
                      int64_t *inter) {
    const struct quire_layer_desc *desc = l->desc;
    const struct quire_linear *qkv = l->qkv, *o = l->o, *gate_up = l->gate_up,
                              *down = l->down;
    const int external = desc->mlp_external;
    const int64_t hidden = s->hidden, hq = s->hq, hkv = s->hkv, d = s->d;
    *inter = external ? 0 : gate_up->out_features / 2;
    return desc_fits(desc) && qkv->in_features == hidden &&
           qkv->out_features == (hq + 2 * hkv) * d && o->in_features == hq * d &&
           o->out_features == hidden &&
           (external || (gate_up->in_features == hidden && gate_up->out_features % 2 == 0 &&
                         down->in_features == *inter && down->out_features == hidden)) &&
           linear_fits(qkv) && linear_fits(o) &&
           (external || (linear_fits(gate_up) && linear_fits(down)));
}

/* Scratch the team shares: one layer's products, and each thread's attention scores. */
struct rows_scratch {
    float *qkv_out, *attn, *o_out, *act, *gu, *scores;
    int64_t scores_each; /* floats of scores a thread (quire_attend_rows_team's) */
};

/*
 * One layer for the step's rows, inside a parallel region (see quire_decode_rows_f32).
 * x: the layer's input rows; res_in: the residual stream before it (NULL on the model's
 * first layer), which may be h. Each thread keeps its own copy of the residual stream
 * (h) and of the normed rows (normed), so that the norms before the QKV and gate/up
 * products need no barrier; h holds the layer's residual stream on return, and the
 * master thread writes it to residual_out when that is not NULL. out: the layer's
 * output, written by the team. Ends in a barrier.
 */
static void rows_layer_team(const struct quire_stack_layer *l, const struct rows_step *s,
                            const float *cos, const float *sin, const float *x,
                            const float *res_in, const struct rows_scratch *sc, float *h,
                            float *normed, float *out, float *residual_out) {
    const struct quire_layer_desc *desc = l->desc;
    const int64_t rows = s->rows, hidden = s->hidden, hq = s->hq, hkv = s->hkv, d = s->d;
    const int64_t nqkv = l->qkv->out_features;
    const int64_t inter = desc->mlp_external ? 0 : l->gate_up->out_features / 2;
    const float eps = desc->eps;
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * hidden;
        const float *xr = x + r * hidden;
        if (res_in)
            for (int64_t i = 0; i < hidden; i++)
                hr[i] = res_in[r * hidden + i] + xr[i];
        else
            memcpy(hr, xr, sizeof(float) * hidden);
        quire_rms_norm_row(hr, desc->norm_in, eps, hidden, normed + r * hidden);
    }
    gemm_rows_team(l->qkv, normed, rows, sc->qkv_out);
#pragma omp single
    for (int64_t r = 0; r < rows; r++) {
        float *qr = sc->qkv_out + r * nqkv;
        norm_rotate_qk(desc, qr, hq, hkv, d, cos + r * s->cos_stride,
                       sin + r * s->cos_stride);
        store_kv_row(l->k_cache, desc->kv_type, s->slots[r], hkv, d, qr + hq * d);
        store_kv_row(l->v_cache, desc->kv_type, s->slots[r], hkv, d, qr + (hq + hkv) * d);
    }
    {
        int64_t lens[rows]; /* row r attends [0, seq_len - rows + r], one block table */
        for (int64_t r = 0; r < rows; r++) lens[r] = s->seq_len - rows + 1 + r;
        quire_attend_rows_team(desc->kv_type, sc->qkv_out, nqkv, l->k_cache, l->v_cache,
                               s->table, 0, lens, rows, l->window, hq, hkv, d, s->block_size,
                               l->scale, sc->scores + omp_get_thread_num() * sc->scores_each,
                               sc->attn, hq * d);
    }
    gemm_rows_team(l->o, sc->attn, rows, sc->o_out);
    for (int64_t r = 0; r < rows; r++) {
        const float *orow = sc->o_out + r * hidden;
        float *hr = h + r * hidden, *nr = normed + r * hidden;
        if (desc->attn_out_norm) {
            quire_rms_norm_row(orow, desc->attn_out_norm, eps, hidden, nr);
            orow = nr;
        }
        for (int64_t i = 0; i < hidden; i++)
            hr[i] += orow[i];
        quire_rms_norm_row(hr, desc->norm_pre_mlp, eps, hidden, nr);
    }
    if (residual_out) {
#pragma omp master
        memcpy(residual_out, h, sizeof(float) * rows * hidden);
    }
    if (desc->mlp_external) {
#pragma omp master
        memcpy(out, normed, sizeof(float) * rows * hidden);
#pragma omp barrier
        return;
    }
    mlp_rows_team(desc, l->gate_up, l->down, normed, rows, hidden, inter, sc->gu, sc->act,
                  out);
}

/* Layers 0 .. n-1 of layers for one step (quire_decode_stack_f32 and _rows_f32). */
static int decode_stack(int64_t n, const struct quire_stack_layer *layers,
                        const struct rows_step *s, const float *x, const float *residual,
                        const float *const *cos, const float *const *sin, float *out,
                        float *residual_out) {
    const int64_t rows = s->rows, hidden = s->hidden, hq = s->hq, hkv = s->hkv, d = s->d;
    if (n < 1 || rows < 1 || hidden <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 ||
        d % 2 || s->seq_len < rows || s->cos_stride < d)
        return 1;
    int64_t nqkv = 0, inter = 0, longest = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t li;
        /* an external MLP hands the layer back to the caller: the last layer only */
        if (!layer_fits(&layers[i], s, &li) || (li == 0 && i + 1 < n))
            return 1;
        const int64_t window = layers[i].window;
        const int64_t span = (window > 0 && s->seq_len > window) ? window : s->seq_len;
        nqkv = layers[i].qkv->out_features > nqkv ? layers[i].qkv->out_features : nqkv;
        inter = li > inter ? li : inter;
        longest = span > longest ? span : longest;
    }
    const int64_t threads = omp_get_max_threads();
    const int64_t scores = hq * longest; /* longest >= 1: seq_len >= rows >= 1 */
    const int64_t floats = rows * (nqkv + hq * d + hidden + 3 * inter) +
                           threads * (scores + 2 * rows * hidden);
    float *scratch = quire_aligned_alloc(sizeof(float) * (size_t)floats);
    if (scratch == NULL)
        return 2;
    struct rows_scratch sc = {.qkv_out = scratch, .scores_each = scores};
    sc.attn = sc.qkv_out + rows * nqkv;
    sc.o_out = sc.attn + rows * hq * d;
    sc.act = sc.o_out + rows * hidden;
    sc.gu = sc.act + rows * inter;
    sc.scores = sc.gu + 2 * rows * inter;
    float *own = sc.scores + threads * scores;
#pragma omp parallel
    {
        float *h = own + omp_get_thread_num() * 2 * rows * hidden, *normed = h + rows * hidden;
        for (int64_t i = 0; i < n; i++)
            rows_layer_team(&layers[i], s, cos[i], sin[i], i == 0 ? x : out,
                            i == 0 ? residual : h, &sc, h, normed, out,
                            i + 1 == n ? residual_out : NULL);
    }
    free(scratch);
    return 0;
}

/*
 * One sequence's whole decoder layer for its last `rows` tokens (a decode step's one, or
 * speculative decoding's verification: its last token and its drafts). x, residual (NULL
 * on the first layer), out, residual_out: [rows, hidden]; cos, sin: row r at
 * r * cos_stride; k_cache and v_cache: the layer's two halves, [num_blocks * block_size,
 * hkv, d]; slots: where each token's key and value go; table: the sequence's block
 * table; seq_len counts the last token, so token r attends positions
 * [0, seq_len - rows + r]. Every weight is read once for all rows where its kernel takes
 * several, and every token's key and value are written before any token attends.
 * Returns 0; 1 when the shapes disagree; 2 when scratch memory is short.
 */
int quire_decode_rows_f32(
    int64_t rows, const float *x, const float *residual, int64_t hidden,
    const struct quire_layer_desc *desc, const struct quire_linear *qkv,
    const struct quire_linear *o, const struct quire_linear *gate_up,
    const struct quire_linear *down, const float *cos, const float *sin, int64_t cos_stride,
    void *k_cache, void *v_cache, const int64_t *slots, const int64_t *table, int64_t seq_len,
    int64_t block_size, int64_t window, int64_t hq, int64_t hkv, int64_t d, float scale,
    float *out, float *residual_out) {
    const struct quire_stack_layer layer = {desc, qkv, o, gate_up, down, k_cache, v_cache,
                                            window, scale};
    const struct rows_step s = {rows, hidden, hq, hkv, d, cos_stride, seq_len, block_size,
                                slots, table};
    return decode_stack(1, &layer, &s, x, residual, &cos, &sin, out, residual_out);
}

/* quire_decode_rows_f32 for one row: a decode step, this token's key and value at slot. */
int quire_decode_layer_f32(
    const float *x, const float *residual, int64_t hidden,
    const struct quire_layer_desc *desc, const struct quire_linear *qkv,
    const struct quire_linear *o, const struct quire_linear *gate_up,
    const struct quire_linear *down, const float *cos, const float *sin, void *k_cache,
    void *v_cache, int64_t slot, const int64_t *table, int64_t seq_len, int64_t block_size,
    int64_t window, int64_t hq, int64_t hkv, int64_t d, float scale, float *out,
    float *residual_out) {
    return quire_decode_rows_f32(1, x, residual, hidden, desc, qkv, o, gate_up, down, cos, sin,
                                 d, k_cache, v_cache, &slot, table, seq_len, block_size,
                                 window, hq, hkv, d, scale, out, residual_out);
}

/*
 * quire_decode_rows_f32 for n consecutive layers in one call and one parallel region: a
 * lone sequence's step through the whole model (or a pipeline stage's part of it). Layer
 * i's input is layer i - 1's output (x and residual for the first); out and
 * residual_out are the last layer's. cos[i], sin[i]: layer i's rotary rows (models whose
 * layers differ in their rotary, as Gemma 3's local and global ones). Only the last
 * layer may leave its MLP to the caller (mlp_external). Saves the step one call and one
 * parallel region per layer, each a wait for the team, and carries the residual stream
 * in each thread's own copy between layers. Returns as quire_decode_rows_f32.
 */
int quire_decode_stack_f32(int64_t n, const struct quire_stack_layer *layers, int64_t rows,
                           const float *x, const float *residual, int64_t hidden,
                           const float *const *cos, const float *const *sin,
                           int64_t cos_stride, const int64_t *slots, const int64_t *table,
                           int64_t seq_len, int64_t block_size, int64_t hq, int64_t hkv,
                           int64_t d, float *out, float *residual_out) {
    const struct rows_step s = {rows, hidden, hq, hkv, d, cos_stride, seq_len, block_size,
                                slots, table};
    return decode_stack(n, layers, &s, x, residual, cos, sin, out, residual_out);
}

/* A linear layer's weight in 16-column panels: float32 (NativeKernels.pack_panels), or
 * with bf16 set bfloat16 pair panels (NativeKernels.pack_bf16_panels, panel_bf16.c),
 * whose products round their float32 input rows to bfloat16 and sum in float32. */
struct quire_panels {
    int64_t out_features, in_features;
    const void *panels;
    const float *bias; /* may be NULL */
    int32_t bf16;
};

/* Rows a layer's halves take at a time: bounds their scratch whatever the step's size
 * (a 2048-token prompt chunk), and keeps a block's activations in cache. */
#define BLOCK_ROWS 256

/* Whether the shapes fit the layer's front half (up to attention)... */
static int front_fits(int64_t hidden, int64_t hq, int64_t hkv, int64_t d,
                      const struct quire_panels *qkv) {
    return hidden > 0 && hq > 0 && hkv > 0 && d > 0 && d % 2 == 0 &&
           qkv->in_features == hidden && qkv->out_features == (hq + 2 * hkv) * d;
}

/* ...its back half (after attention)... */
static int back_fits(int64_t hidden, const struct quire_layer_desc *desc,
                     const struct quire_panels *o, const struct quire_panels *gate_up,
                     const struct quire_panels *down) {
    return hidden > 0 && o->out_features == hidden &&
           (desc->mlp_external ||
            (gate_up->in_features == hidden && gate_up->out_features % 2 == 0 &&
             down->in_features == gate_up->out_features / 2 && down->out_features == hidden));
}

/* The MLP's intermediate width (0 when it runs outside). */
static int64_t inter_of(const struct quire_layer_desc *desc,
                        const struct quire_panels *gate_up) {
    return desc->mlp_external ? 0 : gate_up->out_features / 2;
}

/* ...and the whole layer, attention between them included. */
static int panels_fit(int64_t hidden, int64_t hq, int64_t hkv, int64_t d,
                      const struct quire_layer_desc *desc, const struct quire_panels *qkv,
                      const struct quire_panels *o, const struct quire_panels *gate_up,
                      const struct quire_panels *down) {
    return front_fits(hidden, hq, hkv, d, qkv) && back_fits(hidden, desc, o, gate_up, down) &&
           hq % hkv == 0 && o->in_features == hq * d;
}

/* The widest input of the layer's products: how wide a row of packed rows gets. */
static int64_t widest_input(int64_t hidden, const struct quire_layer_desc *desc,
                            const struct quire_panels *o, const struct quire_panels *down) {
    const int64_t w = hidden > o->in_features ? hidden : o->in_features;
    return desc->mlp_external || w > down->in_features ? w : down->in_features;
}

/* Scratch floats per row of front_team and back_team: normed, o_out, gate_up, act, and
 * the rows packed for a product (quire_panel_gemm_packed_team), which needs
 * packed_extra floats more in all (its last tile is rounded up to 6 rows). */
static int64_t half_scratch_per_row(int64_t hidden, int64_t inter, int64_t widest) {
    return 2 * hidden + 3 * inter + widest;
}

static int64_t packed_extra(int64_t widest) { return 6 * widest; }

/* y = x W^T (+ bias) over the team, the rows packed first when there are enough (for
 * pair panels: rounded to bfloat16, which takes half the room). */
static void product(const float *x, int64_t m, const struct quire_panels *w, float *y,
                    float *packed) {
    if (w->bf16)
        quire_bf16_gemm_team(x, m, w->in_features, w->panels, w->out_features, w->bias, y,
                             (uint16_t *)packed);
    else if (m >= QUIRE_PACK_MIN_ROWS)
        quire_panel_gemm_packed_team(x, m, w->in_features, w->panels, w->out_features,
                                     w->bias, y, packed);
    else
        quire_panel_gemm_team(x, m, w->in_features, w->panels, w->out_features, w->bias, y);
}

/* The layer up to attention, for rows [0, rows): residual_out = residual + x (x alone
 * on the first layer), qkv_out = W_qkv rms_norm(residual_out) (+ bias), its q and k
 * heads normalised (with q/k norms) and rotated in place. normed: rows * hidden floats
 * of scratch; packed: room for the rows packed (see product). Team function. */
static void front_team(int64_t rows, const float *x, const float *residual, int64_t hidden,
                       const struct quire_layer_desc *desc, const struct quire_panels *qkv,
                       const float *cos, const float *sin, int64_t rot_stride, int64_t hq,
                       int64_t hkv, int64_t d, float *normed, float *packed, float *qkv_out,
                       float *residual_out) {
    const int64_t qkv_n = qkv->out_features;
    const float eps = desc->eps;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        float *h = residual_out + r * hidden;
        for (int64_t i = 0; i < hidden; i++)
            h[i] = residual ? residual[r * hidden + i] + xr[i] : xr[i];
        quire_rms_norm_row(h, desc->norm_in, eps, hidden, normed + r * hidden);
    }
    product(normed, rows, qkv, qkv_out, packed);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *q = qkv_out + r * qkv_n;
        norm_rotate_qk(desc, q, hq, hkv, d, cos + r * rot_stride, sin + r * rot_stride);
    }
}

/* The layer after attention, for rows [0, rows): residual += W_o attn (+ bias) (its
 * own norm first, when the layer has one), then out = W_down (act(W_gate a) * W_up a)
 * with a = rms_norm(residual) (and out normalised, when the layer says). scratch:
 * rows * half_scratch_per_row floats. Team function. */
static void back_team(int64_t rows, const float *attn, int64_t hidden, float *residual,
                      const struct quire_layer_desc *desc, const struct quire_panels *o,
                      const struct quire_panels *gate_up, const struct quire_panels *down,
                      float *scratch, float *out) {
    const int64_t inter = inter_of(desc, gate_up);
    float *o_out = scratch, *normed = o_out + rows * hidden, *gu = normed + rows * hidden;
    float *act = gu + rows * 2 * inter, *packed = act + rows * inter;
    const float eps = desc->eps;
    product(attn, rows, o, o_out, packed);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * hidden, *add = o_out + r * hidden;
        if (desc->attn_out_norm)
            quire_rms_norm_row(add, desc->attn_out_norm, eps, hidden, add);
        for (int64_t i = 0; i < hidden; i++)
            h[i] += add[i];
        quire_rms_norm_row(h, desc->norm_pre_mlp, eps, hidden,
                           (desc->mlp_external ? out : normed) + r * hidden);
    }
    if (desc->mlp_external)
        return;
    product(normed, rows, gate_up, gu, packed);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        act_mul(desc->activation, gu + r * 2 * inter, gu + r * 2 * inter + inter, inter,
                act + r * inter);
    product(act, rows, down, out, packed);
    if (desc->mlp_out_norm) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quire_rms_norm_row(out + r * hidden, desc->mlp_out_norm, eps, hidden,
                               out + r * hidden);
    }
}

/*
 * The layer's two halves for a step whose attention runs elsewhere (the attention
 * backend, for prompts and mixed steps): quire_layer_front_f32 before it,
 * quire_layer_back_f32 after. Products on float32 panels; rows taken BLOCK_ROWS at a
 * time. front: x, residual (NULL on the first layer), residual_out: [rows, hidden];
 * qkv_out: [rows, (hq + 2 hkv) d], q and k rotated; cos and sin: row r's rotary factors
 * at cos + r * rot_stride. back: attn [rows, hq d]; residual [rows, hidden] is updated
 * in place; out [rows, hidden]. Return 0; 1 when the shapes disagree; 2 when scratch
 * memory is short.
 */
int quire_layer_front_f32(int64_t rows, const float *x, const float *residual, int64_t hidden,
                          const struct quire_layer_desc *desc,
                          const struct quire_panels *qkv, const float *cos, const float *sin,
                          int64_t rot_stride, int64_t hq, int64_t hkv, int64_t d,
                          float *qkv_out, float *residual_out) {
    if (rows <= 0 || !desc_fits(desc) || !front_fits(hidden, hq, hkv, d, qkv))
        return 1;
    const int64_t block = rows < BLOCK_ROWS ? rows : BLOCK_ROWS, qkv_n = qkv->out_features;
    float *normed = quire_thread_scratch((size_t)((block + 6) * 2 * hidden));
    if (normed == NULL)
        return 2;
    float *packed = normed + block * hidden;
#pragma omp parallel
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t n = rows - r0 < block ? rows - r0 : block;
        front_team(n, x + r0 * hidden, residual ? residual + r0 * hidden : NULL, hidden,
                   desc, qkv, cos + r0 * rot_stride, sin + r0 * rot_stride, rot_stride, hq,
                   hkv, d, normed, packed, qkv_out + r0 * qkv_n, residual_out + r0 * hidden);
    }
    return 0;
}

int quire_layer_back_f32(int64_t rows, const float *attn, int64_t hidden, float *residual,
                         const struct quire_layer_desc *desc, const struct quire_panels *o,
                         const struct quire_panels *gate_up, const struct quire_panels *down,
                         float *out) {
    if (rows <= 0 || !desc_fits(desc) || !back_fits(hidden, desc, o, gate_up, down))
        return 1;
    const int64_t inter = inter_of(desc, gate_up);
    const int64_t block = rows < BLOCK_ROWS ? rows : BLOCK_ROWS;
    const int64_t widest = widest_input(hidden, desc, o, down);
    float *scratch = quire_thread_scratch(
        (size_t)(block * half_scratch_per_row(hidden, inter, widest) + packed_extra(widest)));
    if (scratch == NULL)
        return 2;
#pragma omp parallel
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t n = rows - r0 < block ? rows - r0 : block;
        back_team(n, attn + r0 * o->in_features, hidden, residual + r0 * hidden, desc, o,
                  gate_up, down, scratch, out + r0 * hidden);
    }
    return 0;
}

/* Whether a decode batch's lengths are valid (>= 1); *longest gets the longest span any
 * row attends over (its window at most). */
static int lens_fit(int64_t rows, const int64_t *seq_lens, int64_t window, int64_t *longest) {
    *longest = 0;
    for (int64_t s = 0; s < rows; s++) {
        if (seq_lens[s] < 1)
            return 0;
        const int64_t n = (window > 0 && seq_lens[s] > window) ? window : seq_lens[s];
        if (n > *longest)
            *longest = n;
    }
    return 1;
}

/* Whether a decode batch's arguments fit the layer (then *longest is set). */
static int batch_fits(int64_t rows, int64_t hidden, int64_t hq, int64_t hkv, int64_t d,
                      const struct quire_layer_desc *desc, const struct quire_panels *qkv,
                      const struct quire_panels *o, const struct quire_panels *gate_up,
                      const struct quire_panels *down, const int64_t *seq_lens,
                      int64_t window, int64_t *longest) {
    return rows > 0 && desc_fits(desc) &&
           panels_fit(hidden, hq, hkv, d, desc, qkv, o, gate_up, down) &&
           lens_fit(rows, seq_lens, window, longest);
}

/* Scratch floats of a decode batch (decode_batch_team's `scratch`). */
static int64_t batch_scratch(int64_t rows, int64_t hidden, int64_t hq, int64_t hkv, int64_t d,
                             const struct quire_layer_desc *desc,
                             const struct quire_panels *qkv, const struct quire_panels *o,
                             const struct quire_panels *gate_up,
                             const struct quire_panels *down, int64_t longest) {
    const int64_t inter = inter_of(desc, gate_up), widest = widest_input(hidden, desc, o, down);
    (void)hkv;
    return rows * (qkv->out_features + hq * d + half_scratch_per_row(hidden, inter, widest)) +
           packed_extra(widest) + omp_get_max_threads() * hq * longest;
}

/* The body of quire_decode_batch_f32 and _bf16, for the team of their one parallel
 * region; its arguments are theirs, checked, and `scratch` (batch_scratch floats). */
static void decode_batch_team(
    int64_t rows, const float *x, const float *residual, int64_t hidden,
    const struct quire_layer_desc *desc, const struct quire_panels *qkv,
    const struct quire_panels *o, const struct quire_panels *gate_up,
    const struct quire_panels *down, const float *cos, const float *sin, int64_t rot_stride,
    void *k_cache, void *v_cache, const int64_t *slots, const int64_t *tables,
    int64_t table_stride, const int64_t *seq_lens, int64_t block_size, int64_t window,
    int64_t hq, int64_t hkv, int64_t d, float scale, int64_t longest, float *scratch,
    float *out, float *residual_out) {
    const int64_t inter = inter_of(desc, gate_up), qkv_n = qkv->out_features;
    const int kv_type = desc->kv_type;
    const int64_t widest = widest_input(hidden, desc, o, down);
    float *qkv_out = scratch, *attn = qkv_out + rows * qkv_n, *halves = attn + rows * hq * d;
    float *scores = halves + rows * half_scratch_per_row(hidden, inter, widest) +
                    packed_extra(widest);

    front_team(rows, x, residual, hidden, desc, qkv, cos, sin, rot_stride, hq, hkv, d, halves,
               halves + rows * hidden, qkv_out, residual_out);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *kv = qkv_out + r * qkv_n + hq * d;
        store_kv_row(k_cache, kv_type, slots[r], hkv, d, kv);
        store_kv_row(v_cache, kv_type, slots[r], hkv, d, kv + hkv * d);
    }
    quire_attend_rows_team(kv_type, qkv_out, qkv_n, k_cache, v_cache, tables, table_stride,
                           seq_lens, rows, window, hq, hkv, d, block_size, scale,
                           scores + omp_get_thread_num() * hq * longest, attn, hq * d);
    back_team(rows, attn, hidden, residual_out, desc, o, gate_up, down, halves, out);
}

/*
 * The whole layer for a decode batch: `rows` sequences, one new token each, row r of x
 * belonging to sequence r: front, this step's keys and values written to the cache,
 * attention per sequence over the team (paged_decode.c's quire_attend_heads, as
 * quire_paged_decode_f32 runs it), back; one parallel region. Products on panels
 * (float32, or bfloat16 pair panels), so this serves any number of rows.
 *
 * Arguments as the halves', plus: k_cache and v_cache, the layer's two halves of
 * [num_blocks * block_size, hkv, d]; slots: [rows] cache slots of the new keys and
 * values; tables: [rows, table_stride] block tables; seq_lens: [rows], counting this
 * token. Returns 0; 1 when the shapes disagree; 2 when scratch memory is short.
 */
int quire_decode_batch_f32(
    int64_t rows, const float *x, const float *residual, int64_t hidden,
    const struct quire_layer_desc *desc, const struct quire_panels *qkv,
    const struct quire_panels *o, const struct quire_panels *gate_up,
    const struct quire_panels *down, const float *cos, const float *sin, int64_t rot_stride,
    void *k_cache, void *v_cache, const int64_t *slots, const int64_t *tables,
    int64_t table_stride, const int64_t *seq_lens, int64_t block_size, int64_t window,
    int64_t hq, int64_t hkv, int64_t d, float scale, float *out, float *residual_out) {
    int64_t longest;
    if (!batch_fits(rows, hidden, hq, hkv, d, desc, qkv, o, gate_up, down, seq_lens, window,
                    &longest))
        return 1;
    float *scratch = quire_thread_scratch((size_t)batch_scratch(
        rows, hidden, hq, hkv, d, desc, qkv, o, gate_up, down, longest));
    if (scratch == NULL)
        return 2;
#pragma omp parallel
    decode_batch_team(rows, x, residual, hidden, desc, qkv, o, gate_up, down, cos, sin,
                      rot_stride, k_cache, v_cache, slots, tables, table_stride, seq_lens,
                      block_size, window, hq, hkv, d, scale, longest, scratch, out,
                      residual_out);
    return 0;
}

static void widen_row(const uint16_t *src, int64_t n, float *dst);
static void round_row(const float *src, int64_t n, uint16_t *dst);

/*
 * quire_decode_batch_f32 for a bfloat16 model: its input rows x and residual and its
 * outputs out and residual_out are bfloat16 [rows, hidden] (widened on the way in,
 * rounded on the way out, in the same parallel region), the rotary factors float32;
 * inside, the layer is the float32 one, its products on pair panels (or float32
 * ones). The residual stream stays float32 through the layer and is rounded once.
 */
int quire_decode_batch_bf16(
    int64_t rows, const uint16_t *x, const uint16_t *residual, int64_t hidden,
    const struct quire_layer_desc *desc, const struct quire_panels *qkv,
    const struct quire_panels *o, const struct quire_panels *gate_up,
    const struct quire_panels *down, const float *cos, const float *sin, int64_t rot_stride,
    void *k_cache, void *v_cache, const int64_t *slots, const int64_t *tables,
    int64_t table_stride, const int64_t *seq_lens, int64_t block_size, int64_t window,
    int64_t hq, int64_t hkv, int64_t d, float scale, uint16_t *out, uint16_t *residual_out) {
    int64_t longest;
    if (!batch_fits(rows, hidden, hq, hkv, d, desc, qkv, o, gate_up, down, seq_lens, window,
                    &longest))
        return 1;
    const int64_t inner = batch_scratch(rows, hidden, hq, hkv, d, desc, qkv, o, gate_up, down,
                                        longest);
    /* the widened input (then the float32 output) and the float32 residual stream */
    float *scratch = quire_thread_scratch((size_t)(inner + 2 * rows * hidden));
    if (scratch == NULL)
        return 2;
    float *x32 = scratch + inner, *stream = x32 + rows * hidden;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            widen_row(x + r * hidden, hidden, x32 + r * hidden);
            if (residual)
                widen_row(residual + r * hidden, hidden, stream + r * hidden);
        }
        /* front_team adds the residual in place (stream), and x32 is read before out is
         * written into it */
        decode_batch_team(rows, x32, residual ? stream : NULL, hidden, desc, qkv, o, gate_up,
                          down, cos, sin, rot_stride, k_cache, v_cache, slots, tables,
                          table_stride, seq_lens, block_size, window, hq, hkv, d, scale,
                          longest, scratch, x32, stream);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            round_row(x32 + r * hidden, hidden, out + r * hidden);
            round_row(stream + r * hidden, hidden, residual_out + r * hidden);
        }
    }
    return 0;
}

/*
 * A layer for a batch of rows whose products run outside (oneDNN's bfloat16 kernels,
 * the pair panels, or the platform's quantized_linear on a GGUF file's blocks):
 * everything between the products runs here, one call and one parallel region per gap,
 * rows over the team. quire/platforms/cpu/fused_decode.py calls them in this order, the
 * products between:
 *
 *   quire_rows_front       stream = residual + x (float32); normed = rms_norm(stream)
 *   [qkv = W_qkv normed]
 *   quire_rows_attend      decode steps: q/k norms, rotary, this step's K/V into the
 *                          pages, each row's attention over its sequence's pages -> attn
 *   quire_rows_rotate      other steps: q/k norms and rotary on qkv in place; the
 *                          attention backend writes the cache and attends
 *   [o_out = W_o attn]
 *   quire_rows_post_attn   stream += attn_out_norm(o_out); normed = pre_mlp_norm(stream);
 *                          residual_out = stream
 *   [gate_up = W_gate_up normed]
 *   quire_rows_act         act = act(gate) * up
 *   [out = W_down act]
 *   quire_rows_out_norm    out = mlp_out_norm(out) in place (layers that have one)
 *
 * The rows (every pointer but stream) hold the model's dtype: bfloat16 (rows_f32 0),
 * widened to float32 on the way in and rounded (to nearest even, as torch) on the way
 * out, the residual stream float32 through the layer and rounded once, into
 * residual_out, where the op-by-op path rounds it after each add; or float32 (rows_f32
 * 1: a float32 model on quantised weights), copied, so that the results are the op-by-op
 * path's to float32 rounding. The KV pages hold float32, bfloat16, int8 or fp8
 * (desc->kv_type), whatever the rows hold. All take one struct quire_rows, whose pointers the caller sets
 * for the step.
 */
struct quire_rows {
    int64_t rows, hidden, hq, hkv, d;
    const struct quire_layer_desc *desc;
    const void *x, *residual;      /* [rows, hidden]; residual NULL on the first layer */
    float *stream;                 /* [rows, hidden]: the float32 residual stream */
    void *normed;                  /* [rows, hidden]: a product's input */
    void *qkv;                     /* [rows, (hq + 2 hkv) d]: q, k, v heads */
    const void *cos, *sin;         /* row r's rotary factors at r * rot_stride */
    int64_t rot_stride;
    int32_t rot_bf16;              /* cos and sin hold bfloat16 (else float32) */
    void *k_cache, *v_cache;       /* the layer's halves, [slots, hkv, d] */
    const int64_t *slots, *tables, *seq_lens; /* [rows], [rows, table_stride], [rows] */
    int64_t table_stride, block_size, window;
    float scale;
    void *attn;                    /* [rows, hq d] */
    const void *o_out;             /* [rows, hidden] */
    const void *gate_up;           /* [rows, 2 inter]: gate then up */
    int64_t inter;
    void *act;                     /* [rows, inter] */
    void *out, *residual_out;      /* [rows, hidden] */
    int32_t rows_f32;              /* the rows hold float32 (else bfloat16) */
};

static void widen_row(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f v = load8_bf16(src + i);
        memcpy(dst + i, &v, sizeof v);
    }
    for (; i < n; i++)
        dst[i] = bf16_to_f32(src[i]);
}

/* f32_to_bf16 eight lanes at a time (the scalar one took half of quire_rows_act). */
static void round_row(const float *src, int64_t n, uint16_t *dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8u32 bits;
        memcpy(&bits, src + i, sizeof bits);
        const v8u32 nan = (v8u32)((bits & 0x7fffffffu) > 0x7f800000u);
        const v8u32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        const v8u32 quiet = (bits >> 16) | 0x40u;
        const v8u16 h = __builtin_convertvector((rounded & ~nan) | (quiet & nan), v8u16);
        memcpy(dst + i, &h, sizeof h);
    }
    for (; i < n; i++)
        dst[i] = f32_to_bf16(src[i]);
}

/* n values of the rows at element offset off of base, as float32 into dst. */
static void load_row(const struct quire_rows *a, const void *base, int64_t off, int64_t n,
                     float *dst) {
    if (a->rows_f32)
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    else
        widen_row((const uint16_t *)base + off, n, dst);
}

/* n float32 values of src into the rows at element offset off of base. */
static void store_row(const struct quire_rows *a, const float *src, int64_t n, void *base,
                      int64_t off) {
    if (a->rows_f32)
        memcpy((float *)base + off, src, (size_t)n * sizeof(float));
    else
        round_row(src, n, (uint16_t *)base + off);
}

static int rows_fit(const struct quire_rows *a) {
    return a->rows > 0 && a->hidden > 0 && a->hq > 0 && a->hkv > 0 && a->hq % a->hkv == 0 &&
           a->d > 0 && a->d % 2 == 0 && desc_fits(a->desc);
}

/* Row r of qkv as float32 into q (qkv's width), its q and k heads normalised (with q/k
 * norms) and rotated. rot: 2 d floats of scratch for bfloat16 factors. */
static void qk_row(const struct quire_rows *a, int64_t r, float *q, float *rot) {
    const int64_t d = a->d, hq = a->hq, hkv = a->hkv;
    const struct quire_layer_desc *desc = a->desc;
    load_row(a, a->qkv, r * (hq + 2 * hkv) * d, (hq + 2 * hkv) * d, q);
    const float *cos, *sin;
    if (a->rot_bf16) {
        widen_row((const uint16_t *)a->cos + r * a->rot_stride, d, rot);
        widen_row((const uint16_t *)a->sin + r * a->rot_stride, d, rot + d);
        cos = rot, sin = rot + d;
    } else {
        cos = (const float *)a->cos + r * a->rot_stride;
        sin = (const float *)a->sin + r * a->rot_stride;
    }
    norm_rotate_qk(desc, q, hq, hkv, d, cos, sin);
}

/* Each returns 0; 1 when the shapes disagree; 2 when scratch memory is short. */
int quire_rows_front(const struct quire_rows *a) {
    if (!rows_fit(a))
        return 1;
    const int64_t hidden = a->hidden;
    const struct quire_layer_desc *desc = a->desc;
    float *scratch = quire_thread_scratch((size_t)(omp_get_max_threads() * 2 * hidden));
    if (scratch == NULL)
        return 2;
#pragma omp parallel
    {
        float *normed = scratch + omp_get_thread_num() * 2 * hidden, *res = normed + hidden;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->rows; r++) {
            float *h = a->stream + r * hidden;
            load_row(a, a->x, r * hidden, hidden, h);
            if (a->residual) {
                load_row(a, a->residual, r * hidden, hidden, res);
                for (int64_t i = 0; i < hidden; i++)
                    h[i] += res[i];
            }
            quire_rms_norm_row(h, desc->norm_in, desc->eps, hidden, normed);
            store_row(a, normed, hidden, a->normed, r * hidden);
        }
    }
    return 0;
}

/* Decode rows (row r the one new token of sequence r): this step's keys and values into
 * the pages, then each row's attention over its sequence's pages. Returns 2 when
 * scratch memory is short. */
int quire_rows_attend(const struct quire_rows *a) {
    if (!rows_fit(a))
        return 1;
    const int64_t d = a->d, hq = a->hq, hkv = a->hkv, qkv_n = (hq + 2 * hkv) * d;
    const int kv_type = a->desc->kv_type;
    int64_t longest = 0;
    for (int64_t s = 0; s < a->rows; s++) {
        if (a->seq_lens[s] < 1)
            return 1;
        const int64_t len = a->seq_lens[s];
        const int64_t n = (a->window > 0 && len > a->window) ? a->window : len;
        if (n > longest)
            longest = n;
    }
    const int64_t per_thread = 2 * d + hq * longest;
    const int64_t threads = omp_get_max_threads();
    float *scratch = quire_thread_scratch((size_t)(a->rows * (qkv_n + hq * d) +
                                                   threads * per_thread));
    if (scratch == NULL)
        return 2;
    float *attn = scratch + a->rows * qkv_n; /* [rows, hq, d] float32, then stored */
#pragma omp parallel
    {
        float *mine = attn + a->rows * hq * d + omp_get_thread_num() * per_thread;
        float *rot = mine, *scores = rot + 2 * d;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->rows; r++) {
            float *q = scratch + r * qkv_n;
            qk_row(a, r, q, rot);
            store_kv_row(a->k_cache, kv_type, a->slots[r], hkv, d, q + hq * d);
            store_kv_row(a->v_cache, kv_type, a->slots[r], hkv, d, q + (hq + hkv) * d);
        }
        quire_attend_rows_team(kv_type, scratch, qkv_n, a->k_cache, a->v_cache, a->tables,
                               a->table_stride, a->seq_lens, a->rows, a->window, hq, hkv, d,
                               a->block_size, a->scale, scores, attn, hq * d);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->rows; r++)
            store_row(a, attn + r * hq * d, hq * d, a->attn, r * hq * d);
    }
    return 0;
}

/* Any rows: qkv's q and k heads normalised and rotated in place (v untouched), for the
 * attention backend. */
int quire_rows_rotate(const struct quire_rows *a) {
    if (!rows_fit(a))
        return 1;
    const int64_t d = a->d, qk_n = (a->hq + a->hkv) * d, qkv_n = qk_n + a->hkv * d;
    const int64_t per_thread = 2 * d + qkv_n;
    float *scratch = quire_thread_scratch((size_t)(omp_get_max_threads() * per_thread));
    if (scratch == NULL)
        return 2;
#pragma omp parallel
    {
        float *rot = scratch + omp_get_thread_num() * per_thread, *q = rot + 2 * d;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->rows; r++) {
            qk_row(a, r, q, rot);
            store_row(a, q, qk_n, a->qkv, r * qkv_n);
        }
    }
    return 0;
}

int quire_rows_post_attn(const struct quire_rows *a) {
    if (!rows_fit(a))
        return 1;
    const int64_t hidden = a->hidden;
    const struct quire_layer_desc *desc = a->desc;
    if (a->rows_f32 && !desc->attn_out_norm) {
        /* float32 rows: read and write them in place, the same operations without the
         * copies through a thread's row */
        const float *o_out = a->o_out;
        float *normed = a->normed;
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < a->rows; r++) {
            float *h = a->stream + r * hidden;
            const float *o = o_out + r * hidden;
            for (int64_t i = 0; i < hidden; i++)
                h[i] += o[i];
            store_row(a, h, hidden, a->residual_out, r * hidden);
            quire_rms_norm_row(h, desc->norm_pre_mlp, desc->eps, hidden, normed + r * hidden);
        }
        return 0;
    }
    float *scratch = quire_thread_scratch((size_t)(omp_get_max_threads() * hidden));
    if (scratch == NULL)
        return 2;
#pragma omp parallel
    {
        float *t = scratch + omp_get_thread_num() * hidden;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->rows; r++) {
            float *h = a->stream + r * hidden;
            load_row(a, a->o_out, r * hidden, hidden, t);
            if (desc->attn_out_norm)
                quire_rms_norm_row(t, desc->attn_out_norm, desc->eps, hidden, t);
            for (int64_t i = 0; i < hidden; i++)
                h[i] += t[i];
            store_row(a, h, hidden, a->residual_out, r * hidden);
            quire_rms_norm_row(h, desc->norm_pre_mlp, desc->eps, hidden, t);
            store_row(a, t, hidden, a->normed, r * hidden);
        }
    }
    return 0;
}

int quire_rows_act(const struct quire_rows *a) {
    if (!rows_fit(a) || a->inter <= 0)
        return 1;
    const int64_t inter = a->inter;
    if (a->rows_f32) {  /* float32 rows: the activation reads and writes them in place */
        const float *gate_up = a->gate_up;
        float *act = a->act;
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < a->rows; r++)
            act_mul(a->desc->activation, gate_up + r * 2 * inter,
                    gate_up + r * 2 * inter + inter, inter, act + r * inter);
        return 0;
    }
    float *scratch = quire_thread_scratch((size_t)(omp_get_max_threads() * 3 * inter));
    if (scratch == NULL)
        return 2;
#pragma omp parallel
    {
        float *gu = scratch + omp_get_thread_num() * 3 * inter, *act = gu + 2 * inter;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->rows; r++) {
            load_row(a, a->gate_up, r * 2 * inter, 2 * inter, gu);
            act_mul(a->desc->activation, gu, gu + inter, inter, act);
            store_row(a, act, inter, a->act, r * inter);
        }
    }
    return 0;
}

int quire_rows_out_norm(const struct quire_rows *a) {
    if (!rows_fit(a) || !a->desc->mlp_out_norm)
        return 1;
    const int64_t hidden = a->hidden;
    float *scratch = quire_thread_scratch((size_t)(omp_get_max_threads() * hidden));
    if (scratch == NULL)
        return 2;
#pragma omp parallel
    {
        float *t = scratch + omp_get_thread_num() * hidden;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a->rows; r++) {
            load_row(a, a->out, r * hidden, hidden, t);
            quire_rms_norm_row(t, a->desc->mlp_out_norm, a->desc->eps, hidden, t);
            store_row(a, t, hidden, a->out, r * hidden);
        }
    }
    return 0;
}

/*
 * A decode batch (row r the one new token of sequence r) through consecutive layers of a
 * float32 model on quantised weights in one call and one parallel region: the layers'
 * quire_rows_* steps and their products, in the order
 * quire/platforms/cpu/fused_decode.py's FusedDecodeLayer._rows_step calls them, each
 * between barriers. Per layer, that path is eight calls from Python, each with its
 * tensors and its parallel region, while the team waits (docs/bench.md has what it cost).
 * The products are the kernels that path's calls reach for the batch, chosen per product
 * by bf16's bits (1 qkv, 2 o, 4 gate/up, 8 down: a weight of long rows keeps the direct
 * path for more rows than a short one): a bit set, the bfloat16 kernel
 * (quire_quant_gemm_bf16_team: a layer's parts in one run, its rows rounded to bfloat16,
 * float32 sums); clear, the blocks' direct path (quire_quant_rows_team, or the parts'
 * int8 or bfloat16 activations where acts says so), which quire_quant_gemm_f32 takes
 * for up to quire_quant_direct_rows rows. The same kernels on the same rows, so the
 * results are that path's exactly.
 *
 * x, residual (NULL: none), out, residual_out: [rows, hidden] float32; cos[i], sin[i]:
 * layer i's rotary rows (row r at r * cos_stride); tables: row s sequence s's blocks
 * (table_stride apart); seq_lens count each sequence's new token; slots: where it goes.
 * Every layer's linears are quantised parts (struct quire_linear QUIRE_FORMAT_QUANT)
 * that the chosen kernel takes, and its MLP is its own. Returns 0; 1 when the shapes
 * or weights do not fit (nothing written); 2 when memory is short (before anything is
 * written); 3 when a product's scratch could not be had midway (the pages are written
 * then: the caller cannot fall back).
 */
static int batch_linear_fits(const struct quire_linear *w, int64_t in, int64_t out,
                             int bf16, int64_t m) {
    if (w == NULL || w->format != QUIRE_FORMAT_QUANT || w->in_features != in ||
        w->out_features != out || w->num_parts <= 0 || (!bf16 && !linear_fits(w)))
        return 0;
    const struct quire_qpart *part = w->codes;
    int64_t rows = 0;
    for (int64_t p = 0; p < w->num_parts; p++) {
        if (part[p].rows <= 0 ||
            (bf16 ? !quire_quant_bf16_fits(part[p].fmt, in)
                  : m > quire_quant_direct_rows(part[p].fmt)))
            return 0;
        rows += part[p].rows;
    }
    return rows == out;
}

/* y = W x (+ bias) for the batch's m rows on the chosen kernel; ends in a barrier. */
static int batch_product(const struct quire_linear *w, int bf16, uint16_t *rounded,
                         const float *x, int64_t m, float *y) {
    if (!bf16) {
        quant_parts_share(w, x, m, y);
#pragma omp barrier
        return 0;
    }
    return quire_quant_gemm_bf16_team(w->num_parts, w->codes, rounded, x, m, w->in_features,
                                      w->bias, y, w->out_features);
}

int quire_rows_stack_f32(int64_t n, const struct quire_stack_layer *layers, int64_t rows,
                         const float *x, const float *residual, int64_t hidden,
                         const float *const *cos, const float *const *sin, int64_t cos_stride,
                         const int64_t *slots, const int64_t *tables, int64_t table_stride,
                         const int64_t *seq_lens, int64_t block_size, int64_t hq, int64_t hkv,
                         int64_t d, int32_t bf16, float *out, float *residual_out) {
    static __thread void *held_buf;
    static __thread size_t held;
    if (n < 1 || rows < 1 || hidden <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 ||
        d % 2 || cos_stride < d || block_size < 1 ||
        bf16 < 0 || bf16 > 15 || (bf16 && !quire_quant_gemm_bf16_available()))
        return 1;
    const int64_t nqkv = (hq + 2 * hkv) * d;
    int64_t inter = 0, longest = 0;
    for (int64_t i = 0; i < n; i++) {
        const struct quire_stack_layer *l = &layers[i];
        if (!desc_fits(l->desc) || l->desc->mlp_external || l->gate_up == NULL ||
            l->gate_up->out_features % 2 || l->k_cache == NULL || l->v_cache == NULL)
            return 1;
        const int64_t li = l->gate_up->out_features / 2;
        if (!batch_linear_fits(l->qkv, hidden, nqkv, bf16 & 1, rows) ||
            !batch_linear_fits(l->o, hq * d, hidden, bf16 & 2, rows) ||
            !batch_linear_fits(l->gate_up, hidden, 2 * li, bf16 & 4, rows) ||
            !batch_linear_fits(l->down, li, hidden, bf16 & 8, rows))
            return 1;
        inter = li > inter ? li : inter;
    }
    for (int64_t s = 0; s < rows; s++) {
        if (seq_lens[s] < 1)
            return 1;
        longest = seq_lens[s] > longest ? seq_lens[s] : longest;
    }
    const int64_t threads = omp_get_max_threads();
    const int64_t widest = hidden > hq * d ? (hidden > inter ? hidden : inter)
                                           : (hq * d > inter ? hq * d : inter);
    /* the residual stream, normed rows, qkv, attention, o, gate/up, activation and the
     * rounded rows, then each thread's attention scores and a row for a norm */
    const size_t shared = (size_t)rows * (3 * hidden + nqkv + hq * d + 3 * inter) +
                          ((size_t)rows * widest + 1) / 2;
    const size_t own = (size_t)hq * longest + hidden;
    float *scratch = quire_grown(&held_buf, &held, sizeof(float) * (shared + threads * own));
    if (scratch == NULL)
        return 2;
    float *stream = scratch, *normed = stream + rows * hidden, *qkv = normed + rows * hidden;
    float *attn = qkv + rows * nqkv, *o_out = attn + rows * hq * d, *gu = o_out + rows * hidden;
    float *act = gu + rows * 2 * inter;
    uint16_t *rounded = (uint16_t *)(act + rows * inter);
    float *owned = scratch + shared;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = owned + omp_get_thread_num() * own, *t = scores + hq * longest;
        for (int64_t i = 0; i < n; i++) {
            const struct quire_stack_layer *l = &layers[i];
            const struct quire_layer_desc *desc = l->desc;
            const int64_t li = l->gate_up->out_features / 2;
            const float eps = desc->eps;
            /* quire_rows_front: the residual stream, the input norm */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                float *h = stream + r * hidden;
                if (i == 0) {
                    memcpy(h, x + r * hidden, sizeof(float) * hidden);
                    if (residual)
                        for (int64_t c = 0; c < hidden; c++)
                            h[c] += residual[r * hidden + c];
                } else {
                    for (int64_t c = 0; c < hidden; c++)
                        h[c] = out[r * hidden + c] + h[c];
                }
                quire_rms_norm_row(h, desc->norm_in, eps, hidden, normed + r * hidden);
            }
            failed |= batch_product(l->qkv, bf16 & 1, rounded, normed, rows, qkv);
            /* quire_rows_attend: q/k norms, rotary, this step's K/V, attention */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                float *q = qkv + r * nqkv;
                norm_rotate_qk(desc, q, hq, hkv, d, cos[i] + r * cos_stride,
                               sin[i] + r * cos_stride);
                store_kv_row(l->k_cache, desc->kv_type, slots[r], hkv, d, q + hq * d);
                store_kv_row(l->v_cache, desc->kv_type, slots[r], hkv, d, q + (hq + hkv) * d);
            }
            quire_attend_rows_team(desc->kv_type, qkv, nqkv, l->k_cache, l->v_cache, tables,
                                   table_stride, seq_lens, rows, l->window, hq, hkv, d,
                                   block_size, l->scale, scores, attn, hq * d);
            failed |= batch_product(l->o, bf16 & 2, rounded, attn, rows, o_out);
            /* quire_rows_post_attn: the residual stream, the pre-MLP norm */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                float *h = stream + r * hidden;
                const float *o = o_out + r * hidden;
                if (desc->attn_out_norm) {
                    quire_rms_norm_row(o, desc->attn_out_norm, eps, hidden, t);
                    o = t;
                }
                for (int64_t c = 0; c < hidden; c++)
                    h[c] += o[c];
                quire_rms_norm_row(h, desc->norm_pre_mlp, eps, hidden, normed + r * hidden);
            }
            failed |= batch_product(l->gate_up, bf16 & 4, rounded, normed, rows, gu);
            /* quire_rows_act */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                act_mul(desc->activation, gu + r * 2 * li, gu + r * 2 * li + li, li,
                        act + r * li);
            failed |= batch_product(l->down, bf16 & 8, rounded, act, rows, out);
            if (desc->mlp_out_norm) { /* quire_rows_out_norm */
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++) {
                    memcpy(t, out + r * hidden, sizeof(float) * hidden);
                    quire_rms_norm_row(t, desc->mlp_out_norm, eps, hidden, out + r * hidden);
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            memcpy(residual_out + r * hidden, stream + r * hidden, sizeof(float) * hidden);
    }
    return failed ? 3 : 0;
}
