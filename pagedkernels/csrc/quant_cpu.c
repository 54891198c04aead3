/* pagedkernels' native CPU kernels for quantized weights: GEMM (x @ W^T) directly on packed weights, and
 * de-quantization to float. Same build and calling convention as paged_attention_cpu.c.
 *
 * Weight formats (every row of W is one output feature; blocks run along K):
 *   WQ4   pagedkernels' canonical int4 (pagedkernels/quant_formats.py): row = K/2 bytes in blocks of 32
 *         values, 16 bytes each: byte j holds value j (low nibble) and value 16 + j (high nibble);
 *         w = (q - zero[g]) * scale[g], g = k / group_size (group_size a multiple of 32)
 *   WQ8   canonical int8: row = K bytes, q unsigned, same scales and zeros
 *   Q8_0, Q4_0, Q4_1, Q4_K, Q6_K: GGUF's blocks, exactly as in a .gguf file (ggml-quants.h)
 *   Q4_0X8, Q4_1X8, Q8_0X8: Q4_0 / Q4_1 / Q8_0 with 8 rows interleaved (pagedkernels.gguf_interleave; N a
 *         multiple of 8): per group of 8 rows and block b of 32 values, 144 (Q4_0X8), 160 (Q4_1X8) or 272
 *         (Q8_0X8) bytes: the 8 rows' d (f16), for Q4_1X8 their 8 m, then chunks j of 32 bytes, chunk j
 *         holding row r's qs[4j..4j+3] at bytes 4r..4r+3 (4 chunks of nibbles, or 8 of Q8_0's int8 values).
 *         One 32-bit lane per row: a Q4 chunk's low nibbles are values
 *         4j..4j+3 of the 8 rows, its high nibbles values 16+4j..16+4j+3 (a Q8 chunk: values 4j..4j+3), so
 *         an integer dot against 4 broadcast activation bytes sums 8 rows at once and the block's scales
 *         apply to the 8 rows in one vector (llama.cpp's repacked q4_0x8 has the same aim; the lane order
 *         here is ours).
 *
 * The GEMM follows llama.cpp: each activation row is quantized to int8 in blocks of 32 (scale
 * dx = max|x| / 127, xq = round(x / dx)), and every block of 32 weights meets its activation block in
 * an integer dot product (AVX2 maddubs, or AVX-512 VNNI where the compiler targets it), scaled in
 * float32. A weight block's zero point or minimum multiplies the block's sum of quantized activations.
 * So out = sum_k w[n,k] * xq~[m,k] exactly up to float32 rounding, where xq~ = dx * xq: the
 * result differs from x @ W^T by sum_k w[n,k] * (xq~ - x)[m,k], at most sum_k |w[n,k]| * dx(k) / 2.
 *
 * Parallel over output features (OpenMP); rows of W are visited in tiles of NT while up to MR
 * activation rows reuse each unpacked weight block from registers.
 */
#include "cpu_common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PK_AVX2 1
#else
#define PK_AVX2 0
#endif

enum { WQ4 = 0, WQ8 = 1, Q8_0 = 8, Q4_0 = 2, Q4_1 = 3, Q4_K = 12, Q6_K = 14, Q4_0X8 = 102, Q4_1X8 = 103,
       Q8_0X8 = 108 };

