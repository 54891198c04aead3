/* The panel GEMM of pagedkernels' CPU kernels: out rows = x rows @ W^T for a weight W [N, K] prepacked in panels
 * of NP = 32 output columns, each panel's K rows of 32 values back to back (pagedkernels.w16_gemm.pack_w16,
 * pagedkernels.fused_moe.pack_moe_weight):
 *     packed[p][k][c] = W[32 p + c][k]          (columns past N zero)
 * float32 activations and accumulation; the weight in bfloat16 or float16 (each value widened exactly: bf16 a
 * 16-bit shift, fp16 the F16C conversion where the build has it: the float32 product of the same values, reading
 * half the bytes) or in float32; the outputs float32, or rounded once to bf16 / fp16 (o_dt). Used by w16_gemm_cpu.c
 * (one weight, rows in order; 16-bit activations are widened to float32 rows before they get here, or take its pair
 * dot products under AVX512-BF16) and moe_cpu.c (one weight per expert, each expert's rows gathered from the batch
 * by an index).
 *
 * The micro-kernel vectorizes over the panel's 32 outputs: per k it widens the panel's 32 weights once and
 * adds x[m][k] times them into the accumulators of MB activation rows (a broadcast and an FMA per vector).
 * No horizontal sums, and each thread reads its panels as one sequential stream (row by row, the
 * interleaved streams of several weight rows came in at a third of the memory bandwidth on a 2-core AMD
 * EPYC). A panel (K x 64 bytes) stays in L1/L2 while the blocks of MB rows pass over it, so the weight is read
 * from memory once whatever M. A row's sums are the same additions in the same order whatever the rows beside
 * it, so a token's result does not depend on the batch it runs in.
 *
 * Vector extensions, so the same source is AVX-512 (16 floats a register), AVX2 (8) or plain SSE/NEON (4).
 * Weight kinds and output dtypes are pagedkernels' dtype codes: 0 float32, 1 float16, 2 bfloat16. */
#ifndef PAGEDKERNELS_W16_PANEL_H
#define PAGEDKERNELS_W16_PANEL_H

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

/* Bytes of one weight value of a kind. */
#define W_BYTES(kind) ((kind) == 0 ? 4 : 2)

/* n float32 results to the output at element offset `offset` in dtype o_dt: float32 as they are, 16-bit ones
 * rounded once. */
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

