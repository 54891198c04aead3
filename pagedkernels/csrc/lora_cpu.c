/* Multi-LoRA shrink and expand (pagedkernels/lora.py has the math): a batch whose tokens use different adapters,
 * each token's adapter slot in idx[t] (-1: none), the adapters' weights stacked by slot.
 *
 *   shrink: out[t, j]        = scale * sum_k x[t, k] * a[idx[t], j, k]          (0 when idx[t] = -1)
 *   expand: out[t, o_s + n] += sum_r buf[t, s R + r] * b[idx[t], o_s + n, r]   (row untouched when idx[t] = -1)
 *
 * Each call first groups the tokens by slot (a counting sort: one pass, which also checks every index; a bad one
 * returns 1 before anything is written), then splits the work into items of one slot and one block of the
 * output: rows of A (shrink) or columns of B (expand). An item converts its block of weights to float32 once and
 * runs every token of its slot against it, so the block stays in cache while the tokens pass, and a batch of many
 * adapters reads each adapter's weights about once, as one adapter's would be. A shrink over a slot with more
 * tokens than fit a core's L2 (a prompt's) turns that around: an item is a chunk of those tokens against every
 * block of the slot's A, so x is read once and the slot's A (a few hundred KiB at most) stays in cache instead.
 *
 * Mixed ranks: ranks (NULL, or int32 [num_loras, num_slices]) gives each slot's own rank per slice, r_ls <= R; rows of
 * A past it (the shrink writes zeros for them) and columns of B past it are then neither read nor computed, so a
 * stack holding ranks 8 and 16 at R = 16 does a quarter less work. A rank outside [0, R] returns 1, as a bad index.
 *
 * Arithmetic is float32: the shrink's dots in VW-wide vector accumulators (its K is a hidden size), summed across
 * lanes once per output; the expand's small rank reduction as broadcasts and FMAs over a block of output columns
 * (no horizontal sums). bf16 on a build with AVX512-BF16 (PK_BF16_DOT) takes pair dot products instead, the values
 * as they lie (x's and A's rows both run along K; B's rows hold a column's rank values in pairs, so its 32-bit words
 * transposed are the operand): nothing widened. Its expand rounds the buffer to bf16 first, as the Triton expand does
 * for 16-bit weights. One layer of SmolLM2 shapes (qkv, o, gate_up, down; 4 adapters of ranks 8 and 16) on a 2-core
 * Zen 5: 48 tokens 246 -> 133 us, 1024 tokens 2245 -> 906 us; float32 169 and 1560. Every token's result is the
 * same operations in the same order whatever tokens share its batch. Same build and calling convention as the other
 * kernels: Python checks shapes, dtypes and strides (row strides in elements, last dimensions contiguous); dtype
 * codes 0 = float32, 1 = float16, 2 = bfloat16. */
#include "cpu_common.h"

/* Rows of A per shrink item, and tokens taken together (JB x TB vector accumulators). */
#define JB 4 /* vsumw4 sums four accumulators at once */
#define TB 2
/* Output columns per expand item. */
#define NB 64
/* Below this many multiply-adds (a few microseconds of one core's work) a call runs on one thread. A decode step's
 * adapters come from memory, not the caches, so a call of a few tokens waits on its loads more than it computes, and
 * two threads halve the wait. 262144 (the first guess) against 4096 on a 2-core Zen 3, 30 layers' worth of calls on
 * cold weights: 4-16 tokens 7.0-8.1 -> 5.2-6.4 ms, 1 token 3.1 -> 2.7, 48 the same; the engine's decode step with
 * four adapters 9% faster at batch 4 and 8, the same at 1, 16 and 48
 * (bench/results/2026-11-29-lora-parallel-threshold-zen3-amd-epyc.md). */
#define LORA_PARALLEL_MIN 4096
/* A slot's tokens in chunks of about this many bytes of float32 x rows (within a core's L2 beside the slot's A). */
#define SHRINK_CHUNK_BYTES (128 * 1024)
#define BAD_VALUES 1
#define OUT_OF_MEMORY (-2)

/* order: the token ids grouped by slot (stable), tokens without an adapter last; starts[l] .. starts[l + 1]: slot
 * l's run (starts[num_loras + 1] = M). Returns 0, or BAD_VALUES for an index outside [-1, num_loras). */
static int group_tokens(const int32_t *idx, int64_t M, int64_t num_loras, int64_t *starts, int64_t *order) {
    memset(starts, 0, sizeof(int64_t) * (num_loras + 2));
    for (int64_t t = 0; t < M; t++) {
        const int32_t v = idx[t];
        if (v < -1 || v >= num_loras) return BAD_VALUES;
        starts[(v < 0 ? num_loras : v) + 1]++;
    }
    for (int64_t l = 0; l <= num_loras; l++) starts[l + 1] += starts[l];
    int64_t *cursor = starts + num_loras + 2; /* scratch after starts: num_loras + 1 entries */
    memcpy(cursor, starts, sizeof(int64_t) * (num_loras + 1));
    for (int64_t t = 0; t < M; t++) {
        const int32_t v = idx[t];
        order[cursor[v < 0 ? num_loras : v]++] = t;
    }
    return 0;
}