#define QK 32        /* activation block */
#define QK_K 256     /* K-quant super-block */
#define MR 4         /* activation rows per pass over a weight row */
#define NT 16        /* weight rows per tile */
#define PARALLEL_MIN_WEIGHTS 32768

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* Bytes of one weight row of K values; 0 for an unknown format. */
static int64_t row_bytes_of(int fmt, int64_t K) {
    switch (fmt) {
    case WQ4: return K / 2;
    case WQ8: return K;
    case Q8_0: case Q8_0X8: return K / 32 * 34;
    case Q4_0: case Q4_0X8: return K / 32 * 18;
    case Q4_1: case Q4_1X8: return K / 32 * 20;
    case Q4_K: return K / QK_K * 144;
    case Q6_K: return K / QK_K * 210;
    default: return 0;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* activations                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/* One activation row quantized: xq [K] int8, per block of 32: dx (scale), sx = dx * sum(xq) (the
 * block's sum as the integer dot sees it), and per half-block of 16 the integer sum bs16. */
typedef struct {
    int8_t *xq;
    float *dx, *sx;
    int32_t *bs16;
} qrow;

static void quantize_row(const float *x, int64_t K, qrow r) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < QK; i++) {
            const int q = (int)nearbyintf(v[i] * id);
            r.xq[b * QK + i] = (int8_t)q;
            if (i < 16) s0 += q; else s1 += q;
        }
        r.dx[b] = d;
        r.sx[b] = d * (float)(s0 + s1);
        r.bs16[2 * b] = s0;
        r.bs16[2 * b + 1] = s1;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* integer dot products of one block of 32                                                        */
/* ---------------------------------------------------------------------------------------------- */

#if PK_AVX2
typedef __m256i iblock; /* 32 weight bytes as the dot wants them */

/* 8 int32 lanes summing to sum_i u[i] * s[i], u unsigned bytes (< 128 in every use but WQ8/Q8_0's
 * absolute values, <= 128), s signed bytes in [-127, 127]: no int16 pair overflows. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles (values 0..15) then high nibbles (16..31). */
static inline __m256i unpack_nibbles16(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}
#endif

/* ---------------------------------------------------------------------------------------------- */
/* one weight row against up to MR activation rows                                                */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    int fmt;
    int64_t K, group_size;
    const void *scales, *zeros; /* WQ4/WQ8: [N, K / group_size] rows of this weight row; zeros may be NULL */
    int sz_dt;
} wdesc;

static inline float load_param(const void *p, int64_t i, int dt) {
    if (dt == 0) return ((const float *)p)[i];
    if (dt == 1) return half_to_float(((const uint16_t *)p)[i]);
    return bf16_to_float(((const uint16_t *)p)[i]);
}

/* 6-bit scale and min of sub-block j of a Q4_K super-block (ggml's get_scale_min_k4). */
static inline void q4k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q6_K: the 32 values of sub-block t (0..7) of a super-block, as unsigned 6-bit q (w = d * sc * (q - 32)). */
static inline void q6k_values(const uint8_t *blk, int t, uint8_t *q) {
    const uint8_t *ql = blk + (t / 4) * 64, *qh = blk + 128 + (t / 4) * 32;
    const int part = t % 4; /* 0: ql[l] low, 1: ql[l+32] low, 2: ql[l] high, 3: ql[l+32] high */
    for (int l = 0; l < 32; l++) {
        const uint8_t lo = part == 0 ? ql[l] & 0xF : part == 1 ? ql[l + 32] & 0xF : part == 2 ? ql[l] >> 4 : ql[l + 32] >> 4;
        q[l] = lo | (((qh[l] >> (2 * part)) & 3) << 4);
    }
}

/* The 32 weight values of block b of a row as unsigned bytes, and how the block's integer dot
 * isum = sum q * xq turns into float: contribution = mul * dx * isum + add * sx (+ Q6_K's per-16
 * scale, see below). For Q6_K, sc16 holds the two per-16 scales and mul = d. Scalar reference used by
 * the portable path and by de-quantization. */
typedef struct {
    float mul, add;
    int sc16[2]; /* Q6_K only */
    int is_signed; /* WQ8 / Q8_0: q are signed bytes */
} bparams;

#define PK_INLINE static inline __attribute__((always_inline))

