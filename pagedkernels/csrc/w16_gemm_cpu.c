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
 * weight takes panel_rows_dot (w16_panel.h), two k at a time in pair dot products, x never widened; elsewhere x's rows
 * are widened to float32 once per call and go through the float32 panel kernel. */
#include "w16_panel.h"


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
            panel_rows_dot((const uint16_t *)x, x_s0, NULL, M, K, panel_w, n0, nc, out, o_s0, o_dt, ahead);
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