/* Slot l's rank in slice s: ranks[l][s], or R for every slot without ranks. */
static inline int64_t slot_rank(const int32_t *ranks, int64_t l, int64_t s, int64_t num_slices, int64_t R) {
    return ranks ? ranks[l * num_slices + s] : R;
}

/* Tokens per shrink chunk for rows of K features: a multiple of TB, at least 4 pairs. */
static inline int64_t shrink_chunk(int64_t K) {
    int64_t tokens = SHRINK_CHUNK_BYTES / (4 * (K > 0 ? K : 1));
    tokens -= tokens % TB;
    return tokens < 4 * TB ? 4 * TB : tokens;
}

static int check_ranks(const int32_t *ranks, int64_t num_loras, int64_t num_slices, int64_t R) {
    if (ranks)
        for (int64_t i = 0; i < num_loras * num_slices; i++)
            if (ranks[i] < 0 || ranks[i] > R) return BAD_VALUES;
    return 0;
}

static inline float *row_as_float(const void *base, int64_t offset, int dtype, int64_t n, float *tmp) {
    return (float *)load_row(base, offset, dtype, n, tmp);
}

typedef float vf8 __attribute__((vector_size(32)));

/* Eight floats from p, and to p (any alignment). */
static inline vf8 load8(const float *p) {
    vf8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, vf8 v) { memcpy(p, &v, sizeof v); }

#define PK_UNPACK_LO(a, b) __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13)
#define PK_UNPACK_HI(a, b) __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15)
#define PK_PAIRS_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13)
#define PK_PAIRS_HI(a, b) __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15)
#define PK_HALVES_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
#define PK_HALVES_HI(a, b) __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15)

/* dst[j * ld + i] = rows[i][r + j] for i, j < 8: eight rows' 8 floats from r on, transposed by shuffles (unpack,
 * then pairs, then halves: AVX's 8 x 8 transpose; split into halves where vectors are narrower). Named values, not
 * arrays: GCC copied an array of them through the stack in 16-byte halves, and the 32-byte reloads stalled. */
static inline void transpose8(const float *const rows[8], int64_t r, float *dst, int64_t ld) {
    const vf8 x0 = load8(rows[0] + r), x1 = load8(rows[1] + r), x2 = load8(rows[2] + r), x3 = load8(rows[3] + r);
    const vf8 x4 = load8(rows[4] + r), x5 = load8(rows[5] + r), x6 = load8(rows[6] + r), x7 = load8(rows[7] + r);
    const vf8 t0 = PK_UNPACK_LO(x0, x1), t1 = PK_UNPACK_HI(x0, x1), t2 = PK_UNPACK_LO(x2, x3);
    const vf8 t3 = PK_UNPACK_HI(x2, x3), t4 = PK_UNPACK_LO(x4, x5), t5 = PK_UNPACK_HI(x4, x5);
    const vf8 t6 = PK_UNPACK_LO(x6, x7), t7 = PK_UNPACK_HI(x6, x7);
    const vf8 u0 = PK_PAIRS_LO(t0, t2), u1 = PK_PAIRS_HI(t0, t2), u2 = PK_PAIRS_LO(t1, t3), u3 = PK_PAIRS_HI(t1, t3);
    const vf8 u4 = PK_PAIRS_LO(t4, t6), u5 = PK_PAIRS_HI(t4, t6), u6 = PK_PAIRS_LO(t5, t7), u7 = PK_PAIRS_HI(t5, t7);
    store8(dst, PK_HALVES_LO(u0, u4));
    store8(dst + ld, PK_HALVES_LO(u1, u5));
    store8(dst + 2 * ld, PK_HALVES_LO(u2, u6));
    store8(dst + 3 * ld, PK_HALVES_LO(u3, u7));
    store8(dst + 4 * ld, PK_HALVES_HI(u0, u4));
    store8(dst + 5 * ld, PK_HALVES_HI(u1, u5));
    store8(dst + 6 * ld, PK_HALVES_HI(u2, u6));
    store8(dst + 7 * ld, PK_HALVES_HI(u3, u7));
}

