/* Helpers shared by pagedkernels' native CPU kernels: dtype conversion, a vectorizable exp and
 * 16-float vectors. dtype codes: 0 = float32, 1 = float16, 2 = bfloat16, 3 = float8 e4m3 (KV caches
 * only: read by load_row, written by float_to_e4m3). */
#ifndef PAGEDKERNELS_CPU_COMMON_H
#define PAGEDKERNELS_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* e4m3 code -> float: its 7 magnitude bits at float16 bits 7..13 read as a float16 2^8 times too small,
 * subnormals included (see pagedkernels/_fp8.py). */
static inline float e4m3_to_float(uint8_t c) {
    const uint16_t h = (uint16_t)(((c & 0x80) << 8) | ((c & 0x7F) << 7));
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f * 256.0f;
}

/* float -> e4m3 code: clamp to +-448, round to nearest even (torch's float8_e4m3fn rounding). */
static inline uint8_t float_to_e4m3(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if (x != x) return (uint8_t)(0x7F | ((bits >> 24) & 0x80));
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float mag = fabsf(x);
    mag = mag > 448.0f ? 448.0f : mag;
    uint32_t code;
    if (mag >= 0.015625f) {
        uint32_t m;
        memcpy(&m, &mag, 4);
        const uint32_t rebased = m - (120u << 23);
        code = (rebased + 0x7FFFFu + ((rebased >> 20) & 1u)) >> 20;
    } else {
        volatile float shifted = mag + 16384.0f; /* ulp 2^-9: the adder rounds to nearest even */
        code = (uint32_t)((shifted - 16384.0f) * 512.0f);
    }
    return (uint8_t)(code | sign);
}

/* n elements as float32 (for float32 the elements themselves, no copy). */
static inline const float *load_row(const void *base, int64_t offset, int dtype, int64_t n, float *tmp) {
    if (dtype == 0) return (const float *)base + offset;
    if (dtype == 3) {
        const uint8_t *p = (const uint8_t *)base + offset;
        for (int64_t d = 0; d < n; d++) tmp[d] = e4m3_to_float(p[d]);
        return tmp;
    }
    if (dtype == 1) {
        const _Float16 *p = (const _Float16 *)base + offset;
        for (int64_t d = 0; d < n; d++) tmp[d] = (float)p[d];
    } else {
        const uint16_t *p = (const uint16_t *)base + offset;
        for (int64_t d = 0; d < n; d++) tmp[d] = bf16_to_float(p[d]);
    }
    return tmp;
}

static inline void store_row(void *base, int64_t offset, int dtype, int64_t n, const float *src) {
    if (dtype == 0) {
        memcpy((float *)base + offset, src, sizeof(float) * n);
    } else if (dtype == 1) {
        _Float16 *p = (_Float16 *)base + offset;
        for (int64_t d = 0; d < n; d++) p[d] = (_Float16)src[d];
    } else {
        uint16_t *p = (uint16_t *)base + offset;
        for (int64_t d = 0; d < n; d++) p[d] = float_to_bf16(src[d]);
    }
}

/* exp(x) for x <= 0 (scores minus their running max), vectorizable: 2^n * p(r) with
 * x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative error < 2e-7). x below
 * -87 (including -inf) gives ~1e-38, which weighs nothing next to the max's weight of 1. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* f rounded to the dtype's precision (float32: unchanged). */
static inline float round_to_dtype(float f, int dtype) {
    if (dtype == 1) return (float)(_Float16)f;
    if (dtype == 2) return bf16_to_float(float_to_bf16(f));
    return f;
}

/* Float vectors of the machine's width (GCC/Clang vector extensions): one register of 16 floats with AVX-512, 8 with
 * AVX, 4 otherwise (SSE, NEON). A wider vector type than the machine's is split into pieces by the compiler, and
 * arrays of them into stack memory: the decode attention built for AVX2 with 16-float vectors ran 8x slower than
 * with its own width (in-cache, 2-core EPYC built with -march=x86-64-v3). */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vfw __attribute__((vector_size(4 * VW)));
typedef float vf4 __attribute__((vector_size(16)));

