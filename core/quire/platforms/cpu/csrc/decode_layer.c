/*
 * A whole Llama-family decoder layer for one token of one sequence, float32 (cpu
 * platform): the step of a lone decoding sequence.
 *
 * Run op by op from Python, such a layer is ~20 small torch operators and C calls;
 * for SmolLM2-135M their dispatch took ~290 us of a ~600 us layer. Here it is one call
 * and one OpenMP parallel region, the phases separated by the team's barriers:
 *
 *   h = residual + x                  (the residual stream; x alone on the first layer)
 *   a = rms_norm(h) * w_in
 *   q, k, v = W_qkv a (+ bias)        rows over threads
 *   q, k = rotary(q, k)               x * cos + roll(x, D/2) * sin, the model's tables
 *   cache[slot] = k, v
 *   o = attention(q, the sequence's pages)   query heads over threads
 *   h2 = h + W_o o (+ bias)           rows over threads; h2 is returned as the residual
 *   a2 = rms_norm(h2) * w_post
 *   out = W_down (silu(W_gate a2) * W_up a2)   rows over threads
 *
 * The same operations as quire/models/llama.py's LlamaDecoderLayer with the cpu
 * platform's kernels (compact_gemv.c, rms_norm.c, paged_decode.c), in the same order;
 * the products and norms sum in their own orders, so results agree with the op-by-op
 * path to float32 rounding. quire/platforms/cpu/fused_decode.py decides which layers
 * qualify (compact weights, no q/k norms, one device).
 */
#include <stdlib.h>

#include "cpu_kernels.h"

/* A linear layer's compact weight (quire/platforms/cpu/compact.py's layout). */
struct quire_linear {
    int32_t format;
    int64_t out_features, in_features;
    const void *codes;
    const float *scales, *offsets, *bias; /* offsets: a4 only; bias may be NULL */
};

/* y = W x (+ bias), rows split over the team; call inside a parallel region. */
static void gemv_team(const struct quire_linear *w, const float *x, float *y) {
#pragma omp for schedule(static)
    for (int64_t j = 0; j < w->out_features; j++) {
        const float v = quire_compact_dot(w->format, x, w->in_features, w->codes, w->scales,
                                          w->offsets, j);
        y[j] = w->bias ? v + w->bias[j] : v;
    }
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

/*
 * x, residual (NULL on the first layer), out, residual_out: [hidden] rows. k_cache and
 * v_cache: the layer's two halves, [num_blocks * block_size, hkv, d]; slot: where this
 * token's key and value go; table: the sequence's block table; seq_len counts this
 * token. Returns 0; 1 when the shapes disagree; 2 when scratch memory is short.
 */
int quire_decode_layer_f32(
    const float *x, const float *residual, int64_t hidden, const float *norm_in,
    const float *norm_post, float eps, const struct quire_linear *qkv,
    const struct quire_linear *o, const struct quire_linear *gate_up,
    const struct quire_linear *down, const float *cos, const float *sin, float *k_cache,
    float *v_cache, int64_t slot, const int64_t *table, int64_t seq_len, int64_t block_size,
    int64_t window, int64_t hq, int64_t hkv, int64_t d, float scale, float *out,
    float *residual_out) {
    const int64_t inter = gate_up->out_features / 2;
    if (hidden <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || d <= 0 || d % 2 || seq_len < 1 ||
        qkv->in_features != hidden || qkv->out_features != (hq + 2 * hkv) * d ||
        o->in_features != hq * d || o->out_features != hidden ||
        gate_up->in_features != hidden || gate_up->out_features % 2 ||
        down->in_features != inter || down->out_features != hidden)
        return 1;
    const int64_t start = (window > 0 && seq_len > window) ? seq_len - window : 0;
    const int64_t n = seq_len - start;
    const int64_t row = hkv * d; /* floats per cache slot */
    float *scratch = malloc(sizeof(float) *
                            (hidden + qkv->out_features + hq * d + hidden + inter + hq * n));
    if (scratch == NULL)
        return 2;
    float *normed = scratch, *qkv_out = normed + hidden, *attn = qkv_out + qkv->out_features;
    float *o_out = attn + hq * d, *act = o_out + hidden, *scores = act + inter;

#pragma omp parallel
    {
#pragma omp single
        {
            for (int64_t i = 0; i < hidden; i++)
                residual_out[i] = residual ? residual[i] + x[i] : x[i];
            quire_rms_norm_row(residual_out, norm_in, eps, hidden, normed);
        }
        gemv_team(qkv, normed, qkv_out);
#pragma omp single
        {
            rotate(qkv_out, hq + hkv, d, cos, sin); /* q heads then k heads */
            memcpy(k_cache + slot * row, qkv_out + hq * d, sizeof(float) * row);
            memcpy(v_cache + slot * row, qkv_out + (hq + hkv) * d, sizeof(float) * row);
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < hq; h++)
            quire_attend_heads(qkv_out, k_cache, v_cache, table, start, n, h, h + 1, hq / hkv,
                               row, d, block_size, scale, scores + h * n, attn);
        gemv_team(o, attn, o_out);
#pragma omp single
        {
            for (int64_t i = 0; i < hidden; i++)
                residual_out[i] += o_out[i];
            quire_rms_norm_row(residual_out, norm_post, eps, hidden, normed);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < inter; i++) {
            float g = quire_compact_dot(gate_up->format, normed, hidden, gate_up->codes,
                                        gate_up->scales, gate_up->offsets, i);
            float u = quire_compact_dot(gate_up->format, normed, hidden, gate_up->codes,
                                        gate_up->scales, gate_up->offsets, inter + i);
            if (gate_up->bias) {
                g += gate_up->bias[i];
                u += gate_up->bias[inter + i];
            }
            act[i] = g / (1.0f + expf(-g)) * u;
        }
        gemv_team(down, act, out);
    }
    free(scratch);
    return 0;
}
