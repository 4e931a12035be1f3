/*
 * RMSNorm with the decoder's residual add folded in, float32 (cpu platform).
 *
 * torch's rms_norm on the CPU is a chain of six small operators (pow, mean, add, rsqrt,
 * two muls), ~70 us for one 576-wide row: SmolLM2 runs 61 of them per decode step,
 * about 4 ms of a 25 ms step. This is one pass over the row.
 *
 * Arithmetic, per row: h = residual + x (when a residual is given), written back as the
 * new residual; out = weight * (h * (1 / sqrt(mean(h^2) + eps))), the operations of
 * Hugging Face's LlamaRMSNorm in float32. Only the order of the sum of squares differs
 * (eight partial sums), so results agree with torch's to float32 rounding.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_kernels.h"

void quire_rms_norm_row(const float *h, const float *weight, float eps, int64_t n, float *out) {
    float part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            part[j] += h[i + j] * h[i + j];
    float ss = ((part[0] + part[4]) + (part[2] + part[6])) +
               ((part[1] + part[5]) + (part[3] + part[7]));
    for (; i < n; i++)
        ss += h[i] * h[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++)
        out[i] = weight[i] * (h[i] * inv);
}

int quire_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                       int64_t rows, int64_t n, float *out, float *residual_out) {
    if (n <= 0 || (residual != 0 && residual_out == 0))
        return 1;
#pragma omp parallel for schedule(static) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        const float *h = xr;
        if (residual) {
            const float *rr = residual + r * n;
            float *ro = residual_out + r * n;
            for (int64_t i = 0; i < n; i++)
                ro[i] = rr[i] + xr[i];
            h = ro;
        }
        quire_rms_norm_row(h, weight, eps, n, out + r * n);
    }
    return 0;
}
