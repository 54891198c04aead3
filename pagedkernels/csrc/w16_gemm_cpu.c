/* out [M, N] = x [M, K] @ W^T for a 16-bit float weight W [N, K] (bfloat16 or float16) and float32
 * activations, accumulated in float32: each weight value is widened exactly (bf16: a 16-bit shift; fp16:
 * the F16C conversion where the build has it), so the product is the float32 product of the same values,
 * reading half the weight bytes. Meant for decode-sized M: a product of few rows is bound by the bytes of its
 * weight, and at a few dozen rows the kernel keeps up with oneDNN's float32 one.
 *
 * The weight comes prepacked (pagedkernels.w16_gemm.pack_w16) in panels of NP = 32 output columns; the panel
 * micro-kernels (w16_panel.h) are shared with the MoE kernel (moe_cpu.c). This file spreads the panels over
 * the threads.
 *
 * Activations and outputs may be bf16 too (a bf16 model): the product is then the float32 product of the bf16 values,
 * rounded once to the output's dtype. Where the build has AVX512-BF16 (PK_BF16_DOT, cpu_common.h) a bf16 x times a bf16
 * weight takes panel_dot below, two k at a time in pair dot products, x never widened; elsewhere x's rows are widened
 * to float32 once per call and go through the float32 panel kernel. */
#include "w16_panel.h"

#if PK_BF16_DOT
/* bf16 x times a bf16 weight in pair dot products (dot_bf16_pairs): rows of MBD at a time, each with two accumulators
 * of 16 lanes for the panel's 32 columns (16 + 2 weight vectors + the broadcast: 19 of AVX-512's 32 registers). */
#define MBD 8
/* The panel's rows k and k + 1 (32 bf16 each) as pairs (W[c][k], W[c][k + 1]) in 32-bit lanes: AVX-512's 16-bit
 * unpacks interleave within 128-bit lanes, so lo holds columns 0-3, 8-11, 16-19, 24-27 and hi columns 4-7, 12-15,
 * 20-23, 28-31; unscramble() puts the sums back in column order once per row. */
static inline __attribute__((always_inline)) void weight_pairs(vbf32 r0, vbf32 r1, vbf32 *lo, vbf32 *hi) {
    *lo = __builtin_shufflevector(r0, r1, 0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43, 16, 48, 17, 49,
                                  18, 50, 19, 51, 24, 56, 25, 57, 26, 58, 27, 59);
    *hi = __builtin_shufflevector(r0, r1, 4, 36, 5, 37, 6, 38, 7, 39, 12, 44, 13, 45, 14, 46, 15, 47, 20, 52, 21, 53,
                                  22, 54, 23, 55, 28, 60, 29, 61, 30, 62, 31, 63);
}

static inline void unscramble(vf16 lo, vf16 hi, float *cols) {
    const vf16 first = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const vf16 second = __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    memcpy(cols, &first, sizeof first);
    memcpy(cols + 16, &second, sizeof second);
}

/* acc[i] += pairs of k and k + 1 (k + 1 only with `both`: an odd K's last k pairs with a zero) for rows i < mb. */
static inline __attribute__((always_inline)) void dot_step(vf16 acc[][2], const uint16_t *const *xr, int mb, int64_t k,
                                                           const uint16_t *p, const int both) {
    vbf32 lo, hi;
    weight_pairs(load_bf32(p), both ? load_bf32(p + NP) : (vbf32){0}, &lo, &hi);
    for (int i = 0; i < mb; i++) {
        /* x[k] in the low half, x[k + 1] in the high (little-endian: as they lie in memory): the weight pairs' order.
         * One 32-bit load broadcast from memory; assembled from two 16-bit loads (GCC does not merge them) it took a
         * shift, an or and a broadcast from a general register per row and k pair. */
        uint32_t pair = xr[i][k];
        if (both) memcpy(&pair, xr[i] + k, sizeof pair);
        const vbf32 xv = (vbf32)((vu16){0} + pair);
        acc[i][0] = dot_bf16_pairs(acc[i][0], lo, xv);
        acc[i][1] = dot_bf16_pairs(acc[i][1], hi, xv);
    }
}

/* Rows [m0, m0 + mb) of one panel (columns n0 .. n0 + nc - 1), bf16 x. Sums in blocks of KB k as the float32 kernel's
 * (KB is even, so only an odd K's last k goes alone). */
static inline __attribute__((always_inline)) void panel_dot(const uint16_t *x, int64_t x_s0, int64_t m0, int mb,
                                                            int64_t K, const uint16_t *panel_w, int64_t n0, int nc,
                                                            void *out, int64_t o_s0, int o_dt,
                                                            const uint16_t *ahead) {
    vf16 total[MBD][2];
    memset(total, 0, sizeof total);
    const uint16_t *xr[MBD];
    for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * x_s0;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        vf16 acc[MBD][2];
        memset(acc, 0, sizeof acc);
        int64_t k = k0;
        for (; k + 1 < k1; k += 2) {
            if (ahead) {
                __builtin_prefetch(ahead + k * NP, 0, 1);
                __builtin_prefetch(ahead + (k + 1) * NP, 0, 1);
            }
            dot_step(acc, xr, mb, k, panel_w + k * NP, 1);
        }
        if (k < k1) {
            if (ahead) __builtin_prefetch(ahead + k * NP, 0, 1);
            dot_step(acc, xr, mb, k, panel_w + k * NP, 0);
        }
        for (int i = 0; i < mb; i++) {
            total[i][0] += acc[i][0];
            total[i][1] += acc[i][1];
        }
    }
    for (int i = 0; i < mb; i++) {
        float cols[NP];
        unscramble(total[i][0], total[i][1], cols);
        store_cols(out, (m0 + i) * o_s0 + n0, o_dt, cols, nc);
    }
}
#endif