/* fmt is w->fmt; the SIMD kernel passes it as a constant, so each format gets its own copy of the loop. */
PK_INLINE bparams block_params_of(const int fmt, const wdesc *w, const uint8_t *row, int64_t n_row_param,
                                  int64_t b) {
    bparams p = {0.0f, 0.0f, {0, 0}, 0};
    switch (fmt) {
    case WQ4:
    case WQ8: {
        const int64_t g = n_row_param + (b * QK) / w->group_size;
        const float s = load_param(w->scales, g, w->sz_dt);
        const float z = w->zeros ? load_param(w->zeros, g, w->sz_dt) : (w->fmt == WQ4 ? 8.0f : 128.0f);
        p.mul = s;
        /* WQ8 values enter the dot as q - 128 (signed bytes) */
        p.add = -s * (w->fmt == WQ8 ? z - 128.0f : z);
        p.is_signed = w->fmt == WQ8;
        break;
    }
    case Q8_0: {
        const uint8_t *blk = row + b * 34;
        uint16_t d;
        memcpy(&d, blk, 2);
        p.mul = half_to_float(d);
        p.is_signed = 1;
        break;
    }
    case Q4_0: {
        uint16_t d;
        memcpy(&d, row + b * 18, 2);
        p.mul = half_to_float(d);
        p.add = -8.0f * p.mul;
        break;
    }
    case Q4_1: {
#if PK_AVX2
        int32_t dm;
        memcpy(&dm, row + b * 20, 4);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        p.mul = _mm_cvtss_f32(f);
        p.add = _mm_cvtss_f32(_mm_movehdup_ps(f));
#else
        uint16_t d, m;
        memcpy(&d, row + b * 20, 2);
        memcpy(&m, row + b * 20 + 2, 2);
        p.mul = half_to_float(d);
        p.add = half_to_float(m);
#endif
        break;
    }
    case Q4_K: {
        const uint8_t *blk = row + (b / 8) * 144;
        uint16_t d, dmin;
        memcpy(&d, blk, 2);
        memcpy(&dmin, blk + 2, 2);
        int sc, m;
        q4k_scale_min((int)(b % 8), blk + 4, &sc, &m);
        p.mul = half_to_float(d) * (float)sc;
        p.add = -half_to_float(dmin) * (float)m;
        break;
    }
    case Q6_K: {
        const uint8_t *blk = row + (b / 8) * 210;
        uint16_t d;
        memcpy(&d, blk + 208, 2);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const int t = (int)(b % 8);
        p.mul = half_to_float(d);
        p.sc16[0] = sc[2 * t];
        p.sc16[1] = sc[2 * t + 1];
        break;
    }
    }
    return p;
}

static inline bparams block_params(const wdesc *w, const uint8_t *row, int64_t n_row_param, int64_t b) {
    return block_params_of(w->fmt, w, row, n_row_param, b);
}

/* Unsigned (or, is_signed, two's-complement) bytes of block b's 32 values, in value order. */
static inline void block_values(int fmt, const uint8_t *row, int64_t b, uint8_t *q) {
    switch (fmt) {
    case WQ4:
    case Q4_0:
    case Q4_1: {
        const uint8_t *qs = fmt == WQ4 ? row + b * 16 : fmt == Q4_0 ? row + b * 18 + 2 : row + b * 20 + 4;
        for (int j = 0; j < 16; j++) {
            q[j] = qs[j] & 0xF;
            q[j + 16] = qs[j] >> 4;
        }
        break;
    }
    case WQ8:
        for (int j = 0; j < 32; j++) q[j] = row[b * 32 + j] ^ 0x80; /* q - 128 as a signed byte */
        break;
    case Q8_0:
        memcpy(q, row + b * 34 + 2, 32);
        break;
    case Q4_K: {
        const uint8_t *qs = row + (b / 8) * 144 + 16 + ((b % 8) / 2) * 32;
        const int shift = (int)(b % 2) * 4;
        for (int j = 0; j < 32; j++) q[j] = (qs[j] >> shift) & 0xF;
        break;
    }
    case Q6_K:
        q6k_values(row + (b / 8) * 210, (int)(b % 8), q);
        break;
    }
}

/* Dequantized block: 32 floats. */
static inline void block_dequantize(const wdesc *w, const uint8_t *row, int64_t n_row_param, int64_t b, float *out) {
    uint8_t q[32];
    block_values(w->fmt, row, b, q);
    const bparams p = block_params(w, row, n_row_param, b);
    for (int j = 0; j < 32; j++) {
        const float v = p.is_signed ? (float)(int8_t)q[j] : (float)q[j];
        if (w->fmt == Q6_K)
            out[j] = p.mul * (float)p.sc16[j / 16] * (v - 32.0f);
        else
            out[j] = p.mul * v + p.add;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* 8 rows interleaved (Q4_0X8, Q4_1X8)                                                            */
/* ---------------------------------------------------------------------------------------------- */

static inline int is_x8(int fmt) { return fmt == Q4_0X8 || fmt == Q4_1X8 || fmt == Q8_0X8; }

/* Bytes of one block of a group of 8 rows. */
static inline int64_t x8_block_bytes(int fmt) { return fmt == Q4_0X8 ? 144 : fmt == Q4_1X8 ? 160 : 272; }

/* Row r (0..7) of a group's block at blk: its 32 values as unsigned bytes and its parameters. */
static inline bparams x8_row_block(int fmt, const uint8_t *blk, int r, uint8_t *q) {
    bparams p = {0.0f, 0.0f, {0, 0}, 0};
    uint16_t h;
    memcpy(&h, blk + 2 * r, 2);
    p.mul = half_to_float(h);
    if (fmt == Q4_1X8) {
        memcpy(&h, blk + 16 + 2 * r, 2);
        p.add = half_to_float(h);
    } else {
        p.add = (fmt == Q8_0X8 ? -128.0f : -8.0f) * p.mul;
    }
    const uint8_t *qs = blk + (fmt == Q4_1X8 ? 32 : 16);
    if (fmt == Q8_0X8) { /* int8 w as q = w + 128 (unsigned), w = d * q - 128 d */
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++) q[4 * j + i] = qs[32 * j + 4 * r + i] ^ 0x80;
        return p;
    }
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) {
            const uint8_t byte = qs[32 * j + 4 * r + i];
            q[4 * j + i] = byte & 0xF;
            q[16 + 4 * j + i] = byte >> 4;
        }
    return p;
}

