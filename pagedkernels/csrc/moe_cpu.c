/* Mixture-of-experts on the CPU: the router's top-k (pk_moe_topk) and the experts' MLP (pk_fused_moe), the
 * math of pagedkernels/moe_topk.py and pagedkernels/fused_moe.py.
 *
 * pk_fused_moe is one call for the whole layer, so a CPU graph records it as one kernel (its row count: the
 * tokens): a counting sort puts the routed slots (token t's j-th expert is slot t * top_k + j) in expert order;
 * each expert's slots are then one GEMM against that expert's gate/up panels (w16_panel.h: the 16-bit-weight
 * GEMM's micro-kernel, its input rows gathered from the batch by the sort's index), the gated activation, one
 * GEMM against its down panels, and each token's top_k rows are weighted and summed. The GEMMs run in parallel
 * over (expert, panel) pairs: every output element has one writer, so the result does not depend on the thread
 * count or schedule, and a token's rows are the same additions whatever tokens it is batched with.
 *
 * A bf16 (or fp16) model's hidden states come in and go out in its dtype, and each token's weighted sum is rounded
 * once to the output's dtype. Where the build has AVX512-BF16 (PK_BF16_DOT) and both the hidden states and the panels
 * are bf16, the two GEMMs take the pair dot products of w16_panel.h's panel_rows_dot: GEMM 1 reads the tokens' bf16
 * rows as they are, and the activated rows are rounded to bf16 for GEMM 2, as a dense bf16 MLP rounds them before
 * its down projection (float32 accumulation throughout; the gate/up sums stay float32). Elsewhere the tokens' rows are
 * widened to float32 once per call (into the scratch) and everything after runs as for float32 activations, so the
 * result is the float32 kernel's on the widened rows, rounded.
 *
 * Ids are checked in the sorting pass, before anything is written: an id outside its table returns 1 (the op
 * then raises the ValueError naming it). */
#include "w16_panel.h"

#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_TOP_K 64

/* ---------------------------------------------------------------------------------------------- routing */