/* The shrink's arguments and its work list, shared by its threads. */
typedef struct {
    const void *x;
    int64_t x_s0;
    int dt;
    int64_t K;
    const void *a;
    int64_t a_s0, a_s1, R, num_slices;
    const int32_t *ranks;
    const int64_t *order, *blocks;
    float scale;
    float *out;
    int64_t o_s0;
    const float *xf; /* 16-bit x of few-token slots converted once per call (row i: the token order[i]), or NULL */
} shrink_work;

/* One item v = {slot, first token, end token, first block, end block} (in w->order and w->blocks); buf: the thread's
 * float32 rows (16-bit inputs), NULL for float32. Its tokens' x rows come from w->xf where the call converted them
 * up front (a decode step's slots: one item per block of A, and each item converting its tokens again cost 2.5x the
 * float32 shrink in fp16 at 48 tokens), else converted here for its blocks (a prompt's chunk: its own tokens). */
static void shrink_item(const shrink_work *w, const int64_t *v, float *buf) {
    const void *x = w->x, *a = w->a;
    const int64_t x_s0 = w->x_s0, K = w->K, a_s0 = w->a_s0, a_s1 = w->a_s1, R = w->R, num_slices = w->num_slices;
    const int64_t o_s0 = w->o_s0, *order = w->order, *blocks = w->blocks;
    const int32_t *ranks = w->ranks;
    const int dt = w->dt;
    const float scale = w->scale;
    float *out = w->out;
    const int64_t l = v[0], t0 = v[1], t1 = v[2];
    const int convert = buf && !w->xf;
    if (convert) /* the item's tokens converted once, for every block */
        for (int64_t i = t0; i < t1; i++) load_row(x, order[i] * x_s0, dt, K, buf + (JB + i - t0) * K);
    for (int64_t bk = v[3]; bk < v[4]; bk++) {
        const int64_t j0 = blocks[bk];
        const int64_t end = j0 / R * R + slot_rank(ranks, l, j0 / R, num_slices, R); /* the slice's last */
        const int jn = end - j0 < JB ? (int)(end - j0) : JB;
        const float *arow[JB];
        for (int j = 0; j < JB; j++) /* rows past the rank repeat the last one: computed, never stored */
            arow[j] = row_as_float(a, l * a_s0 + (j0 + (j < jn ? j : jn - 1)) * a_s1, dt, K,
                                   buf ? buf + j * K : NULL);
        for (int64_t i = t0; i < t1; i += TB) {
            const int tn = t1 - i < TB ? (int)(t1 - i) : TB;
            const float *xrow[TB];
            for (int t = 0; t < TB; t++) { /* a missing partner repeats the last token: computed, not stored */
                const int64_t at = i + (t < tn ? t : tn - 1);
                xrow[t] = w->xf ? w->xf + at * K
                          : buf ? buf + (JB + at - t0) * K : (const float *)x + order[at] * x_s0;
            }
            vfw acc[TB][JB];
            memset(acc, 0, sizeof acc);
            int64_t k = 0;
            for (; k + VW <= K; k += VW) {
                vfw av[JB];
                for (int j = 0; j < JB; j++) av[j] = vloadw(arow[j] + k);
                for (int t = 0; t < TB; t++) {
                    const vfw xv = vloadw(xrow[t] + k);
                    for (int j = 0; j < JB; j++) acc[t][j] += xv * av[j];
                }
            }
            for (int t = 0; t < tn; t++) {
                const vf4 sums = vsumw4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
                float *o = out + order[i + t] * o_s0 + j0;
                for (int j = 0; j < jn; j++) {
                    float sum = sums[j];
                    for (int64_t kk = k; kk < K; kk++) sum += xrow[t][kk] * arow[j][kk];
                    o[j] = sum * scale;
                }
            }
        }
    }
}

#if PK_BF16_DOT
/* Tokens taken together by the pair-dot shrink: TBD x JB accumulators, JB rows of A and a row of x in registers (21
 * of AVX-512's 32). */
#define TBD 4

/* n (< 32) bf16 values from p, zeros after them. */
static inline vbf32 load_bf32_tail(const uint16_t *p, int64_t n) {
    uint16_t tail[32] = {0};
    memcpy(tail, p, sizeof(uint16_t) * n);
    return load_bf32(tail);
}

/* shrink_item for bf16 x and A on builds with AVX512-BF16: x's and A's rows both run along K, so their pairs meet
 * as they lie (dot_bf16_pairs), nothing widened or copied; K's last values past a multiple of 32 are taken zero-padded.
 * A token's sums are its own accumulators' whatever its partners. */