static inline vfw vloadw(const float *p) {
    vfw v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* {sum of a's lanes, b's, c's, d's}: halves, then quarters (and so on) of the four vectors side by side, added by
 * shuffles across them (about three vector operations a sum, against eight for one vector summed alone). The
 * lanes are added in the same order for each; a memcpy out of a vector takes its address, and GCC then kept the
 * accumulators of the loops feeding it in stack memory (a store and a reload per FMA), so shuffles it is where the
 * compiler has them. */
static inline vf4 vsumw4(vfw a, vfw b, vfw c, vfw d) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
#if VW == 16
    const vfw ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vfw cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* ab = [a 8 | b 8], cd = [c 8 | d 8] -> x = [a 4 | b 4 | c 4 | d 4] */
    const vfw x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vfw y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const vfw z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return __builtin_shufflevector(z, z, 0, 4, 8, 12);
#elif VW == 8
    /* [a 4 | b 4], [c 4 | d 4] */
    const vfw ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    const vfw cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    /* [a0 + a2, a1 + a3, b.., b.., c.., c.., d.., d..] */
    const vfw y = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                  __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(y, y, 0, 2, 4, 6) + __builtin_shufflevector(y, y, 1, 3, 5, 7);
#else
    const vfw ab = __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
    const vfw cd = __builtin_shufflevector(c, d, 0, 1, 4, 5) + __builtin_shufflevector(c, d, 2, 3, 6, 7);
    return __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
#endif
#else
    float lanes[4][VW];
    memcpy(lanes[0], &a, sizeof a);
    memcpy(lanes[1], &b, sizeof b);
    memcpy(lanes[2], &c, sizeof c);
    memcpy(lanes[3], &d, sizeof d);
    vf4 sums = {0, 0, 0, 0};
    for (int v = 0; v < 4; v++)
        for (int i = 0; i < VW; i++) sums[v] += lanes[v][i];
    return sums;
#endif
}


/* Dot products of bf16 pairs, AVX512-BF16's _mm512_dpbf16_ps: over vectors of 32 bf16 values a and b, for each of 16
 * float lanes i
 *     acc[i] += a[2i + 1] * b[2i + 1];  acc[i] += a[2i] * b[2i]
 * A product of two bf16 values is exact in float32, so a lane adds two exact products, each sum rounded to nearest
 * even as an FMA would (the instruction also takes subnormal inputs and results as zero).
 *
 * PK_BF16_DOT is 1 where the build has AVX512-BF16 (Cooper Lake, every Xeon since Sapphire Rapids, AMD Zen 4 and 5),
 * 2 in a build with -DPK_EMULATE_AVX512BF16 (PAGEDKERNELS_NATIVE_CFLAGS): the same kernels with this one function in
 * portable vector code, so that a machine without the instruction runs every other line of those kernels (their
 * pairing of values, their tails, the order of their outputs) in the tests; 0 otherwise, where bf16 values are
 * widened to float32 by a 16-bit shift and multiplied in float32 (AVX2, SSE, NEON). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PK_BF16_DOT 1
#elif defined(PK_EMULATE_AVX512BF16)
#define PK_BF16_DOT 2
#else
#define PK_BF16_DOT 0
#endif

#if PK_BF16_DOT
typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vbf32 __attribute__((vector_size(64))); /* 32 bf16 values */
typedef uint32_t vu16 __attribute__((vector_size(64)));

static inline vbf32 load_bf32(const uint16_t *p) {
    vbf32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf16 dot_bf16_pairs(vf16 acc, vbf32 a, vbf32 b) {
#if PK_BF16_DOT == 1
    return (vf16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
#else
    /* vector casts between types of one size reinterpret the bits: the high halves of the 32-bit lanes (odd
     * elements) are those floats already, the low halves shifted up are the even elements' */
    const vu16 au = (vu16)a, bu = (vu16)b;
    acc += (vf16)(au & 0xFFFF0000u) * (vf16)(bu & 0xFFFF0000u);
    acc += (vf16)(au << 16) * (vf16)(bu << 16);
    return acc;
#endif
}

/* A vector of 16 floats as one of the machine's width holding the same total (halves added). */
static inline vfw fold16(vf16 v) {
#if VW == 16
    return v;
#elif VW == 8
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const vfw a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    const vfw b = __builtin_shufflevector(v, v, 8, 9, 10, 11) + __builtin_shufflevector(v, v, 12, 13, 14, 15);
    return a + b;
#endif
}
#endif

#endif