/* The first (lowest) index of the largest of v[0..n). */
static inline int64_t best_index(const float *v, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

/* logits [M, E] (dtype l_dt, row stride l_s0) -> weights [M, topk] (dtype w_dt) and int32 ids [M, topk]:
 * softmax (sigmoid when `sigmoid`) scores in float32, selection by the scores plus `bias` ([E], dtype b_dt, or
 * NULL), grouped top-k over num_groups groups keeping topk_groups, the weights renormalized when `renormalize`.
 * Returns 0, -1 for sizes past the limits. */
int pk_moe_topk(const void *logits, int64_t l_s0, int l_dt, int64_t M, int64_t E, int64_t topk, int sigmoid,
                int renormalize, const void *bias, int b_dt, int64_t num_groups, int64_t topk_groups, void *weights,
                int w_dt, int32_t *ids, int num_threads) {
    if (E < 1 || E > MOE_MAX_EXPERTS || topk < 1 || topk > E || topk > MOE_MAX_TOP_K || num_groups < 1 ||
        E % num_groups)
        return -1;
    float bias_f[MOE_MAX_EXPERTS];
    if (bias) {
        const float *b = load_row(bias, 0, b_dt, E, bias_f);
        if (b != bias_f) memcpy(bias_f, b, sizeof(float) * E);
    }
    const int64_t group_size = E / num_groups;
#pragma omp parallel for schedule(static) num_threads(M * E >= 65536 ? num_threads : 1)
    for (int64_t t = 0; t < M; t++) {
        float tmp[MOE_MAX_EXPERTS], score[MOE_MAX_EXPERTS], select[MOE_MAX_EXPERTS], chosen[MOE_MAX_TOP_K];
        const float *z = load_row(logits, t * l_s0, l_dt, E, tmp);
        if (sigmoid) {
            for (int64_t e = 0; e < E; e++) score[e] = 1.0f / (1.0f + expf(-z[e]));
        } else {
            float z_max = z[0], sum = 0.0f;
            for (int64_t e = 1; e < E; e++) z_max = z[e] > z_max ? z[e] : z_max;
            for (int64_t e = 0; e < E; e++) sum += score[e] = exp_nonpositive(z[e] - z_max);
            for (int64_t e = 0; e < E; e++) score[e] /= sum;
        }
        for (int64_t e = 0; e < E; e++) select[e] = bias ? score[e] + bias_f[e] : score[e];
        if (num_groups > 1) {
            float group_score[MOE_MAX_EXPERTS];
            for (int64_t g = 0; g < num_groups; g++) {
                const float *s = select + g * group_size;
                const int64_t first = best_index(s, group_size);
                group_score[g] = s[first];
                if (bias) { /* DeepSeek-V3: the group's two best experts, summed */
                    float second = -INFINITY;
                    for (int64_t i = 0; i < group_size; i++)
                        if (i != first && s[i] > second) second = s[i];
                    group_score[g] += second;
                }
            }
            unsigned char keep[MOE_MAX_EXPERTS];
            memset(keep, 0, (size_t)num_groups);
            for (int64_t n = 0; n < topk_groups; n++) {
                const int64_t g = best_index(group_score, num_groups);
                keep[g] = 1;
                group_score[g] = -INFINITY;
            }
            for (int64_t e = 0; e < E; e++)
                if (!keep[e / group_size]) select[e] = -INFINITY;
        }
        int32_t *row_ids = ids + t * topk;
        float total = 0.0f;
        for (int64_t j = 0; j < topk; j++) {
            const int64_t e = best_index(select, E);
            row_ids[j] = (int32_t)e;
            total += chosen[j] = score[e];
            select[e] = -INFINITY;
        }
        for (int64_t j = 0; j < topk; j++) chosen[j] = renormalize ? chosen[j] / total : chosen[j];
        store_row(weights, t * topk, w_dt, topk, chosen);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------- experts */

/* silu(g) = g / (1 + exp(-g)) with exp taken of -|g| (never overflows), as pk_silu_and_mul: vectorizable. */
static inline float silu(float g) {
    const float e = exp_nonpositive(g >= 0.0f ? -g : g);
    return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

/* 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|). */
static inline float gelu_tanh(float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const float e = exp_nonpositive(-2.0f * (u >= 0.0f ? u : -u));
    const float t = (1.0f - e) / (1.0f + e);
    return 0.5f * g * (1.0f + (u >= 0.0f ? t : -t));
}

static inline int64_t read_id(const void *ids, int ids_64, int64_t i) {
    return ids_64 ? ((const int64_t *)ids)[i] : (int64_t)((const int32_t *)ids)[i];
}

/* One (active expert, panel) item of an experts' GEMM: out rows [first, first + count) of expert e (its sorted rows,
 * from offsets) = its input rows @ panel p of e's packed weight (np panels of K rows of 32, kind w_dt); the next panel
 * prefetched. The expert's input row i is x's row gather[first + i] when gather is given, else x's row first + i.
 * dot: bf16 rows and panels, in pair dot products (PK_BF16_DOT builds only); else float32 rows. */
static inline void expert_item(int64_t item, int64_t np, const int32_t *active, const int32_t *offsets, const void *w,
                               int64_t K, int64_t N, int w_dt, int dot, const void *x, int64_t x_s0,
                               const int32_t *gather, float *out, int64_t o_s0) {
    const int64_t e = active[item / np], p = item % np;
    const int64_t first = offsets[e], count = offsets[e + 1] - first;
    const int64_t panel_bytes = K * NP * W_BYTES(w_dt);
    const char *panel_w = (const char *)w + (e * np + p) * panel_bytes;
    const char *ahead = p + 1 < np ? panel_w + panel_bytes : NULL;
    const int64_t n0 = p * NP;
    const int nc = N - n0 < NP ? (int)(N - n0) : NP;
    const int32_t *rows = gather ? gather + first : NULL;
    const int64_t skip = gather ? 0 : first * x_s0; /* elements to the expert's first row */
#if PK_BF16_DOT
    if (dot) {
        panel_rows_dot((const uint16_t *)x + skip, x_s0, rows, count, K, (const uint16_t *)panel_w, n0, nc,
                       out + first * o_s0, o_s0, 0, (const uint16_t *)ahead);
        return;
    }
#else
    (void)dot;
#endif
    panel_rows((const float *)x + skip, x_s0, rows, count, K, panel_w, n0, nc, w_dt, out + first * o_s0, o_s0, 0,
               ahead);
}

/* x [M, H] (row stride x_s0, dtype x_dt: 0 float32, 1 float16, 2 bfloat16) routed by ids [M, topk] (int32, or
 * int64 with ids_64) with weights tw [M, topk] (dtype tw_dt) through E local experts: w13 packed
 * [E, ceil(2I / 32), H, 32] (gate rows then up rows), w2 packed [E, ceil(H / 32), I, 32], both of kind w_dt (0
 * float32, 1 float16, 2 bfloat16). expert_map (int32 [num_global]) or NULL: global id -> local expert or -1 (not
 * here: the slot adds nothing). act: 0 silu, 1 gelu_tanh. out [M, H] (row stride o_s0, dtype o_dt as x_dt).
 * scratch: pagedkernels.fused_moe.native_scratch_bytes(...) bytes (with its 16-bit hidden's float32 rows when x_dt
 * or o_dt is not 0), 64-byte aligned. Returns 0, 1 for an id outside its table (nothing written), -1 for a bad kind
 * or dtype. */
int pk_fused_moe(const void *x, int64_t x_s0, int x_dt, int64_t M, int64_t H, const void *ids, int ids_64,
                 const void *tw, int tw_dt, int64_t topk, const void *w13, const void *w2, int w_dt, int64_t E,
                 int64_t I, const int32_t *expert_map, int64_t num_global, int act, void *out, int64_t o_s0, int o_dt,
                 void *scratch, int num_threads) {
    if (w_dt < 0 || w_dt > 2 || x_dt < 0 || x_dt > 2 || o_dt < 0 || o_dt > 2 || E < 1 || I < 1 || H < 1 || topk < 1 ||
        topk > MOE_MAX_TOP_K)
        return -1;
    if (M <= 0) return 0;
    const int64_t S = M * topk; /* slots */
    int32_t *offsets = (int32_t *)scratch;   /* [E + 1]: expert e's sorted rows [offsets[e], offsets[e + 1]) */
    int32_t *cursor = offsets + E + 1;       /* [E] */
    int32_t *active = cursor + E;            /* [E]: the experts with slots */
    int32_t *slot_expert = active + E;       /* [S]: the slot's local expert, then its sorted row (-1: none here) */
    int32_t *token_of_row = slot_expert + S; /* [S]: the token of each sorted row (GEMM 1's gathered inputs) */
    const int64_t ints = 3 * E + 1 + 2 * S;
    float *Y = (float *)((int32_t *)scratch + (ints + 15) / 16 * 16); /* 64-byte aligned, past the tables */
    const int64_t y_cols = 2 * I > H ? 2 * I : H;
    float *A = Y + S * y_cols; /* [S, I] activated rows; Y: [S, 2I] GEMM 1's, then [S, H] GEMM 2's */
    /* [M, H] with 16-bit hidden states: the tokens' rows widened (GEMM 1's input), then each token's float32 sum */
    float *X = x_dt != 0 || o_dt != 0 ? A + S * I : NULL;
    const float *xf = x_dt != 0 ? X : (const float *)x;
    const int64_t xf_s0 = x_dt != 0 ? H : x_s0;
    /* bf16 rows and panels where the build multiplies bf16: both GEMMs in pair dot products, the activated rows
     * rounded to bf16 in A's first half (Ab) */
    const int dot = PK_BF16_DOT && x_dt == 2 && w_dt == 2;
    uint16_t *Ab = (uint16_t *)A;

    /* 1. counting sort of the slots by local expert; ids (and the whole map) checked before anything is written */
    if (expert_map)
        for (int64_t g = 0; g < num_global; g++)
            if (expert_map[g] < -1 || expert_map[g] >= E) return 1;
    memset(cursor, 0, sizeof(int32_t) * E);
    for (int64_t s = 0; s < S; s++) {
        int64_t e = read_id(ids, ids_64, s);
        if (expert_map) {
            if (e < 0 || e >= num_global) return 1;
            e = expert_map[e];
        } else if (e < 0 || e >= E) {
            return 1;
        }
        slot_expert[s] = (int32_t)e;
        if (e >= 0) cursor[e]++;
    }
    int64_t num_active = 0;
    offsets[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        offsets[e + 1] = offsets[e] + cursor[e];
        if (cursor[e]) active[num_active++] = (int32_t)e;
        cursor[e] = offsets[e];
    }
    const int64_t rows = offsets[E];
    for (int64_t s = 0; s < S; s++) {
        const int32_t e = slot_expert[s];
        if (e < 0) continue;
        const int32_t row = cursor[e]++;
        token_of_row[row] = (int32_t)(s / topk);
        slot_expert[s] = row;
    }

    const int64_t p13 = (2 * I + NP - 1) / NP, p2 = (H + NP - 1) / NP;
    const int64_t work = rows * (3 * I) * H; /* multiply-adds */
    const int threads = work >= W16_PARALLEL_MIN * 4 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        if (x_dt != 0 && !dot) {
            /* 16-bit rows to float32, each once (GEMM 1 reads a token's row once per expert it routes to) */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < M; t++) load_row(x, t * x_s0, x_dt, H, X + t * H);
        }
        /* 2. GEMM 1 per (active expert, gate/up panel): Y[rows of e] = x[tokens of e] @ w13[e]^T (the pair dots read
         * the tokens' bf16 rows as they are) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_active * p13; item++)
            expert_item(item, p13, active, offsets, w13, H, 2 * I, w_dt, dot, dot ? x : (const void *)xf,
                        dot ? x_s0 : xf_s0, token_of_row, Y, 2 * I);
        /* 3. the gated activation: A[r] = act(Y[r, :I]) * Y[r, I:]; for the pair dots computed in place in Y's gate
         * half, which nothing reads after, and rounded to bf16 into Ab */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *y = Y + r * 2 * I;
            float *a = dot ? y : A + r * I;
            if (act == 0) {
#pragma omp simd
                for (int64_t i = 0; i < I; i++) a[i] = silu(y[i]) * y[I + i];
            } else {
#pragma omp simd
                for (int64_t i = 0; i < I; i++) a[i] = gelu_tanh(y[i]) * y[I + i];
            }
            if (dot) store_row(Ab, r * I, 2, I, a);
        }
        /* 4. GEMM 2 per (active expert, down panel): Z[rows of e] = A[rows of e] @ w2[e]^T, into Y's buffer */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_active * p2; item++)
            expert_item(item, p2, active, offsets, w2, I, H, w_dt, dot, dot ? (const void *)Ab : (const void *)A, I,
                        NULL, Y, H);
        /* 5. out[t] = sum_j w[t, j] Z[row of slot (t, j)], in slot order (a 16-bit out: summed in X's row t, which
         * GEMM 1 no longer reads, then rounded once) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M; t++) {
            float *o = o_dt == 0 ? (float *)out + t * o_s0 : X + t * H;
            float wt[MOE_MAX_TOP_K];
            const float *w = load_row(tw, t * topk, tw_dt, topk, wt);
            for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
            for (int64_t j = 0; j < topk; j++) {
                const int32_t row = slot_expert[t * topk + j];
                if (row < 0) continue;
                const float wj = w[j];
                const float *z = Y + (int64_t)row * H;
#pragma omp simd
                for (int64_t h = 0; h < H; h++) o[h] += wj * z[h];
            }
            if (o_dt != 0) store_row(out, t * o_s0, o_dt, H, o);
        }
    }
    return 0;
}