static void shrink_item_dot(const shrink_work *w, const int64_t *v) {
    const uint16_t *x = (const uint16_t *)w->x, *a = (const uint16_t *)w->a;
    const int64_t x_s0 = w->x_s0, K = w->K, a_s0 = w->a_s0, a_s1 = w->a_s1, R = w->R, num_slices = w->num_slices;
    const int64_t o_s0 = w->o_s0, *order = w->order, *blocks = w->blocks, K32 = K / 32 * 32;
    const int64_t l = v[0], t0 = v[1], t1 = v[2];
    for (int64_t bk = v[3]; bk < v[4]; bk++) {
        const int64_t j0 = blocks[bk];
        const int64_t end = j0 / R * R + slot_rank(w->ranks, l, j0 / R, num_slices, R);
        const int jn = end - j0 < JB ? (int)(end - j0) : JB;
        const uint16_t *arow[JB];
        for (int j = 0; j < JB; j++) arow[j] = a + l * a_s0 + (j0 + (j < jn ? j : jn - 1)) * a_s1;
        vbf32 atail[JB];
        for (int j = 0; j < JB && K32 < K; j++) atail[j] = load_bf32_tail(arow[j] + K32, K - K32);
        for (int64_t i = t0; i < t1; i += TBD) {
            const int tn = t1 - i < TBD ? (int)(t1 - i) : TBD;
            const uint16_t *xrow[TBD];
            for (int t = 0; t < TBD; t++) xrow[t] = x + order[i + (t < tn ? t : tn - 1)] * x_s0;
            vf16 acc[TBD][JB];
            memset(acc, 0, sizeof acc);
            for (int64_t k = 0; k < K32; k += 32) {
                vbf32 av[JB];
                for (int j = 0; j < JB; j++) av[j] = load_bf32(arow[j] + k);
                for (int t = 0; t < TBD; t++) {
                    const vbf32 xv = load_bf32(xrow[t] + k);
                    for (int j = 0; j < JB; j++) acc[t][j] = dot_bf16_pairs(acc[t][j], xv, av[j]);
                }
            }
            if (K32 < K)
                for (int t = 0; t < TBD; t++) {
                    const vbf32 xv = load_bf32_tail(xrow[t] + K32, K - K32);
                    for (int j = 0; j < JB; j++) acc[t][j] = dot_bf16_pairs(acc[t][j], xv, atail[j]);
                }
            for (int t = 0; t < tn; t++) {
                const vf4 sums = vsumw4(fold16(acc[t][0]), fold16(acc[t][1]), fold16(acc[t][2]), fold16(acc[t][3]));
                float *o = w->out + order[i + t] * o_s0 + j0;
                for (int j = 0; j < jn; j++) o[j] = sums[j] * w->scale;
            }
        }
    }
}
#endif

/* One item by the build's path for the dtype: pair dot products for bf16 where the build has them, else float32. */
static inline void shrink_one(const shrink_work *w, const int64_t *v, float *buf) {
#if PK_BF16_DOT
    if (w->dt == 2) {
        shrink_item_dot(w, v);
        return;
    }
#endif
    shrink_item(w, v, buf);
}

/* Whether the shrink widens 16-bit inputs to float32 (a thread buffer for them), or reads them as they are. */
static inline int shrink_widens(int dt) { return dt != 0 && !(PK_BF16_DOT && dt == 2); }

/* x [M, K] (row stride x_s0, dtype dt), a [num_loras, N, K] (strides a_s0, a_s1; x's dtype), idx int32 [M], ranks
 * NULL or int32 [num_loras, num_slices] (N = num_slices * R), out float32 [M, N] (row stride o_s0). Returns 0,
 * BAD_VALUES (an index or a rank out of range: nothing written) or OUT_OF_MEMORY. */