/* Portable kernel of one group of 8 rows: out[m * ldo + r] for mr activation rows. */
static void x8_group_dot_scalar(int fmt, const uint8_t *grp, int64_t nb, const qrow *xs, int mr, float *out,
                                int64_t ldo) {
    for (int r = 0; r < 8; r++) {
        double acc[MR] = {0};
        for (int64_t b = 0; b < nb; b++) {
            uint8_t q[32];
            const bparams p = x8_row_block(fmt, grp + b * x8_block_bytes(fmt), r, q);
            for (int m = 0; m < mr; m++) {
                const int8_t *xq = xs[m].xq + b * QK;
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) dot += (int32_t)q[j] * xq[j];
                acc[m] += (double)(p.mul * xs[m].dx[b]) * dot + (double)p.add * xs[m].sx[b];
            }
        }
        for (int m = 0; m < mr; m++) out[m * ldo + r] = (float)acc[m];
    }
}

/* Portable row kernel: out[m] = sum_b contribution(b, m) for mr activation rows. */
static void row_dot_scalar(const wdesc *w, const uint8_t *row, int64_t n_row_param, const qrow *xs, int mr,
                           float *out) {
    double acc[MR] = {0};
    for (int64_t b = 0; b < w->K / QK; b++) {
        uint8_t q[32];
        block_values(w->fmt, row, b, q);
        const bparams p = block_params(w, row, n_row_param, b);
        for (int m = 0; m < mr; m++) {
            const int8_t *xq = xs[m].xq + b * QK;
            if (w->fmt == Q6_K) {
                int32_t total = 0;
                for (int h = 0; h < 2; h++) {
                    int32_t dot = 0;
                    for (int j = 16 * h; j < 16 * h + 16; j++) dot += (int32_t)q[j] * xq[j];
                    total += p.sc16[h] * (dot - 32 * xs[m].bs16[2 * b + h]);
                }
                acc[m] += (double)(p.mul * xs[m].dx[b]) * total;
            } else {
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) dot += (p.is_signed ? (int32_t)(int8_t)q[j] : (int32_t)q[j]) * xq[j];
                acc[m] += (double)(p.mul * xs[m].dx[b]) * dot + (double)p.add * xs[m].sx[b];
            }
        }
    }
    for (int m = 0; m < mr; m++) out[m] = (float)acc[m];
}

