/* out [M, N] = x [M, K] @ W^T for a 16-bit float weight W [N, K] (bfloat16 or float16) and float32
 * activations, accumulated in float32: each weight value is widened exactly (bf16: a 16-bit shift; fp16:
 * the F16C conversion where the build has it), so the product is the float32 product of the same values,
 * reading half the weight bytes. Meant for few rows (decode), where a product is bound by the bytes of its
 * weight.
 *
 * The weight comes prepacked (pagedkernels.w16_gemm.pack_w16): tiles of NB = 4 rows, each tile's K
 * columns in blocks of 16, the tile's 4 rows of a block side by side:
 *     packed[t][b][j][c] = W[4 t + j][16 b + c]          (rows past N zero)
 * so a thread reads its tiles as one sequential stream. Read row by row, the 4 interleaved row streams of
 * a tile came in at a third of the memory bandwidth on a 2-core AMD EPYC (8-10 GB/s a core against 25 for
 * a sequential read); packed, the single-row product of a 49152 x 576 weight ran at 30 GB/s on 2 cores.
 * Blocks of MB activation rows pass over each tile while it sits in L1, so the weight is read from memory
 * once whatever M.
 *
 * Vector extensions, so the same source is AVX-512 (16 floats a register), AVX2 (8) or NEON (4). The
 * register tile (MB x NB accumulators, NB widened weight vectors, MB x vectors) fits the 32 vector
 * registers of AVX-512 at 4 x 4, the 16 of AVX2 at 2 x 4. */
#include "cpu_common.h"

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#define MB 4
#elif defined(__AVX__) || defined(__ARM_NEON)
#define VL 8
#define MB 2
#else
#define VL 4
#define MB 2
#endif
typedef float vfl __attribute__((vector_size(VL * 4)));
typedef uint32_t vul __attribute__((vector_size(VL * 4)));
typedef uint16_t vhl __attribute__((vector_size(VL * 2)));
typedef _Float16 vfhl __attribute__((vector_size(VL * 2)));
#define NB 4
#define KB 16
/* Below this many weight values a product runs on one thread (the fork would cost more than it saves). */
#define W16_PARALLEL_MIN 32768

static inline vfl widen(const uint16_t *p, int is_bf16) {
    vhl h;
    memcpy(&h, p, sizeof h);
    if (is_bf16) {
#if defined(__AVX512F__)
        return (vfl)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__) && VL == 8
        return (vfl)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#endif
        const vul u = __builtin_convertvector(h, vul) << 16;
        vfl f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
#if defined(__AVX512F__)
    return (vfl)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VL == 8
    return (vfl)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vfhl f16;  /* no conversion instruction: the compiler converts element by element */
    memcpy(&f16, &h, sizeof f16);
    return __builtin_convertvector(f16, vfl);
#endif
}

/* Horizontal sum as a tree of halves (a serial chain of VL scalar adds cost more than a row's whole dot
 * product at K = 576). */
static inline float vsum(vfl v) {
    float lanes[VL];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = VL / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
    return lanes[0];
}

/* One tile (packed rows 4 t .. 4 t + 3) against activation rows [m0, m0 + mb). Always inlined with a
 * constant mb (see pk_w16_gemm), so the accumulators are registers, not a stack array indexed at run time. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_s0, int64_t m0, int mb, int64_t K,
                                                       const uint16_t *tile_w, int64_t n0, int nb, int is_bf16,
                                                       float *out, int64_t o_s0) {
    vfl acc[MB][NB];
    memset(acc, 0, sizeof acc);
    const uint16_t *p = tile_w;
    for (int64_t k = 0; k < K; k += KB, p += NB * KB) {
        for (int h = 0; h < KB; h += VL) {
            vfl wv[NB];
            for (int j = 0; j < NB; j++) wv[j] = widen(p + j * KB + h, is_bf16);
            for (int i = 0; i < mb; i++) {
                vfl xv;
                memcpy(&xv, x + (m0 + i) * x_s0 + k + h, sizeof xv);
                for (int j = 0; j < NB; j++) acc[i][j] += xv * wv[j];
            }
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) out[(m0 + i) * o_s0 + n0 + j] = vsum(acc[i][j]);
}

/* x float32 [M, K] (row stride x_s0, unit column stride; K a multiple of 16), packed as above for N rows
 * (w_dt 1 = float16, 2 = bfloat16), out float32 [M, N] (row stride o_s0).
 * Returns 0, or -1 for an unsupported dtype or K. */
int pk_w16_gemm(const float *x, int64_t x_s0, int64_t M, int64_t K, const uint16_t *packed, int64_t N, int w_dt,
                float *out, int64_t o_s0, int num_threads) {
    if ((w_dt != 1 && w_dt != 2) || K <= 0 || K % KB) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int is_bf16 = w_dt == 2;
    const int64_t tiles = (N + NB - 1) / NB;
    const int threads = N * K >= W16_PARALLEL_MIN ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NB;
        const int nb = N - n0 < NB ? (int)(N - n0) : NB;
        const uint16_t *tile_w = packed + t * K * NB;
        int64_t m0 = 0;
        for (; m0 + MB <= M; m0 += MB) tile(x, x_s0, m0, MB, K, tile_w, n0, nb, is_bf16, out, o_s0);
        switch (M - m0) {  /* the last rows: each count its own inlined copy */
        case 1: tile(x, x_s0, m0, 1, K, tile_w, n0, nb, is_bf16, out, o_s0); break;
#if MB > 2
        case 2: tile(x, x_s0, m0, 2, K, tile_w, n0, nb, is_bf16, out, o_s0); break;
        case 3: tile(x, x_s0, m0, 3, K, tile_w, n0, nb, is_bf16, out, o_s0); break;
#endif
        default: break;
        }
    }
    return 0;
}