int pk_lora_shrink(const void *x, int64_t x_s0, int dt, int64_t M, int64_t K, const void *a, int64_t a_s0,
                   int64_t a_s1, int64_t N, int64_t num_loras, const int32_t *idx, const int32_t *ranks,
                   int64_t num_slices, float scale, float *out, int64_t o_s0, int num_threads) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t R = N / num_slices;
    if (check_ranks(ranks, num_loras, num_slices, R)) return BAD_VALUES;
    int64_t *meta = (int64_t *)malloc(sizeof(int64_t) * (2 * num_loras + 3 + M));
    if (!meta) return OUT_OF_MEMORY;
    int64_t *starts = meta, *order = meta + 2 * num_loras + 3;
    if (group_tokens(idx, M, num_loras, starts, order)) {
        free(meta);
        return BAD_VALUES;
    }
    for (int64_t i = starts[num_loras]; i < M; i++) memset(out + order[i] * o_s0, 0, sizeof(float) * N);
    /* Each slot's blocks of JB rows of A within its slices' ranks (blocks[slot_blocks[l]] on); the rows past a slot's
     * rank are zeros in its tokens' outputs. Items: a slot of at most `chunk` tokens gives one item per row block
     * (all its tokens against that block: a decode step's few tokens spread over both threads); a slot of more gives
     * one per chunk of its tokens (that chunk against all its blocks, the chunk's rows of x staying in cache). */
    const int64_t chunk = shrink_chunk(K);
    int64_t num_blocks = 0, items = 0, work = 0;
    int chunked = 0;
    for (int64_t l = 0; l < num_loras; l++) {
        const int64_t tokens = starts[l + 1] - starts[l], before = num_blocks;
        if (tokens == 0) continue;
        for (int64_t sl = 0; sl < num_slices; sl++) {
            const int64_t rank = slot_rank(ranks, l, sl, num_slices, R);
            num_blocks += (rank + JB - 1) / JB;
            work += tokens * rank * K;
            if (rank < R)
                for (int64_t i = starts[l]; i < starts[l + 1]; i++)
                    memset(out + order[i] * o_s0 + sl * R + rank, 0, sizeof(float) * (R - rank));
        }
        items += tokens > chunk ? (tokens + chunk - 1) / chunk : num_blocks - before;
        chunked |= tokens > chunk;
    }
    /* item: slot, first and end token (in order), first and end block */
    int64_t *blocks = (int64_t *)malloc(sizeof(int64_t) * (num_blocks + 5 * items + 1));
    if (!blocks) {
        free(meta);
        return OUT_OF_MEMORY;
    }
    int64_t *item = blocks + num_blocks;
    for (int64_t l = 0, b = 0, n = 0; l < num_loras; l++) {
        const int64_t tokens = starts[l + 1] - starts[l], first = b;
        if (tokens == 0) continue;
        for (int64_t sl = 0; sl < num_slices; sl++)
            for (int64_t r = 0; r < slot_rank(ranks, l, sl, num_slices, R); r += JB) blocks[b++] = sl * R + r;
        if (tokens > chunk) { /* ceil(tokens / chunk) chunks of equal size (within a token) */
            const int64_t parts = (tokens + chunk - 1) / chunk;
            for (int64_t c = 0; c < parts; c++, n++) {
                const int64_t values[5] = {l, starts[l] + tokens * c / parts, starts[l] + tokens * (c + 1) / parts,
                                           first, b};
                memcpy(item + 5 * n, values, sizeof values);
            }
        } else {
            for (int64_t k = first; k < b; k++, n++) {
                const int64_t values[5] = {l, starts[l], starts[l + 1], k, k + 1};
                memcpy(item + 5 * n, values, sizeof values);
            }
        }
    }
    /* 16-bit x widened to float32: once per call for few-token slots (every block's item reads them), per item for
     * a prompt's chunks */
    const int64_t adapted = starts[num_loras];
    float *xf = NULL;
    if (shrink_widens(dt) && !chunked && adapted > 0 && !(xf = (float *)malloc(sizeof(float) * adapted * K))) {
        free(blocks);
        free(meta);
        return OUT_OF_MEMORY;
    }
    const shrink_work work_list = {x, x_s0, dt, K, a, a_s0, a_s1, R, num_slices, ranks, order, blocks, scale, out, o_s0,
                                   xf};
    int failed = 0;
#pragma omp parallel num_threads(work >= LORA_PARALLEL_MIN ? num_threads : 1)
    {
        if (xf) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < adapted; i++) load_row(x, order[i] * x_s0, dt, K, xf + i * K);
        }
        /* per thread (16-bit inputs only): JB rows of A and (without xf) an item's rows of x, at most `chunk` */
        float *buf = shrink_widens(dt) ? (float *)malloc(sizeof(float) * (JB + (xf ? 0 : chunk)) * K) : NULL;
        const int ok = !shrink_widens(dt) || buf != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* a prompt's chunks differ in cost from a decode step's blocks, and static shares would leave one thread
         * waiting: dynamic then; static for equal items (each thread's run of blocks read in order) */
        if (chunked) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++)
                if (ok) shrink_one(&work_list, item + 5 * it, buf);
        } else {
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++)
                if (ok) shrink_one(&work_list, item + 5 * it, buf);
        }
        free(buf);
    }
    free(xf);
    free(blocks);
    free(meta);
    return failed ? OUT_OF_MEMORY : 0;
}

/* The expand's arguments, shared by its threads. */
typedef struct {
    const float *buffer;
    int64_t buf_s0, rank;
    const void *b;
    int64_t b_s0, b_s1;
    const int32_t *ranks;
    int num_slices, dt;
    void *out;
    int64_t o_s0;
    const int64_t *starts, *order;
} expand_work;

/* One item: slot l's tokens against out columns c0 .. c0 + nc - 1 (within slice s, B's columns up to rk) in float32.
 * bt, tmp, orow, zeros: the thread's buffers (pk_lora_expand). */
