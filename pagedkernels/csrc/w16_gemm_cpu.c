/* out [M, N] = x [M, K] @ W^T for a 16-bit float weight W [N, K] (bfloat16 or float16) and float32
 * activations, accumulated in float32: each weight value is widened exactly (bf16: a 16-bit shift; fp16:
 * the F16C conversion where the build has it), so the product is the float32 product of the same values,
 * reading half the weight bytes. Meant for decode-sized M: a product of few rows is bound by the bytes of its
 * weight, and at a few dozen rows the kernel keeps up with oneDNN's float32 one.
 *
 * The weight comes prepacked (pagedkernels.w16_gemm.pack_w16) in panels of NP = 32 output columns; the panel
 * micro-kernels (w16_panel.h) are shared with the MoE kernel (moe_cpu.c). This file spreads the panels over
 * the threads. */
#include "w16_panel.h"

/* x float32 [M, K] (row stride x_s0, unit column stride), packed as above for N columns (w_dt 1 = float16,
 * 2 = bfloat16), out float32 [M, N] (row stride o_s0, unit column stride). Returns 0, or -1 for an unsupported
 * dtype. */
int pk_w16_gemm(const float *x, int64_t x_s0, int64_t M, int64_t K, const uint16_t *packed, int64_t N, int w_dt,
                float *out, int64_t o_s0, int num_threads) {
    if ((w_dt != 1 && w_dt != 2) || K < 0) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int64_t panels = (N + NP - 1) / NP;
    const int threads = N * K >= W16_PARALLEL_MIN ? num_threads : 1;
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
        panel_rows(x, x_s0, NULL, M, K, panel_w, n0, nc, w_dt, out, o_s0, ahead);
    }
    return 0;
}