#if PK_AVX2
/* One block b of the row against the mr activation rows, into acc / acc_s. */
PK_INLINE void block_step(const int fmt, const wdesc *w, const uint8_t *row, int64_t n_row_param, const qrow *xs,
                          const int mr, int64_t b, __m256 *acc, float *acc_s) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i q;
    const bparams p = block_params_of(fmt, w, row, n_row_param, b);
    switch (fmt) {
    case WQ4: q = unpack_nibbles16(row + b * 16); break;
    case Q4_0: q = unpack_nibbles16(row + b * 18 + 2); break;
    case Q4_1: q = unpack_nibbles16(row + b * 20 + 4); break;
    case WQ8:
        q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + b * 32)), _mm256_set1_epi8((char)0x80));
        break;
    case Q8_0: q = _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2)); break;
    case Q4_K: {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + (b / 8) * 144 + 16 + ((b % 8) / 2) * 32));
        q = (b % 2) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : _mm256_and_si256(v, low4);
        break;
    }
    default: { /* Q6_K */
        const uint8_t *blk = row + (b / 8) * 210;
        const int t = (int)(b % 8), part = t % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + (t / 4) * 64 + (part & 1) * 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + (t / 4) * 32));
        const __m256i lo = (part & 2) ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4) : _mm256_and_si256(ql, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * part), _mm256_set1_epi8(3));
        q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        break;
    }
    }
    if (fmt == Q6_K) {
        /* per-16 scales: lanes 0..3 of the int32 dot are values 0..15, lanes 4..7 values 16..31 */
        const __m256i sc = _mm256_setr_epi32(p.sc16[0], p.sc16[0], p.sc16[0], p.sc16[0], p.sc16[1], p.sc16[1],
                                             p.sc16[1], p.sc16[1]);
        for (int m = 0; m < mr; m++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs[m].xq + b * QK));
            const __m256i d = _mm256_mullo_epi32(dot_u8s8(q, xv), sc);
            const float f = p.mul * xs[m].dx[b];
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(f), acc[m]);
            acc_s[m] -= 32.0f * f * (float)(p.sc16[0] * xs[m].bs16[2 * b] + p.sc16[1] * xs[m].bs16[2 * b + 1]);
        }
    } else if (fmt == WQ8 || fmt == Q8_0) {
        const __m256i aq = _mm256_sign_epi8(q, q);
        for (int m = 0; m < mr; m++) {
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xs[m].xq + b * QK)), q);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(aq, xv)), _mm256_set1_ps(p.mul * xs[m].dx[b]),
                                     acc[m]);
            if (fmt == WQ8) acc_s[m] += p.add * xs[m].sx[b];
        }
    } else {
        for (int m = 0; m < mr; m++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs[m].xq + b * QK));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q, xv)), _mm256_set1_ps(p.mul * xs[m].dx[b]),
                                     acc[m]);
            acc_s[m] += p.add * xs[m].sx[b];
        }
    }
}

/* AVX2 row kernel: per block, the weight bytes are unpacked once into a register and meet each of the
 * mr activation blocks in dot_u8s8; 8 float lanes accumulate mul * dx * isum per activation row and a
 * scalar the add * sx terms. Signed weights (WQ8, Q8_0) use the sign trick: |w| (unsigned) against
 * xq with w's sign. Even and odd blocks accumulate apart (two chains of fused multiply-adds instead of
 * one: at one activation row the chain's latency, not the work, bounds a block). */
PK_INLINE void row_dot_avx2_of(const int fmt, const wdesc *w, const uint8_t *row, int64_t n_row_param,
                               const qrow *xs, const int mr, float *out) {
    __m256 acc0[MR], acc1[MR];
    float acc_s[MR];
    for (int m = 0; m < MR; m++) {
        acc0[m] = acc1[m] = _mm256_setzero_ps();
        acc_s[m] = 0.0f;
    }
    const int64_t nb = w->K / QK;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        block_step(fmt, w, row, n_row_param, xs, mr, b, acc0, acc_s);
        block_step(fmt, w, row, n_row_param, xs, mr, b + 1, acc1, acc_s);
    }
    if (b < nb) block_step(fmt, w, row, n_row_param, xs, mr, b, acc0, acc_s);
    for (int m = 0; m < mr; m++) out[m] = hsum8(_mm256_add_ps(acc0[m], acc1[m])) + acc_s[m];
}

/* acc + the 8 int32 lanes of dot_u8s8(u, s). */
static inline __m256i dot_acc_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, dot_u8s8(u, s));
#endif
}

static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One block of a group of 8 rows against mr activation rows: lane r of acc[m] gathers row r. The 4 chunks
 * are unpacked once (8 registers of 8 rows x 4 values) and meet 8 broadcast activation words per row m, in
 * two chains of 4 integer dots; the block's d (and m or -8 d) scale the 8 rows' sums in one vector each. */
