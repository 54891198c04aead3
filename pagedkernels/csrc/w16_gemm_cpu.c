/* out [M, N] = x [M, K] @ W^T for a 16-bit float weight W [N, K] (bfloat16 or float16) and float32
 * activations, accumulated in float32: each weight value is widened exactly (bf16: a 16-bit shift; fp16:
 * the F16C conversion where the build has it), so the product is the float32 product of the same values,
 * reading half the weight bytes. Meant for decode-sized M: a product of few rows is bound by the bytes of its
 * weight, and at a few dozen rows the kernel keeps up with oneDNN's float32 one.
 *
 * The weight comes prepacked (pagedkernels.w16_gemm.pack_w16) in panels of NP = 32 output columns, each
 * panel's K rows of 32 values back to back:
 *     packed[p][k][c] = W[32 p + c][k]          (columns past N zero)
 * The micro-kernel vectorizes over the panel's 32 outputs: per k it widens the panel's 32 weights once and
 * adds x[m][k] times them into the accumulators of MB activation rows (a broadcast and an FMA per vector).
 * No horizontal sums, and each thread reads its panels as one sequential stream (row by row, the
 * interleaved streams of several weight rows came in at a third of the memory bandwidth on a 2-core AMD
 * EPYC). A panel (K x 64 bytes) stays in L1/L2 while the blocks of MB rows pass over it, so the weight is read
 * from memory once whatever M.
 *
 * Vector extensions, so the same source is AVX-512 (16 floats a register), AVX2 (8) or plain SSE/NEON (4).
 *
 * Activations and outputs may be bf16 too (a bf16 model): the product is then the float32 product of the bf16 values,
 * rounded once to the output's dtype. Where the build has AVX512-BF16 (PK_BF16_DOT, cpu_common.h) a bf16 x times a bf16
 * weight takes panel_dot below, two k at a time in pair dot products, x never widened; elsewhere x's rows are widened
 * to float32 once per call and go through the float32 kernel. */
#include "cpu_common.h"

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#define MB 8
#elif defined(__AVX__)
#define VL 8
#define MB 6
#else
#define VL 4
#define MB 4
#endif
typedef float vfl __attribute__((vector_size(VL * 4)));
typedef uint32_t vul __attribute__((vector_size(VL * 4)));
typedef uint16_t vhl __attribute__((vector_size(VL * 2)));
typedef _Float16 vfhl __attribute__((vector_size(VL * 2)));
#define NP 32
/* A panel is computed in sub-panels of two vectors (32 columns with AVX-512, 16 with AVX2, 8 with 4-float
 * vectors), so the accumulators (MB x 2), two widened weight vectors and a broadcast fit the register file:
 * 16 + 3 of AVX-512's 32, 8 + 3 of AVX2's 16. A sub-panel's reads are 2 VL values of every NP-value row. */
#define SUB (2 * VL)
/* Each output sums its K products in blocks of KB, each block in fresh registers, then the block sums: the
 * rounding error grows with KB + K / KB terms instead of K. One chain over K put SmolLM2's log-probs 1.3e-4 off
 * transformers' float32 ones (oneDNN's float32 GEMM: 8.0e-5); blocks of 64: 4.0e-5. It costs an add per 64 FMAs
 * and accumulator (measured 0-3% at 48 rows, nothing at 1). */
#ifndef KB
#define KB 64
#endif
/* Below this many weight values a product runs on one thread (the fork would cost more than it saves). */
#define W16_PARALLEL_MIN 32768

/* n float32 results to the output row at element offset `offset`: float32 as they are, 16-bit ones rounded once. */
static inline void store_cols(void *out, int64_t offset, int o_dt, const float *v, int n) {
    if (o_dt == 0)
        memcpy((float *)out + offset, v, sizeof(float) * (size_t)n);
    else
        store_row(out, offset, o_dt, n, v);
}

static inline vfl widen(const uint16_t *p, int is_bf16) {
    if (is_bf16) {
#if defined(__AVX512F__)
        return (vfl)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__) && VL == 8
        return (vfl)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
        vhl h;
        memcpy(&h, p, sizeof h);
        const vul u = __builtin_convertvector(h, vul) << 16;
        vfl f;
        memcpy(&f, &u, sizeof f);
        return f;
#endif
    }
#if defined(__AVX512F__)
    return (vfl)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VL == 8
    return (vfl)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vfhl f16; /* no conversion instruction: the compiler converts element by element */
    memcpy(&f16, p, sizeof f16);
    return __builtin_convertvector(f16, vfl);
#endif
}