static void expand_item(const expand_work *w, int64_t l, int s, int64_t c0, int nc, int64_t rk, float *bt,
                        float *tmp, float *orow, const float *zeros) {
    const int dt = w->dt;
    for (int n = 0; n < NB; n += 8) { /* eight columns at a time: 8 x 8 transposes in registers */
        const float *rows[8];
        for (int i = 0; i < 8; i++)
            rows[i] = n + i < nc ? load_row(w->b, l * w->b_s0 + (c0 + n + i) * w->b_s1, dt, rk, tmp + i * w->rank)
                                 : zeros;
        int64_t r = 0;
        for (; r + 8 <= rk; r += 8) transpose8(rows, r, bt + r * NB + n, NB);
        for (; r < rk; r++)
            for (int i = 0; i < 8; i++) bt[r * NB + n + i] = rows[i][r];
    }
    for (int64_t i = w->starts[l]; i < w->starts[l + 1]; i++) {
        const int64_t t = w->order[i];
        const float *u = w->buffer + t * w->buf_s0 + s * w->rank;
        vfw acc[NB / VW];
#pragma GCC unroll 16
        for (int v = 0; v < NB / VW; v++) acc[v] = (vfw){0};
        for (int64_t r = 0; r < rk; r++) {
            const vfw ur = (vfw){0} + u[r];
            const float *btr = bt + r * NB;
#pragma GCC unroll 16
            for (int v = 0; v < NB / VW; v++) acc[v] += ur * vloadw(btr + v * VW);
        }
        if (dt == 0 && nc == NB) {
            float *dst = (float *)w->out + t * w->o_s0 + c0;
#pragma GCC unroll 16
            for (int v = 0; v < NB / VW; v++) {
                const vfw sum = vloadw(dst + v * VW) + acc[v];
                memcpy(dst + v * VW, &sum, sizeof sum);
            }
            continue;
        }
        float delta[NB];
        memcpy(delta, acc, sizeof delta);
        const float *prev = load_row(w->out, t * w->o_s0 + c0, dt, nc, orow);
        float *dst = dt == 0 ? (float *)w->out + t * w->o_s0 + c0 : orow;
        for (int n = 0; n < nc; n++) dst[n] = prev[n] + delta[n];
        if (dt != 0) store_row(w->out, t * w->o_s0 + c0, dt, nc, dst);
    }
}

#if PK_BF16_DOT
/* Tokens taken together by the pair-dot expand: TBE x NB / 16 accumulators. */
#define TBE 2

typedef uint16_t vh16 __attribute__((vector_size(32))); /* 16 bf16 values */

/* bt[w * NB + i] = the 32-bit word w of rows[i] (i < 8) for words w0 .. w0 + 3: an 8 x 4 transpose (two 4 x 4 ones
 * side by side in 128-bit lanes). */
static inline void transpose8x4(const float *const rows[8], int64_t w0, float *dst, int64_t ld) {
    vf8 v[4];
    for (int i = 0; i < 4; i++) {
        vf4 lo, hi;
        memcpy(&lo, rows[i] + w0, sizeof lo);
        memcpy(&hi, rows[i + 4] + w0, sizeof hi);
        v[i] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7);
    }
    const vf8 t0 = PK_UNPACK_LO(v[0], v[1]), t1 = PK_UNPACK_HI(v[0], v[1]);
    const vf8 t2 = PK_UNPACK_LO(v[2], v[3]), t3 = PK_UNPACK_HI(v[2], v[3]);
    store8(dst, PK_PAIRS_LO(t0, t2));
    store8(dst + ld, PK_PAIRS_HI(t0, t2));
    store8(dst + 2 * ld, PK_PAIRS_LO(t1, t3));
    store8(dst + 3 * ld, PK_PAIRS_HI(t1, t3));
}