int pk_bf16_dot_path(void) { return PK_BF16_DOT; }

/* x [M, K] (row stride x_s0, unit column stride; x_dt 0 = float32, 1 = float16, 2 = bfloat16), packed as above for N
 * columns (w_dt 1 = float16, 2 = bfloat16), out [M, N] (row stride o_s0, unit column stride; o_dt as x_dt). Returns 0,
 * -1 for an unsupported dtype, -2 out of memory. */
int pk_w16_gemm(const void *x, int64_t x_s0, int x_dt, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                int w_dt, void *out, int64_t o_s0, int o_dt, int num_threads) {
    if ((w_dt != 1 && w_dt != 2) || x_dt < 0 || x_dt > 2 || o_dt < 0 || o_dt > 2 || K < 0) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int64_t panels = (N + NP - 1) / NP;
    const int threads = N * K >= W16_PARALLEL_MIN ? num_threads : 1;
#if PK_BF16_DOT
    if (x_dt == 2 && w_dt == 2) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t t = 0; t < panels; t++) {
            const int64_t n0 = t * NP;
            const int nc = N - n0 < NP ? (int)(N - n0) : NP;
            const uint16_t *panel_w = packed + t * K * NP, *ahead = t + 1 < panels ? panel_w + K * NP : NULL;
            const uint16_t *xb = (const uint16_t *)x;
            int64_t m0 = 0;
#define ROWS_OF_PANEL_DOT(ROWS) \
    panel_dot(xb, x_s0, m0, ROWS, K, panel_w, n0, nc, out, o_s0, o_dt, m0 == 0 ? ahead : NULL)
            for (; m0 + MBD <= M; m0 += MBD) ROWS_OF_PANEL_DOT(MBD);
            switch (M - m0) { /* the last rows: each count its own inlined copy */
            case 1: ROWS_OF_PANEL_DOT(1); break;
            case 2: ROWS_OF_PANEL_DOT(2); break;
            case 3: ROWS_OF_PANEL_DOT(3); break;
            case 4: ROWS_OF_PANEL_DOT(4); break;
            case 5: ROWS_OF_PANEL_DOT(5); break;
            case 6: ROWS_OF_PANEL_DOT(6); break;
            case 7: ROWS_OF_PANEL_DOT(7); break;
            default: break;
            }
#undef ROWS_OF_PANEL_DOT
        }
        return 0;
    }
#endif
    /* 16-bit x: widened to float32 once (a few dozen rows against every panel's pass over them) */
    float *widened = NULL;
    if (x_dt != 0) {
        widened = (float *)malloc(sizeof(float) * (size_t)(M * (K > 0 ? K : 1)));
        if (!widened) return -2;
#pragma omp parallel for schedule(static) num_threads(M * K >= W16_PARALLEL_MIN ? num_threads : 1)
        for (int64_t m = 0; m < M; m++) {
            const float *row = load_row(x, m * x_s0, x_dt, K, widened + m * K);
            if (row != widened + m * K) memcpy(widened + m * K, row, sizeof(float) * (size_t)K);
        }
    }
    const float *xf = widened ? widened : (const float *)x;
    const int64_t xf_s0 = widened ? K : x_s0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < panels; t++) {
        const int64_t n0 = t * NP;
        const int nc = N - n0 < NP ? (int)(N - n0) : NP;
        const uint16_t *panel_w = packed + t * K * NP;
        /* The first pass over this panel (its first rows' first sub-panel) prefetches the next panel's rows, one
         * 64-byte row a k, so the next panel's first pass finds them in cache: without it, that pass waited on
         * memory at the pace of its FMAs (a 64-byte row per 8-16 FMAs is more than a core's share of DRAM). The
         * body of SmolLM2 (30 layers, 212 MB of bf16) on a 2-core Zen 5: 8 rows 13.7 -> 11.2 ms built for AVX2,
         * 8.3-8.9 -> 6.0-6.4 for AVX-512; 16 rows 20.0-20.4 -> 16.5-17.2 and 12.3-12.8 -> 9.3-9.4; one row level.
         * The decode GEMMs of the 48-request workload: 4.60-4.67 -> 4.16-4.18 s (AVX2), 2.81 -> 2.37 s (AVX-512). */
        const uint16_t *ahead = t + 1 < panels ? panel_w + K * NP : NULL;
        panel_rows(xf, xf_s0, NULL, M, K, panel_w, n0, nc, w_dt, out, o_s0, o_dt, ahead);
    }
    free(widened);
    return 0;
}