PK_INLINE void x8_block_step(const int fmt, const uint8_t *blk, const qrow *xs, const int mr, int64_t b,
                             __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const uint8_t *qs = blk + (fmt == Q4_1X8 ? 32 : 16);
    /* lo[j]: values 4j..4j+3 of the 8 rows, hi[j]: values 16+4j..16+4j+3, as unsigned bytes */
    __m256i lo[4], hi[4];
#if !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
    /* Q8_0X8 without VNNI: maddubs saturates its int16 pairs, so the sign trick of the row kernel (|w| against
     * x with w's sign: pairs of at most 2 * 128 * 127) instead of w + 128 (up to 2 * 255 * 127) */
    if (fmt == Q8_0X8) {
        __m256i w[8], aw[8]; /* the chunks, and their absolute values (once per block, not per row m) */
        for (int j = 0; j < 8; j++) {
            w[j] = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            aw[j] = _mm256_sign_epi8(w[j], w[j]);
        }
        for (int m = 0; m < mr; m++) {
            const int8_t *x = xs[m].xq + b * QK;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                s0 = dot_acc_u8s8(s0, aw[j], _mm256_sign_epi8(broadcast4(x + 4 * j), w[j]));
                s1 = dot_acc_u8s8(s1, aw[j + 4], _mm256_sign_epi8(broadcast4(x + 16 + 4 * j), w[j + 4]));
            }
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[m].dx[b])), isum, acc[m]);
        }
        return;
    }
#endif
    const __m256 add = fmt == Q4_1X8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                                     : _mm256_mul_ps(d, _mm256_set1_ps(fmt == Q8_0X8 ? -128.0f : -8.0f));
    for (int j = 0; j < 4; j++) {
        if (fmt == Q8_0X8) { /* VNNI: w + 128 as unsigned bytes, the -128 d sx term below */
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            lo[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)), flip);
            hi[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 32 * (j + 4))), flip);
        } else {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            lo[j] = _mm256_and_si256(v, low4);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
    }
    for (int m = 0; m < mr; m++) {
        const int8_t *x = xs[m].xq + b * QK;
        __m256i s0 = dot_u8s8(lo[0], broadcast4(x)), s1 = dot_u8s8(hi[0], broadcast4(x + 16));
        for (int j = 1; j < 4; j++) {
            s0 = dot_acc_u8s8(s0, lo[j], broadcast4(x + 4 * j));
            s1 = dot_acc_u8s8(s1, hi[j], broadcast4(x + 16 + 4 * j));
        }
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs[m].dx[b])), isum, acc[m]);
        acc[m] = _mm256_fmadd_ps(add, _mm256_set1_ps(xs[m].sx[b]), acc[m]);
    }
}

/* One group of 8 rows: out[m * ldo + r]; even and odd blocks accumulate apart, as in row_dot_avx2_of. */
PK_INLINE void x8_group_dot_of(const int fmt, const uint8_t *grp, int64_t nb, const qrow *xs, const int mr,
                               float *out, int64_t ldo) {
    __m256 acc0[MR], acc1[MR];
    for (int m = 0; m < MR; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const int64_t bs = x8_block_bytes(fmt);
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        x8_block_step(fmt, grp + b * bs, xs, mr, b, acc0);
        x8_block_step(fmt, grp + (b + 1) * bs, xs, mr, b + 1, acc1);
    }
    if (b < nb) x8_block_step(fmt, grp + b * bs, xs, mr, b, acc0);
    for (int m = 0; m < mr; m++) _mm256_storeu_ps(out + m * ldo, _mm256_add_ps(acc0[m], acc1[m]));
}

static void x8_group_dot_avx2(int fmt, const uint8_t *grp, int64_t nb, const qrow *xs, int mr, float *out,
                              int64_t ldo) {
    if (fmt == Q4_0X8) {
        if (mr == 1) x8_group_dot_of(Q4_0X8, grp, nb, xs, 1, out, ldo);
        else x8_group_dot_of(Q4_0X8, grp, nb, xs, mr, out, ldo);
    } else if (fmt == Q8_0X8) {
        if (mr == 1) x8_group_dot_of(Q8_0X8, grp, nb, xs, 1, out, ldo);
        else x8_group_dot_of(Q8_0X8, grp, nb, xs, mr, out, ldo);
    } else {
        if (mr == 1) x8_group_dot_of(Q4_1X8, grp, nb, xs, 1, out, ldo);
        else x8_group_dot_of(Q4_1X8, grp, nb, xs, mr, out, ldo);
    }
}