/* A sub-panel's 2 VL bf16 weights of a k widen in two instructions instead of four (and one load instead of two):
 * as VL 32-bit lanes each holding columns 2i (low half) and 2i + 1 (high half), a 16-bit left shift gives the even
 * columns as float32 and a mask of the high halves the odd ones. The accumulators then hold even and odd columns,
 * interleaved back once per row at the end. With AVX-512 (SUB == NP == 32): Zen 4 runs a 512-bit FMA on both of its
 * FMA pipes, which the widening's shifts and zero-extensions share; 16 FMAs and 4 widening instructions a k ran at
 * 0.8 of the FMA peak (measured 180 GFLOP/s at 48 rows against oneDNN's 210-220 at large shapes). With AVX2 (SUB ==
 * 16) the 6 x 2 accumulators, the pair and a broadcast take 15 of the 16 registers: 12 FMAs a k against 2 widening
 * instructions, where zero-extending each vector for 4 x 2 accumulators gave 8 against 4. Built for AVX2 on a 2-core
 * Zen 5, 48 rows of SmolLM2's layers went from 183-189 to 200-216 GFLOP/s (oneDNN's AVX2 float32 GEMM peaks at
 * ~235), and the decode GEMMs of the 48-request workload from 5.2 to 4.6 s. */
#if defined(__AVX512F__)
#define PAIRED_BF16 1
static inline void widen_bf16_pairs(const uint16_t *p, vfl *even, vfl *odd) {
    const __m512i w = _mm512_loadu_si512((const void *)p);
    *even = (vfl)_mm512_slli_epi32(w, 16);
    *odd = (vfl)_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u));
}
/* out[0..31] = columns 0..31 from even (columns 0, 2, ..) and odd (1, 3, ..) lanes. */
static inline void unpair(vfl even, vfl odd, float *out) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(out, _mm512_permutex2var_ps((__m512)even, lo, (__m512)odd));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps((__m512)even, hi, (__m512)odd));
}
#elif defined(__AVX2__) && VL == 8
#define PAIRED_BF16 1
static inline void widen_bf16_pairs(const uint16_t *p, vfl *even, vfl *odd) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p);
    *even = (vfl)_mm256_slli_epi32(w, 16);
    *odd = (vfl)_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u));
}
/* out[0..15] from even and odd lanes: the unpacks interleave within 128-bit halves (columns 0-3 | 8-11 and
 * 4-7 | 12-15), the permutes put the halves in order. */
static inline void unpair(vfl even, vfl odd, float *out) {
    const __m256 lo = _mm256_unpacklo_ps((__m256)even, (__m256)odd), hi = _mm256_unpackhi_ps((__m256)even, (__m256)odd);
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}
#else
#define PAIRED_BF16 0
#endif

/* Columns [n0 + c0, n0 + c0 + SUB) of panel_w (nc of them valid, counted from c0) against activation rows
 * [m0, m0 + mb). Always inlined with a constant mb (see pk_w16_gemm), so the accumulators are registers, not a
 * stack array indexed at run time. */
static inline __attribute__((always_inline)) void sub_panel(const float *x, int64_t x_s0, int64_t m0, int mb,
                                                            int64_t K, const uint16_t *panel_w, int c0, int nc,
                                                            int is_bf16, void *out, int64_t o_s0, int o_dt,
                                                            int64_t n0, const uint16_t *ahead) {
    vfl total[MB][2];
    memset(total, 0, sizeof total);
    const float *xr[MB];
    for (int i = 0; i < mb; i++) xr[i] = x + (m0 + i) * x_s0;
    const uint16_t *p = panel_w + c0;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        vfl acc[MB][2];
        memset(acc, 0, sizeof acc);
        for (int64_t k = k0; k < k1; k++, p += NP) {
            if (ahead) __builtin_prefetch(ahead + k * NP, 0, 1);
            vfl w0, w1;
#if PAIRED_BF16
            if (is_bf16) {
                widen_bf16_pairs(p, &w0, &w1);
            } else
#endif
            {
                w0 = widen(p, is_bf16);
                w1 = widen(p + VL, is_bf16);
            }
            for (int i = 0; i < mb; i++) {
                const float xs = xr[i][k];
                acc[i][0] += w0 * xs;
                acc[i][1] += w1 * xs;
            }
        }
        for (int i = 0; i < mb; i++) {
            total[i][0] += acc[i][0];
            total[i][1] += acc[i][1];
        }
    }
    for (int i = 0; i < mb; i++) {
        const int64_t offset = (m0 + i) * o_s0 + n0 + c0;
        float *o = (float *)out + offset;
        float lanes[SUB];
#if PAIRED_BF16
        if (is_bf16) {
            if (nc >= SUB && o_dt == 0) {
                unpair(total[i][0], total[i][1], o);
                continue;
            }
            unpair(total[i][0], total[i][1], lanes);
        } else
#endif
        {
            if (nc >= SUB && o_dt == 0) {
                memcpy(o, total[i], sizeof(float) * SUB);
                continue;
            }
            memcpy(lanes, total[i], sizeof lanes);
        }
        store_cols(out, offset, o_dt, lanes, nc < SUB ? nc : SUB);
    }
}