/* 16 bf16 values at p plus delta, rounded to nearest even (NaN kept quiet, as float_to_bf16). */
static inline void add_bf16x16(uint16_t *p, vf16 delta) {
    vh16 h;
    memcpy(&h, p, sizeof h);
    const vf16 sum = (vf16)(__builtin_convertvector(h, vu16) << 16) + delta;
    const vu16 bits = (vu16)sum, nan = (vu16)(sum != sum);
    const vu16 rounded = ((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16 & ~nan) | ((bits >> 16 | 0x40u) & nan);
    h = __builtin_convertvector(rounded, vh16);
    memcpy(p, &h, sizeof h);
}

/* Token t's buffer values of slice s as bf16 pairs (words (rk + 1) / 2), rounded to bf16 as the Triton expand does for
 * 16-bit weights; an odd rank's last pair has a zero for its second value. Once per token and call, before the
 * items (each of which would otherwise convert them again for every block of columns). */
static void buffer_pairs(const expand_work *w, int64_t t, int64_t l, uint32_t *dst) {
    const int64_t words = (w->rank + 1) / 2;
    for (int s = 0; s < w->num_slices; s++) {
        const int64_t rk = slot_rank(w->ranks, l, s, w->num_slices, w->rank);
        const float *u = w->buffer + t * w->buf_s0 + s * w->rank;
        for (int64_t k = 0; k < (rk + 1) / 2; k++)
            dst[s * words + k] = float_to_bf16(u[2 * k]) |
                                 (2 * k + 1 < rk ? (uint32_t)float_to_bf16(u[2 * k + 1]) << 16 : 0u);
    }
}

/* expand_item for bf16 B and out on builds with AVX512-BF16. B's rows hold a column's rank values in pairs, so its
 * 32-bit words transposed ([word][column], 8 x 8 and 8 x 4 transposes of words, the rest one by one) are the pair
 * dot's operand as they are: nothing widened, half the transposing. The tokens' buffer pairs (buffer_pairs: row t
 * at pairs + t * pw) are broadcast a pair at a time; B's value past an odd rank is masked off (never read: it may
 * be anything). */
static void expand_item_dot(const expand_work *w, int64_t l, int s, int64_t c0, int nc, int64_t rk, uint32_t *bt,
                            const float *zeros, const uint32_t *pairs, int64_t pw) {
    const int64_t words = (rk + 1) / 2, whole = rk / 2; /* whole: words with both values inside the rank */
    const uint16_t *b = (const uint16_t *)w->b;
    for (int n = 0; n < NB; n += 8) {
        const float *rows[8];
        for (int i = 0; i < 8; i++)
            rows[i] = n + i < nc ? (const float *)(b + l * w->b_s0 + (c0 + n + i) * w->b_s1) : zeros;
        int64_t k = 0;
        for (; k + 8 <= whole; k += 8) transpose8(rows, k, (float *)bt + k * NB + n, NB);
        for (; k + 4 <= whole; k += 4) transpose8x4(rows, k, (float *)bt + k * NB + n, NB);
        for (; k < words; k++)
            for (int i = 0; i < 8; i++) {
                uint32_t word = 0;
                if (rows[i] != zeros) {
                    const uint16_t *row = (const uint16_t *)rows[i];
                    word = row[2 * k] | (2 * k + 1 < rk ? (uint32_t)row[2 * k + 1] << 16 : 0u);
                }
                bt[k * NB + n + i] = word;
            }
    }
    const int64_t first = w->starts[l], last = w->starts[l + 1], offset = s * ((w->rank + 1) / 2);
    for (int64_t i = first; i < last; i += TBE) {
        const int tn = last - i < TBE ? (int)(last - i) : TBE;
        const uint32_t *u[TBE];
        for (int t = 0; t < TBE; t++) u[t] = pairs + w->order[i + (t < tn ? t : tn - 1)] * pw + offset;
        vf16 acc[TBE][NB / 16];
        memset(acc, 0, sizeof acc);
        for (int64_t k = 0; k < words; k++) {
            vbf32 bv[NB / 16];
            for (int v = 0; v < NB / 16; v++) memcpy(&bv[v], bt + k * NB + 16 * v, sizeof bv[v]);
            for (int t = 0; t < TBE; t++) {
                const vbf32 uv = (vbf32)((vu16){0} + u[t][k]);
                for (int v = 0; v < NB / 16; v++) acc[t][v] = dot_bf16_pairs(acc[t][v], bv[v], uv);
            }
        }
        for (int t = 0; t < tn; t++) {
            uint16_t *dst = (uint16_t *)w->out + w->order[i + t] * w->o_s0 + c0;
            if (nc == NB) {
                for (int v = 0; v < NB / 16; v++) add_bf16x16(dst + 16 * v, acc[t][v]);
            } else {
                float delta[NB];
                memcpy(delta, acc[t], sizeof delta);
                for (int n = 0; n < nc; n++) dst[n] = float_to_bf16(bf16_to_float(dst[n]) + delta[n]);
            }
        }
    }
}
#endif

/* buf float32 [M, num_slices * rank] (row stride buf_s0), b [num_loras,
 * out_features, rank] (strides b_s0, b_s1; out's dtype), idx int32 [M], ranks NULL or int32 [num_loras,
 * num_slices], slice sizes n0, n1, n2 (the first num_slices used), out [M, out_features] (row stride o_s0, dtype
 * dt), updated in place. Returns 0, BAD_VALUES or OUT_OF_MEMORY. */
int pk_lora_expand(const float *buffer, int64_t buf_s0, int64_t M, int64_t rank, const void *b, int64_t b_s0,
                   int64_t b_s1, int64_t num_loras, const int32_t *idx, const int32_t *ranks, int64_t n0, int64_t n1,
                   int64_t n2, int num_slices, void *out, int64_t o_s0, int dt, int num_threads) {
    if (M <= 0) return 0;
    if (check_ranks(ranks, num_loras, num_slices, rank)) return BAD_VALUES;
    int64_t *meta = (int64_t *)malloc(sizeof(int64_t) * (2 * num_loras + 3 + M));
    if (!meta) return OUT_OF_MEMORY;
    int64_t *starts = meta, *order = meta + 2 * num_loras + 3;
    if (group_tokens(idx, M, num_loras, starts, order)) {
        free(meta);
        return BAD_VALUES;
    }
    const int64_t sizes[3] = {n0, num_slices > 1 ? n1 : 0, num_slices > 2 ? n2 : 0};
    int64_t col_blocks = 0, slice_start[3] = {0, 0, 0}, out_features = 0;
    for (int s = 0; s < num_slices; s++) {
        slice_start[s] = out_features;
        out_features += sizes[s];
        col_blocks += (sizes[s] + NB - 1) / NB;
    }
    int64_t items = 0;
    for (int64_t l = 0; l < num_loras; l++) items += starts[l + 1] > starts[l] ? col_blocks : 0;
    int64_t *item_code = (int64_t *)malloc(sizeof(int64_t) * (items > 0 ? items : 1));
    if (!item_code) {
        free(meta);
        return OUT_OF_MEMORY;
    }
    /* item: slot * col_blocks + (its slice's first block + block within the slice); none for a slice of rank 0 */
    items = 0;
    int64_t work = 0;
    for (int64_t l = 0; l < num_loras; l++) {
        if (starts[l + 1] == starts[l]) continue;
        for (int64_t sl = 0, c = 0; sl < num_slices; sl++) {
            const int64_t blocks = (sizes[sl] + NB - 1) / NB, rk = slot_rank(ranks, l, sl, num_slices, rank);
            for (int64_t k = 0; k < blocks && rk > 0; k++) item_code[items++] = l * col_blocks + c + k;
            work += (starts[l + 1] - starts[l]) * sizes[sl] * rk;
            c += blocks;
        }
    }
    const expand_work work_list = {buffer, buf_s0, rank, b, b_s0, b_s1, ranks,
                                   num_slices, dt, out, o_s0, starts, order};
    /* bf16 on builds with pair dots: each adapted token's buffer values as bf16 pairs, [M][num_slices * words] */
    uint32_t *pairs = NULL;
#if PK_BF16_DOT
    const int64_t pw = num_slices * ((rank + 1) / 2);
    if (dt == 2 && !(pairs = (uint32_t *)malloc(sizeof(uint32_t) * (M * pw > 0 ? M * pw : 1)))) {
        free(item_code);
        free(meta);
        return OUT_OF_MEMORY;
    }
#endif
    int failed = 0;
#pragma omp parallel num_threads(work >= LORA_PARALLEL_MIN ? num_threads : 1)
    {
#if PK_BF16_DOT
        if (pairs) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < starts[num_loras]; i++)
                buffer_pairs(&work_list, order[i], idx[order[i]], pairs + order[i] * pw);
        }
#endif
        /* per thread: the B block transposed to [rank][NB] float32 (or [rank / 2][NB] words of bf16 pairs), 8
         * converted rows of b (16-bit b only), a row of out, and a zero row standing in for B's rows past the block's
         * last column */
        float *bt = (float *)malloc(sizeof(float) * (rank * NB + 8 * rank + NB + rank + 1));
        float *tmp = NULL, *orow = NULL, *zeros = NULL;
        if (!bt) {
#pragma omp atomic write
            failed = 1;
        } else {
            tmp = bt + rank * NB, orow = tmp + 8 * rank, zeros = orow + NB;
            memset(zeros, 0, sizeof(float) * (rank + 1));
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (!bt) continue;
            const int64_t l = item_code[item] / col_blocks;
            int64_t c = item_code[item] % col_blocks;
            int s = 0;
            while (c >= (sizes[s] + NB - 1) / NB) c -= (sizes[s++] + NB - 1) / NB;
            const int64_t c0 = slice_start[s] + c * NB; /* first column of out and b */
            const int nc = slice_start[s] + sizes[s] - c0 < NB ? (int)(slice_start[s] + sizes[s] - c0) : NB;
            const int64_t rk = slot_rank(ranks, l, s, num_slices, rank); /* B's columns past it: not read */
#if PK_BF16_DOT
            if (pairs) {
                expand_item_dot(&work_list, l, s, c0, nc, rk, (uint32_t *)bt, zeros, pairs, pw);
                continue;
            }
#endif
            expand_item(&work_list, l, s, c0, nc, rk, bt, tmp, orow, zeros);
        }
        free(bt);
    }
    free(pairs);
    free(item_code);
    free(meta);
    return failed ? OUT_OF_MEMORY : 0;
}