#define PK_ROW_DOT_CASES(MRC)                                                                              \
    switch (w->fmt) {                                                                                       \
    case WQ4: row_dot_avx2_of(WQ4, w, row, n_row_param, xs, MRC, out); break;                               \
    case WQ8: row_dot_avx2_of(WQ8, w, row, n_row_param, xs, MRC, out); break;                               \
    case Q8_0: row_dot_avx2_of(Q8_0, w, row, n_row_param, xs, MRC, out); break;                             \
    case Q4_0: row_dot_avx2_of(Q4_0, w, row, n_row_param, xs, MRC, out); break;                             \
    case Q4_1: row_dot_avx2_of(Q4_1, w, row, n_row_param, xs, MRC, out); break;                             \
    case Q4_K: row_dot_avx2_of(Q4_K, w, row, n_row_param, xs, MRC, out); break;                             \
    default: row_dot_avx2_of(Q6_K, w, row, n_row_param, xs, MRC, out); break;                               \
    }

/* A copy of the row kernel per format, and one more per format for a single activation row (decode). */
static void row_dot_avx2(const wdesc *w, const uint8_t *row, int64_t n_row_param, const qrow *xs, int mr,
                         float *out) {
    if (mr == 1) {
        PK_ROW_DOT_CASES(1)
    } else {
        PK_ROW_DOT_CASES(mr)
    }
}
#endif

/* The quantized activation rows m0 .. m0 + mr - 1 (mr = up to MR of them) of the buffers pk_quant_gemm fills:
 * xq [M, K], dx then sx [M, nb] each, bs16 [M, 2 nb]. Returns mr. */
static inline int activation_rows(int8_t *xq, float *dx, int32_t *bs16, int64_t M, int64_t K, int64_t nb, int64_t m0,
                                  qrow *xs) {
    const int mr = M - m0 < MR ? (int)(M - m0) : MR;
    for (int m = 0; m < mr; m++) {
        const int64_t r = m0 + m;
        xs[m] = (qrow){xq + r * K, dx + r * nb, dx + M * nb + r * nb, bs16 + 2 * r * nb};
    }
    return mr;
}

static int format_ok(int fmt, int64_t N, int64_t K, int64_t group_size) {
    if (row_bytes_of(fmt, K) == 0 || K <= 0) return 0;
    if (is_x8(fmt) && N % 8) return 0;
    if ((fmt == Q4_K || fmt == Q6_K) ? K % QK_K : K % QK) return 0;
    if ((fmt == WQ4 || fmt == WQ8) && (group_size <= 0 || group_size % QK || K % group_size)) return 0;
    return 1;
}

/* out [M, N] (row stride o_s0, dtype o_dt) = x [M, K] (row stride x_s0, dtype x_dt) @ W^T, W [N, K] in
 * format fmt (rows of row_bytes(fmt, K) bytes, consecutive); scales/zeros (WQ only) [N, K / group_size]
 * contiguous, dtype sz_dt, zeros NULL = symmetric (8 for WQ4, 128 for WQ8).
 * Returns 0; -1 for an unsupported format or shape (checked in Python first); -2 out of memory. */
