/*
 * AMX-BF16 tile products on pair panels (cpu platform, the amx ISA level): the product
 * half of quant_gemm.c's bfloat16 path, on CPUs with AMX (Sapphire Rapids and later).
 *
 * A pair panel ([K2][16][2] bfloat16, panel_bf16.c) is AMX's B-tile layout as it stands:
 * 16 pairs of one panel are 16 rows of 64 bytes, 16 columns by 32 K values. An A tile
 * is 16 rows of 32 bfloat16 activations, read in place (rows lda apart); a C tile 16 x 16
 * float32 sums. One TDPBF16PS multiplies a 16 x 32 A tile by a 32 x 16 B tile into C
 * (8192 products), where vdpbf16ps does 32. Blocks of 2 x 2 C tiles (32 rows by two
 * panels) use all 8 tile registers: 4 C, 2 A, 2 B, each A and B tile read twice.
 *
 * Sums: float32, as vdpbf16ps's, in another order; AMX flushes denormal inputs and
 * results to zero (a bfloat16 product of normal values is exact in float32).
 *
 * Linux hands out AMX's tile data state only on request (ARCH_REQ_XCOMP_PERM, 5.16+):
 * quire_amx_ready asks once per process and says whether it was granted; where it was
 * not (an older kernel, or a hypervisor that hides the state) the callers keep their
 * vdpbf16ps path. Each thread loads the one tile configuration before its tiles and
 * releases them after (torch's oneDNN, on the same threads, sets its own).
 */
/* syscall() is a GNU/BSD extension that -std=c11 hides: without this it was declared
 * implicitly, a warning here and an error from GCC 14 on. */
#define _DEFAULT_SOURCE
#include <stdint.h>

#include "cpu_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 not asked yet, 1 granted, -1 refused */
static int amx_state;

int quire_amx_ready(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) { /* asking twice is harmless, so no lock */
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}

/* palette 1, every tile 16 rows of 64 bytes: C tiles 0-3, A tiles 4-5, B tiles 6-7 */
static const struct quire_amx_config __attribute__((aligned(64))) TILE_CONFIG = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static uint64_t sections;

void quire_amx_begin_with(const struct quire_amx_config *config) {
    __atomic_fetch_add(&sections, 1, __ATOMIC_RELAXED);
    _tile_loadconfig(config);
}

void quire_amx_begin(void) { quire_amx_begin_with(&TILE_CONFIG); }

void quire_amx_end(void) { _tile_release(); }

uint64_t quire_amx_sections(void) { return __atomic_load_n(&sections, __ATOMIC_RELAXED); }

#define INL static inline __attribute__((always_inline))

/* 16 or 32 rows (R2) by one or two panels (C2), kt blocks of 32 K values; c's tiles
 * loaded first when accumulating. Tile numbers are immediates, hence the branches on
 * constants. */
INL void block(int R2, int C2, const uint16_t *a, int64_t lda, const uint32_t *b,
               int64_t pstride, int64_t kt, float *c, int64_t ldc, int accumulate) {
    const int64_t sa = lda * 2, sc = ldc * 4;
    float *c1 = c + 16, *c2 = c + 16 * ldc, *c3 = c2 + 16;
    if (accumulate) {
        _tile_loadd(0, c, sc);
        if (C2) _tile_loadd(1, c1, sc);
        if (R2) _tile_loadd(2, c2, sc);
        if (R2 && C2) _tile_loadd(3, c3, sc);
    } else {
        _tile_zero(0);
        if (C2) _tile_zero(1);
        if (R2) _tile_zero(2);
        if (R2 && C2) _tile_zero(3);
    }
    for (int64_t i = 0; i < kt; i++) {
        _tile_loadd(6, b + 256 * i, 64);
        _tile_loadd(4, a + 32 * i, sa);
        _tile_dpbf16ps(0, 4, 6);
        if (C2) {
            _tile_loadd(7, b + pstride + 256 * i, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (R2) {
            _tile_loadd(5, a + 16 * lda + 32 * i, sa);
            _tile_dpbf16ps(2, 5, 6);
            if (C2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, sc);
    if (C2) _tile_stored(1, c1, sc);
    if (R2) _tile_stored(2, c2, sc);
    if (R2 && C2) _tile_stored(3, c3, sc);
}

void quire_amx_pairs(const uint16_t *a, int64_t lda, int64_t m, const uint32_t *b,
                     int64_t pstride, int64_t np, int64_t kt, float *c, int64_t ldc,
                     int accumulate) {
    for (int64_t r0 = 0; r0 < m; r0 += 32) {
        const int two_rows = m - r0 >= 32;
        const uint16_t *ar = a + r0 * lda;
        float *cr = c + r0 * ldc;
        for (int64_t q = 0; q < np; q += 2) {
            const uint32_t *bq = b + q * pstride;
            if (two_rows && np - q >= 2)
                block(1, 1, ar, lda, bq, pstride, kt, cr + 16 * q, ldc, accumulate);
            else if (two_rows)
                block(1, 0, ar, lda, bq, pstride, kt, cr + 16 * q, ldc, accumulate);
            else if (np - q >= 2)
                block(0, 1, ar, lda, bq, pstride, kt, cr + 16 * q, ldc, accumulate);
            else
                block(0, 0, ar, lda, bq, pstride, kt, cr + 16 * q, ldc, accumulate);
        }
    }
}

#else

/* Levels without AMX: never granted, so the callers never reach the others. */
int quire_amx_ready(void) { return 0; }

void quire_amx_begin(void) {}

void quire_amx_begin_with(const struct quire_amx_config *config) { (void)config; }

void quire_amx_end(void) {}

uint64_t quire_amx_sections(void) { return 0; }

void quire_amx_pairs(const uint16_t *a, int64_t lda, int64_t m, const uint32_t *b,
                     int64_t pstride, int64_t np, int64_t kt, float *c, int64_t ldc,
                     int accumulate) {
    (void)a, (void)lda, (void)m, (void)b, (void)pstride, (void)np, (void)kt, (void)c;
    (void)ldc, (void)accumulate;
}

#endif
