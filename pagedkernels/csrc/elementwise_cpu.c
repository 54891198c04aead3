/* pagedkernels' native CPU kernels for the per-token ops: RMSNorm (plain and with the residual add),
 * rotary embedding and SiLU-and-mul. Same build and calling convention as paged_attention_cpu.c:
 * Python checks shapes, dtypes and strides; row strides are in elements and the last dimension is
 * contiguous. Arithmetic is float32 (the sum of squares in float64), each result rounded once to
 * its tensor's dtype, as the ops' PyTorch twins do.
 *
 * Decode-sized calls (a few rows) are tens of microseconds of work, less than waking a second
 * thread costs, so a call only goes parallel from PARALLEL_MIN_ELEMENTS elements up.
 */
#include "cpu_common.h"

#define PARALLEL_MIN_ELEMENTS 65536
#define MAX_ROTARY_HALF 256 /* rot_dim <= 512; larger calls take the PyTorch twin */

static inline int threads_for(int64_t elements, int num_threads) {
    return elements >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
}

/* res == NULL:  out = x / sqrt(mean(x^2) + eps) * w
 * res != NULL:  res = round_res(x + res);  out = res / sqrt(mean(res^2) + eps) * w
 * out may be x itself (each row is read whole before it is written). Returns 0, -2 out of memory. */
int pk_rms_norm(const void *x, int64_t x_s0, int x_dt, void *res, int64_t r_s0, int r_dt, const void *w, int w_dt,
                void *out, int64_t o_s0, int o_dt, int64_t rows, int64_t hidden, float eps, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads_for(rows * hidden, num_threads))
    {
        /* per thread: the weight as float32, one row of x, one of the residual, one of output */
        float *buf = (float *)malloc(sizeof(float) * 4 * hidden);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        } else {
            const float *wf = load_row(w, 0, w_dt, hidden, buf);
            if (wf != buf) memcpy(buf, wf, sizeof(float) * hidden);
            float *xtmp = buf + hidden, *rtmp = buf + 2 * hidden, *otmp = buf + 3 * hidden;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                const float *v = load_row(x, r * x_s0, x_dt, hidden, xtmp);
                if (res) {
                    const float *rv = load_row(res, r * r_s0, r_dt, hidden, rtmp);
                    float *sum = r_dt == 0 ? (float *)res + r * r_s0 : rtmp;
#pragma omp simd
                    for (int64_t d = 0; d < hidden; d++) sum[d] = round_to_dtype(v[d] + rv[d], r_dt);
                    if (r_dt != 0) store_row(res, r * r_s0, r_dt, hidden, sum);
                    v = sum;
                }
                double ss = 0.0;
#pragma omp simd reduction(+ : ss)
                for (int64_t d = 0; d < hidden; d++) ss += (double)v[d] * v[d];
                const float rstd = 1.0f / sqrtf((float)(ss / (double)hidden) + eps);
                float *o = o_dt == 0 ? (float *)out + r * o_s0 : otmp;
#pragma omp simd
                for (int64_t d = 0; d < hidden; d++) o[d] = (v[d] * rstd) * buf[d];
                if (o_dt != 0) store_row(out, r * o_s0, o_dt, hidden, o);
            }
            free(buf);
        }
    }
    return failed ? -2 : 0;
}

/* One token's heads [num_heads, head stride h_s] rotated in place: pairs (x[d], x[d + half]) (neox)
 * or (x[2d], x[2d + 1]) (GPT-J), x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin; dims past 2 * half
 * untouched. */
static void rotate_heads(void *base, int64_t offset, int64_t h_s, int num_heads, int dtype, const float *cos,
                         const float *sin, int half, int is_neox, float *tmp) {
    const int rot = 2 * half;
    for (int h = 0; h < num_heads; h++) {
        const int64_t off = offset + h * h_s;
        /* float32 rows rotate in place; 16-bit ones are converted into tmp and stored back */
        float *x = dtype == 0 ? (float *)base + off : (float *)load_row(base, off, dtype, rot, tmp);
        if (is_neox) {
            float *x1 = x, *x2 = x + half;
#pragma omp simd
            for (int d = 0; d < half; d++) {
                const float a = x1[d], b = x2[d];
                x1[d] = a * cos[d] - b * sin[d];
                x2[d] = b * cos[d] + a * sin[d];
            }
        } else {
            for (int d = 0; d < half; d++) {
                const float a = x[2 * d], b = x[2 * d + 1];
                x[2 * d] = a * cos[d] - b * sin[d];
                x[2 * d + 1] = b * cos[d] + a * sin[d];
            }
        }
        if (dtype != 0) store_row(base, off, dtype, rot, x);
    }
}

/* q [num_tokens, nq heads] and k (NULL or [num_tokens, nk heads]) rotated in place by their tokens'
 * positions; cos_sin [max_position, 2 * half] = cat(cos, sin). Returns 0, or 1 (nothing written)
 * when a position is outside [0, max_position). */
int pk_rotary_embedding(const int64_t *positions, int64_t num_tokens, void *q, int64_t q_s0, int64_t q_s1, int nq,
                        void *k, int64_t k_s0, int64_t k_s1, int nk, int dtype, const void *cos_sin, int64_t cs_s0,
                        int cs_dt, int half, int is_neox, int64_t max_position, int num_threads) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return 1;
    const int64_t work = num_tokens * (int64_t)(nq + nk) * 2 * half;
#pragma omp parallel for schedule(static) num_threads(threads_for(work, num_threads))
    for (int64_t t = 0; t < num_tokens; t++) {
        float cs[4 * MAX_ROTARY_HALF]; /* cos, sin, then one converted 16-bit row of 2 * half */
        float *cos = cs, *sin = cs + half, *tmp = cs + 2 * half;
        const float *row = load_row(cos_sin, positions[t] * cs_s0, cs_dt, 2 * half, cos);
        if (row != cos) memcpy(cos, row, sizeof(float) * 2 * half);
        rotate_heads(q, t * q_s0, q_s1, nq, dtype, cos, sin, half, is_neox, tmp);
        if (k) rotate_heads(k, t * k_s0, k_s1, nk, dtype, cos, sin, half, is_neox, tmp);
    }
    return 0;
}

/* out[r, :] = silu(x[r, :d]) * x[r, d:], silu(g) = g / (1 + exp(-g)) with exp taken of -|g| (never
 * overflows): g >= 0: g / (1 + e), g < 0: g e / (1 + e), e = exp(-|g|). Returns 0, -2 out of memory. */
int pk_silu_and_mul(const void *x, int64_t x_s0, void *out, int64_t o_s0, int64_t rows, int64_t d, int dtype,
                    int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads_for(rows * d, num_threads))
    {
        float *buf = dtype == 0 ? NULL : (float *)malloc(sizeof(float) * 3 * d);
        const int ok = dtype == 0 || buf != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!ok) continue;
            const float *g = load_row(x, r * x_s0, dtype, d, buf);
            const float *u = load_row(x, r * x_s0 + d, dtype, d, buf ? buf + d : NULL);
            float *o = dtype == 0 ? (float *)out + r * o_s0 : buf + 2 * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) {
                const float gi = g[i];
                const float e = exp_nonpositive(gi >= 0.0f ? -gi : gi);
                const float silu = (gi >= 0.0f ? gi : gi * e) / (1.0f + e);
                o[i] = silu * u[i];
            }
            if (dtype != 0) store_row(out, r * o_s0, dtype, d, o);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}