/* The whole panel at once for one or two rows where it takes more than one sub-panel (AVX2 and narrower):
 * split in sub-panels, such rows would stream the panel in strided halves, once per sub-panel (measured 1.4-2x
 * slower at one row with AVX2); whole, NP / VL accumulators per row and as many weight vectors fit. */
static inline __attribute__((always_inline)) void whole_panel(const float *x, int64_t x_s0, int64_t m0, int mb,
                                                              int64_t K, const uint16_t *panel_w, int nc,
                                                              int is_bf16, void *out, int64_t o_s0, int o_dt,
                                                              int64_t n0, const uint16_t *ahead) {
    vfl total[2][NP / VL];
    memset(total, 0, sizeof total);
    const float *xr[2] = {x + m0 * x_s0, x + (m0 + mb - 1) * x_s0};
    const uint16_t *p = panel_w;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        vfl acc[2][NP / VL];
        memset(acc, 0, sizeof acc);
        for (int64_t k = k0; k < k1; k++, p += NP) {
            if (ahead) __builtin_prefetch(ahead + k * NP, 0, 1);
            vfl wv[NP / VL];
            for (int v = 0; v < NP / VL; v++) wv[v] = widen(p + v * VL, is_bf16);
            for (int i = 0; i < mb; i++) {
                const float xs = xr[i][k];
                for (int v = 0; v < NP / VL; v++) acc[i][v] += wv[v] * xs;
            }
        }
        for (int i = 0; i < mb; i++)
            for (int v = 0; v < NP / VL; v++) total[i][v] += acc[i][v];
    }
    for (int i = 0; i < mb; i++) {
        float lanes[NP];
        memcpy(lanes, total[i], sizeof lanes);
        store_cols(out, (m0 + i) * o_s0 + n0, o_dt, lanes, nc);
    }
}

/* Rows [m0, m0 + mb) of one panel (columns n0 .. n0 + nc - 1). */
static inline __attribute__((always_inline)) void panel(const float *x, int64_t x_s0, int64_t m0, int mb, int64_t K,
                                                        const uint16_t *panel_w, int64_t n0, int nc, int is_bf16,
                                                        void *out, int64_t o_s0, int o_dt, const uint16_t *ahead) {
    if (SUB < NP && mb <= 2) {
        whole_panel(x, x_s0, m0, mb, K, panel_w, nc, is_bf16, out, o_s0, o_dt, n0, ahead);
        return;
    }
    for (int c0 = 0; c0 < nc; c0 += SUB)
        sub_panel(x, x_s0, m0, mb, K, panel_w, c0, nc - c0, is_bf16, out, o_s0, o_dt, n0, c0 == 0 ? ahead : NULL);
}

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
        uint32_t pair = xr[i][k]; /* x[k] in the low half, x[k + 1] in the high: the weight pairs' order */
        if (both) pair |= (uint32_t)xr[i][k + 1] << 16;
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
    const int is_bf16 = w_dt == 2;
    const int64_t panels = (N + NP - 1) / NP;
    const int threads = N * K >= W16_PARALLEL_MIN ? num_threads : 1;
#if PK_BF16_DOT
    if (x_dt == 2 && is_bf16) {
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
        int64_t m0 = 0;
/* rows [m0, m0 + ROWS) of this panel, a constant ROWS per call site (its own inlined copy) */
#define ROWS_OF_PANEL(ROWS) \
    panel(xf, xf_s0, m0, ROWS, K, panel_w, n0, nc, is_bf16, out, o_s0, o_dt, m0 == 0 ? ahead : NULL)
        /* With 6-row blocks, 1 or 2 rows left over after a block run as 4 + 3 or 4 + 4 rows instead. */
        const int64_t blocks = MB == 6 && M > MB && M % MB <= 2 && M % MB > 0 ? M / MB - 1 : M / MB;
        for (; m0 < blocks * MB; m0 += MB) ROWS_OF_PANEL(MB);
        if (M - m0 > MB) {
            ROWS_OF_PANEL(4);
            m0 += 4;
        }
        switch (M - m0) { /* the last rows: each count its own inlined copy */
        case 1: ROWS_OF_PANEL(1); break;
        case 2: ROWS_OF_PANEL(2); break;
        case 3: ROWS_OF_PANEL(3); break;
        case 4: ROWS_OF_PANEL(4); break;
#if MB > 4
        case 5: ROWS_OF_PANEL(5); break;
#endif
#if MB > 6
        case 6: ROWS_OF_PANEL(6); break;
        case 7: ROWS_OF_PANEL(7); break;
#endif
        default: break;
        }
#undef ROWS_OF_PANEL
    }
    free(widened);
    return 0;
}