int pk_quant_gemm(const void *x, int64_t x_s0, int x_dt, int64_t M, int64_t K, const uint8_t *weight, int64_t N,
                  int fmt, int64_t group_size, const void *scales, const void *zeros, int sz_dt, void *out,
                  int64_t o_s0, int o_dt, int num_threads) {
    if (!format_ok(fmt, N, K, group_size)) return -1;
    if (M <= 0 || N <= 0) return 0;
    const wdesc w = {fmt, K, group_size, scales, zeros, sz_dt};
    const int64_t row_bytes = row_bytes_of(fmt, K), nb = K / QK;
    const int64_t groups = (fmt == WQ4 || fmt == WQ8) ? K / group_size : 0;
    /* quantized activations: xq, then dx, sx, bs16 per row */
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(2 * M * nb));
    int32_t *bs16 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * M * nb));
    float *outf = (float *)malloc(sizeof(float) * (size_t)(M * N));
    int failed = !xq || !dx || !bs16 || !outf;
    if (!failed) {
        const int threads_x = M * K >= PARALLEL_MIN_WEIGHTS ? num_threads : 1;
#pragma omp parallel num_threads(threads_x)
        {
            float *tmp = (float *)malloc(sizeof(float) * (size_t)K);
            if (!tmp) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                if (!tmp) continue;
                const float *xr = load_row(x, m * x_s0, x_dt, K, tmp);
                const qrow r = {xq + m * K, dx + m * nb, dx + M * nb + m * nb, bs16 + 2 * m * nb};
                quantize_row(xr, K, r);
            }
            free(tmp);
        }
    }
    if (!failed && is_x8(fmt)) {
        const int threads = N * K >= PARALLEL_MIN_WEIGHTS ? num_threads : 1;
        const int64_t group_bytes = nb * x8_block_bytes(fmt);
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t g = 0; g < N / 8; g++) {
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                qrow xs[MR];
                const int mr = activation_rows(xq, dx, bs16, M, K, nb, m0, xs);
#if PK_AVX2
                x8_group_dot_avx2(fmt, weight + g * group_bytes, nb, xs, mr, outf + m0 * N + g * 8, N);
#else
                x8_group_dot_scalar(fmt, weight + g * group_bytes, nb, xs, mr, outf + m0 * N + g * 8, N);
#endif
            }
        }
        for (int64_t m = 0; m < M; m++) store_row(out, m * o_s0, o_dt, N, outf + m * N);
    } else if (!failed) {
        const int threads = N * K >= PARALLEL_MIN_WEIGHTS ? num_threads : 1;
        const int64_t tiles = (N + NT - 1) / NT;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t n_end = (tile + 1) * NT < N ? (tile + 1) * NT : N;
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                qrow xs[MR];
                const int mr = activation_rows(xq, dx, bs16, M, K, nb, m0, xs);
                for (int64_t n = tile * NT; n < n_end; n++) {
                    float res[MR];
#if PK_AVX2
                    row_dot_avx2(&w, weight + n * row_bytes, n * groups, xs, mr, res);
#else
                    row_dot_scalar(&w, weight + n * row_bytes, n * groups, xs, mr, res);
#endif
                    for (int m = 0; m < mr; m++) outf[(m0 + m) * N + n] = res[m];
                }
            }
        }
        for (int64_t m = 0; m < M; m++) store_row(out, m * o_s0, o_dt, N, outf + m * N);
    }
    free(xq);
    free(dx);
    free(bs16);
    free(outf);
    (void)row_dot_scalar;
    (void)x8_group_dot_scalar;
    return failed ? -2 : 0;
}

/* out [N, K] (row stride o_s0, dtype o_dt) = W de-quantized; arguments as for pk_quant_gemm. */
int pk_quant_dequantize(const uint8_t *weight, int64_t N, int64_t K, int fmt, int64_t group_size,
                        const void *scales, const void *zeros, int sz_dt, void *out, int64_t o_s0, int o_dt,
                        int num_threads) {
    if (!format_ok(fmt, N, K, group_size)) return -1;
    const wdesc w = {fmt, K, group_size, scales, zeros, sz_dt};
    const int64_t row_bytes = row_bytes_of(fmt, K), nb = K / QK;
    const int64_t groups = (fmt == WQ4 || fmt == WQ8) ? K / group_size : 0;
    int failed = 0;
#pragma omp parallel num_threads(N * K >= PARALLEL_MIN_WEIGHTS ? num_threads : 1)
    {
        float *tmp = (float *)malloc(sizeof(float) * (size_t)K);
        if (!tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!tmp) continue;
            if (is_x8(fmt)) {
                const uint8_t *grp = weight + (n / 8) * nb * x8_block_bytes(fmt);
                for (int64_t b = 0; b < nb; b++) {
                    uint8_t q[32];
                    const bparams p = x8_row_block(fmt, grp + b * x8_block_bytes(fmt), (int)(n % 8), q);
                    for (int j = 0; j < 32; j++) tmp[b * QK + j] = p.mul * (float)q[j] + p.add;
                }
            } else {
                for (int64_t b = 0; b < nb; b++) block_dequantize(&w, weight + n * row_bytes, n * groups, b, tmp + b * QK);
            }
            store_row(out, n * o_s0, o_dt, K, tmp);
        }
        free(tmp);
    }
    return failed ? -2 : 0;
}

/* Whether this build took the AVX2 path (reported by the Python side and the benchmark). */
int pk_quant_simd_level(void) {
#if PK_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 3;
#elif PK_AVX2 && defined(__AVXVNNI__)
    return 2;
#elif PK_AVX2
    return 1;
#else
    return 0;
#endif
}