/* VL weights of a kind as float32. */
static inline vfl load_w(const char *p, int kind) {
    if (kind == 0) {
        vfl f;
        memcpy(&f, p, sizeof f);
        return f;
    }
    return widen((const uint16_t *)p, kind == 2);
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

/* Columns [n0 + c0, n0 + c0 + SUB) of panel_w (nc of them valid, counted from c0) against the mb activation rows
 * xr[0..mb) (out row i at element offset o_off + i * o_s0, dtype o_dt). Always inlined with a constant mb and kind
 * (see panel_rows), so the accumulators are registers, not a stack array indexed at run time. */
static inline __attribute__((always_inline)) void sub_panel(const float *const *xr, int mb, int64_t K,
                                                            const char *panel_w, int c0, int nc, int kind,
                                                            void *out, int64_t o_off, int64_t o_s0, int o_dt,
                                                            int64_t n0, const char *ahead) {
    const int64_t row_bytes = NP * W_BYTES(kind);
    vfl total[MB][2];
    memset(total, 0, sizeof total);
    const char *p = panel_w + c0 * W_BYTES(kind);
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        vfl acc[MB][2];
        memset(acc, 0, sizeof acc);
        for (int64_t k = k0; k < k1; k++, p += row_bytes) {
            if (ahead) __builtin_prefetch(ahead + k * row_bytes, 0, 1);
            vfl w0, w1;
#if PAIRED_BF16
            if (kind == 2) {
                widen_bf16_pairs((const uint16_t *)p, &w0, &w1);
            } else
#endif
            {
                w0 = load_w(p, kind);
                w1 = load_w(p + VL * W_BYTES(kind), kind);
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
        const int64_t offset = o_off + i * o_s0 + n0 + c0;
        float *o = (float *)out + offset; /* float32 outputs only */
        float lanes[SUB];
#if PAIRED_BF16
        if (kind == 2) {
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
static inline __attribute__((always_inline)) void whole_panel(const float *const *xr, int mb, int64_t K,
                                                              const char *panel_w, int nc, int kind, void *out,
                                                              int64_t o_off, int64_t o_s0, int o_dt, int64_t n0,
                                                              const char *ahead) {
    const int64_t row_bytes = NP * W_BYTES(kind);
    vfl total[2][NP / VL];
    memset(total, 0, sizeof total);
    const float *rows[2] = {xr[0], xr[mb - 1]};
    const char *p = panel_w;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        vfl acc[2][NP / VL];
        memset(acc, 0, sizeof acc);
        for (int64_t k = k0; k < k1; k++, p += row_bytes) {
            if (ahead) __builtin_prefetch(ahead + k * row_bytes, 0, 1);
            vfl wv[NP / VL];
            for (int v = 0; v < NP / VL; v++) wv[v] = load_w(p + v * VL * W_BYTES(kind), kind);
            for (int i = 0; i < mb; i++) {
                const float xs = rows[i][k];
                for (int v = 0; v < NP / VL; v++) acc[i][v] += wv[v] * xs;
            }
        }
        for (int i = 0; i < mb; i++)
            for (int v = 0; v < NP / VL; v++) total[i][v] += acc[i][v];
    }
    for (int i = 0; i < mb; i++) {
        float lanes[NP];
        memcpy(lanes, total[i], sizeof lanes);
        store_cols(out, o_off + i * o_s0 + n0, o_dt, lanes, nc);
    }
}

/* mb rows (xr[0..mb), out rows from element offset o_off) of one panel (columns n0 .. n0 + nc - 1). */
static inline __attribute__((always_inline)) void panel(const float *const *xr, int mb, int64_t K,
                                                        const char *panel_w, int64_t n0, int nc, int kind,
                                                        void *out, int64_t o_off, int64_t o_s0, int o_dt,
                                                        const char *ahead) {
    if (SUB < NP && mb <= 2) {
        whole_panel(xr, mb, K, panel_w, nc, kind, out, o_off, o_s0, o_dt, n0, ahead);
        return;
    }
    for (int c0 = 0; c0 < nc; c0 += SUB)
        sub_panel(xr, mb, K, panel_w, c0, nc - c0, kind, out, o_off, o_s0, o_dt, n0, c0 == 0 ? ahead : NULL);
}

/* Rows [m0, m0 + mb) of a panel: input row i at x + (rows ? rows[i] : i) * x_s0, output row i at element offset
 * i * o_s0 of out (dtype o_dt). */
static inline __attribute__((always_inline)) void row_block(const float *x, int64_t x_s0, const int32_t *rows,
                                                            int64_t m0, int mb, int64_t K, const char *panel_w,
                                                            int64_t n0, int nc, int kind, void *out, int64_t o_s0,
                                                            int o_dt, const char *ahead) {
    const float *xr[MB];
    for (int i = 0; i < mb; i++) xr[i] = x + (rows ? (int64_t)rows[m0 + i] : m0 + i) * x_s0;
    panel(xr, mb, K, panel_w, n0, nc, kind, out, m0 * o_s0, o_s0, o_dt, ahead);
}

/* All M rows of one panel, in blocks of MB rows (each row count its own inlined copy, the kind a constant). */
static inline __attribute__((always_inline)) void panel_rows_kind(const float *x, int64_t x_s0, const int32_t *rows,
                                                                  int64_t M, int64_t K, const char *panel_w,
                                                                  int64_t n0, int nc, int kind, void *out,
                                                                  int64_t o_s0, int o_dt, const char *ahead) {
    int64_t m0 = 0;
/* rows [m0, m0 + ROWS) of this panel, a constant ROWS per call site (its own inlined copy); the first block's pass
 * prefetches the next panel */
#define ROWS_OF_PANEL(ROWS) \
    row_block(x, x_s0, rows, m0, ROWS, K, panel_w, n0, nc, kind, out, o_s0, o_dt, m0 == 0 ? ahead : NULL)
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

/* M rows of one panel of a kind-`kind` weight (see panel_rows_kind; out [M, ...] in dtype o_dt, row stride o_s0;
 * `ahead`: the next panel, prefetched by the first row block's pass, or NULL). One function per translation unit,
 * a copy per kind inside (the output dtype only matters at the stores, once per row and sub-panel). */
static void __attribute__((unused)) panel_rows(const float *x, int64_t x_s0, const int32_t *rows, int64_t M,
                                               int64_t K, const void *panel_w, int64_t n0, int nc, int kind,
                                               void *out, int64_t o_s0, int o_dt, const void *ahead) {
    const char *w = (const char *)panel_w, *next = (const char *)ahead;
    switch (kind) {
    case 0: panel_rows_kind(x, x_s0, rows, M, K, w, n0, nc, 0, out, o_s0, o_dt, next); break;
    case 1: panel_rows_kind(x, x_s0, rows, M, K, w, n0, nc, 1, out, o_s0, o_dt, next); break;
    default: panel_rows_kind(x, x_s0, rows, M, K, w, n0, nc, 2, out, o_s0, o_dt, next); break;
    }
}

#if PK_BF16_DOT
/* bf16 x times a bf16 weight in pair dot products (dot_bf16_pairs, cpu_common.h), for builds with AVX512-BF16: two k
 * at a time, x never widened. Rows of MBD at a time, each with two accumulators of 16 lanes for the panel's 32 columns
 * (16 + 2 weight vectors + the broadcast: 19 of AVX-512's 32 registers). Used by w16_gemm_cpu.c for a bf16 model's
 * linears and by moe_cpu.c for its experts. */
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

/* Rows [m0, m0 + mb) of one panel (columns n0 .. n0 + nc - 1), bf16 x: input row i at x + (rows ? rows[m0 + i] :
 * m0 + i) * x_s0, output row i at element offset (m0 + i) * o_s0 of out (dtype o_dt). Sums in blocks of KB k as the
 * float32 kernel's (KB is even, so only an odd K's last k goes alone). */
static inline __attribute__((always_inline)) void panel_dot(const uint16_t *x, int64_t x_s0, const int32_t *rows,
                                                            int64_t m0, int mb, int64_t K, const uint16_t *panel_w,
                                                            int64_t n0, int nc, void *out, int64_t o_s0, int o_dt,
                                                            const uint16_t *ahead) {
    vf16 total[MBD][2];
    memset(total, 0, sizeof total);
    const uint16_t *xr[MBD];
    for (int i = 0; i < mb; i++) xr[i] = x + (rows ? (int64_t)rows[m0 + i] : m0 + i) * x_s0;
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

/* All M rows of one panel of a bf16 weight against bf16 x (rows: as panel_dot's), in blocks of MBD rows, each row
 * count its own inlined copy; the first block's pass prefetches `ahead` (the next panel, or NULL). A row's sums are
 * the same additions whatever the rows beside it. */
static void __attribute__((unused)) panel_rows_dot(const uint16_t *x, int64_t x_s0, const int32_t *rows, int64_t M,
                                                   int64_t K, const uint16_t *panel_w, int64_t n0, int nc, void *out,
                                                   int64_t o_s0, int o_dt, const uint16_t *ahead) {
    int64_t m0 = 0;
#define ROWS_OF_PANEL_DOT(ROWS) \
    panel_dot(x, x_s0, rows, m0, ROWS, K, panel_w, n0, nc, out, o_s0, o_dt, m0 == 0 ? ahead : NULL)
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
#endif

#endif
