/* pagedkernels' native CPU kernels: paged attention over a block-table KV cache (variable-length
 * prefill, decode as its one-query case) and the KV-cache write. Built on first use by
 * pagedkernels/_native.py (cc -O3 -march=native -fopenmp) and called through ctypes. Python checks
 * shapes, dtypes and strides before the call; the kernels check the values that index memory (block
 * ids, lengths, slots) themselves, in one pass before any work, and return 1 when one is out of range,
 * so the op can name the offence without a separate pass over the metadata on every call.
 *
 * Layouts (strides in elements, the last dimension always contiguous):
 *   q, out       [num_tokens, num_q_heads, head_dim]
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables int32 [num_seqs, table_stride >= blocks used]
 *   cu_seqlens_q int32 [num_seqs + 1] (NULL: decode, sequence s owns query row s)
 *   seq_lens     int32 [num_seqs], tokens cached including the new ones; a sequence's queries are
 *                its last q_len positions.
 * dtype: 0 = float32, 1 = float16, 2 = bfloat16 (q, out); cache_dtype the same or 3 = float8 e4m3,
 * whose values are multiplied by k_scale / v_scale (folded into the query's scale and the output's
 * normalization). Arithmetic is float32 with an online softmax over tiles of keys; the GQA group's
 * query heads share each key/value row they read. A bf16 query against a bf16 cache takes its query-key dots in
 * AVX512-BF16 pair dot products where the build has them (keys_bf16, PK_BF16_DOT in cpu_common.h): the bf16 values
 * multiplied as they are, their exact products summed in float32, the scale applied to the sum; values are widened
 * to float32 as with other caches.
 */
#include "cpu_common.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 64
#define KEY_TILE 32
#define QUERY_CHUNK 16
#define PREFETCH_TILES 1 /* how far ahead (in tiles of keys) the first query of a chunk prefetches (see attend_chunk) */
#define SPLIT_MIN_KEYS 64 /* keys of a decode split (decode_split_k) at least */

static inline float dot(const float *a, const float *b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < n; d++) acc += a[d] * b[d];
    return acc;
}

/* Query heads a pass keeps in registers: 4 x HEADS vector accumulators and 4 vectors of keys (or values) fill the
 * machine's registers (32 with AVX-512, 16 otherwise). */
#define HEADS (VW == 16 ? 4 : 3)

/* scores[g][j] = qf[g] . keys[j], j .. j + 3, for query heads g0 .. g0 + G - 1 (G a constant where inlined, so the
 * 4 x G accumulators live in registers): 4 x G independent FMA chains, each slice of a key loaded once for the
 * heads, then a head's four accumulators summed together (vsumw4). */
static inline __attribute__((always_inline)) void four_keys(float qf[][MAX_HEAD_DIM], int g0, const int G,
                                                            const float *const *keys, int j, int head_dim,
                                                            float scores[][KEY_TILE]) {
    const float *k0 = keys[j], *k1 = keys[j + 1], *k2 = keys[j + 2], *k3 = keys[j + 3];
    vfw a[HEADS][4];
    for (int g = 0; g < G; g++) a[g][0] = a[g][1] = a[g][2] = a[g][3] = (vfw){0};
    for (int d = 0; d < head_dim; d += VW) {
        const vfw x0 = vloadw(k0 + d), x1 = vloadw(k1 + d), x2 = vloadw(k2 + d), x3 = vloadw(k3 + d);
        for (int g = 0; g < G; g++) {
            const vfw qv = vloadw(qf[g0 + g] + d);
            a[g][0] += qv * x0;
            a[g][1] += qv * x1;
            a[g][2] += qv * x2;
            a[g][3] += qv * x3;
        }
    }
    for (int g = 0; g < G; g++) {
        const vf4 sums = vsumw4(a[g][0], a[g][1], a[g][2], a[g][3]);
        memcpy(&scores[g0 + g][j], &sums, sizeof sums);
    }
}

/* Rows to prefetch while a tile's loop runs, one row per key it takes: bytes from row j at base + (off[j] + shift)
 * elements, for j < n. */
typedef struct {
    const char *base;
    const int64_t *off;
    int n;
    int64_t shift;
    int bytes, elem_size;
} spread_prefetch;

static inline __attribute__((always_inline)) void prefetch_row(const spread_prefetch *pf, int j) {
    if (j >= pf->n) return;
    const char *row = pf->base + (pf->off[j] + pf->shift) * pf->elem_size;
    for (int b = 0; b < pf->bytes; b += 64) __builtin_prefetch(row + b, 0, 1);
}

/* scores[g][j] = qf[g] . keys[j] for the n keys of a tile and every query head of the group: four keys and up to
 * HEADS query heads at a time (head_dim a multiple of the vector width; other sizes take the plain dots). */
static inline __attribute__((always_inline)) void tile_scores(float qf[][MAX_HEAD_DIM], int group,
                                                              const float *const *keys, int n, int head_dim,
                                                              float scores[][KEY_TILE], const spread_prefetch *pf) {
    int j = 0;
    if (head_dim % VW == 0) {
        for (; j + 4 <= n; j += 4) {
            for (int i = 0; i < 4; i++) prefetch_row(pf, j + i);
            int g0 = 0;
            for (; g0 + HEADS <= group; g0 += HEADS) four_keys(qf, g0, HEADS, keys, j, head_dim, scores);
            switch (group - g0) {
            case 3: four_keys(qf, g0, 3, keys, j, head_dim, scores); break;
            case 2: four_keys(qf, g0, 2, keys, j, head_dim, scores); break;
            case 1: four_keys(qf, g0, 1, keys, j, head_dim, scores); break;
            default: break;
            }
        }
    }
    for (; j < n; j++)
        for (int g = 0; g < group; g++) scores[g][j] = dot(qf[g], keys[j], head_dim);
    for (; j < pf->n; j++) prefetch_row(pf, j);
}

#if PK_BF16_DOT
/* scores[g][j + c] = scale * (q[g] . keys[j + c]) for c < NK keys (1 or 4) and query heads g0 .. g0 + G - 1, bf16 q
 * rows and keys in pair dot products (head_dim a multiple of 32): NK x G accumulators of 16 lanes, each key slice
 * loaded once for the heads, as four_keys does in float32. G and NK constants where inlined. */
static inline __attribute__((always_inline)) void keys_bf16(const uint16_t *const *qb, int g0, const int G,
                                                            const uint16_t *const *keys, int j, const int NK,
                                                            int head_dim, float scale, float scores[][KEY_TILE]) {
    vf16 a[HEADS][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NK; c++) a[g][c] = (vf16){0};
    for (int d = 0; d < head_dim; d += 32) {
        vbf32 kv[4];
        for (int c = 0; c < NK; c++) kv[c] = load_bf32(keys[j + c] + d);
        for (int g = 0; g < G; g++) {
            const vbf32 qv = load_bf32(qb[g0 + g] + d);
            for (int c = 0; c < NK; c++) a[g][c] = dot_bf16_pairs(a[g][c], qv, kv[c]);
        }
    }
    for (int g = 0; g < G; g++) {
        const vfw zero = {0};
        const vf4 sums = vsumw4(fold16(a[g][0]), NK > 1 ? fold16(a[g][1]) : zero, NK > 2 ? fold16(a[g][2]) : zero,
                                NK > 3 ? fold16(a[g][3]) : zero);
        for (int c = 0; c < NK; c++) scores[g0 + g][j + c] = sums[c] * scale;
    }
}

/* keys_bf16 for NK keys at j and every query head of the group, HEADS at a time. */
static inline __attribute__((always_inline)) void keys_bf16_group(const uint16_t *const *qb, int group,
                                                                  const uint16_t *const *keys, int j, const int NK,
                                                                  int head_dim, float scale,
                                                                  float scores[][KEY_TILE]) {
    int g0 = 0;
    for (; g0 + HEADS <= group; g0 += HEADS) keys_bf16(qb, g0, HEADS, keys, j, NK, head_dim, scale, scores);
    switch (group - g0) {
    case 3: keys_bf16(qb, g0, 3, keys, j, NK, head_dim, scale, scores); break;
    case 2: keys_bf16(qb, g0, 2, keys, j, NK, head_dim, scale, scores); break;
    case 1: keys_bf16(qb, g0, 1, keys, j, NK, head_dim, scale, scores); break;
    default: break;
    }
}

/* tile_scores for bf16 queries (qb: the group's rows, unscaled) and bf16 keys read in place. */
static inline __attribute__((always_inline)) void tile_scores_bf16(const uint16_t *const *qb, int group,
                                                                   const uint16_t *const *keys, int n, int head_dim,
                                                                   float scale, float scores[][KEY_TILE],
                                                                   const spread_prefetch *pf) {
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        for (int i = 0; i < 4; i++) prefetch_row(pf, j + i);
        keys_bf16_group(qb, group, keys, j, 4, head_dim, scale, scores);
    }
    for (; j < n; j++) {
        prefetch_row(pf, j);
        keys_bf16_group(qb, group, keys, j, 1, head_dim, scale, scores);
    }
    for (; j < pf->n; j++) prefetch_row(pf, j);
}
#endif

/* acc[g][d .. d + 4 VW - 1] += sum_j scores[g][j] * values[j][d .. d + 4 VW - 1] for query heads g0 .. g0 + G - 1
 * (G a constant where inlined, so the 4 x G accumulators live in registers across the tile). */
static inline __attribute__((always_inline)) void values_slice(float acc[][MAX_HEAD_DIM], int g0, const int G,
                                                               const float *const *values, int n, int d,
                                                               float scores[][KEY_TILE], const spread_prefetch *pf) {
    vfw a[HEADS][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) a[g][c] = vloadw(acc[g0 + g] + d + VW * c);
    for (int j = 0; j < n; j++) {
        if (pf) prefetch_row(pf, j);
        const float *v = values[j] + d;
        const vfw v0 = vloadw(v), v1 = vloadw(v + VW), v2 = vloadw(v + 2 * VW), v3 = vloadw(v + 3 * VW);
        for (int g = 0; g < G; g++) {
            const float p = scores[g0 + g][j];
            a[g][0] += p * v0;
            a[g][1] += p * v1;
            a[g][2] += p * v2;
            a[g][3] += p * v3;
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) memcpy(acc[g0 + g] + d + VW * c, &a[g][c], sizeof(vfw));
}

/* acc[g] += sum_j scores[g][j] * values[j] over the tile. With head_dim a multiple of 4 vectors, slices of 4
 * vectors of up to HEADS query heads stay in registers across the tile and each value slice is loaded once for
 * them; otherwise one head at a time through memory. */
static inline __attribute__((always_inline)) void tile_values(float acc[][MAX_HEAD_DIM], int group,
                                                              const float *const *values, int n, int head_dim,
                                                              float scores[][KEY_TILE], const spread_prefetch *pf) {
    int j = 0;
    if (head_dim % (4 * VW) != 0) {
        for (; j < n; j++) {
            prefetch_row(pf, j);
            for (int g = 0; g < group; g++) {
                const float p = scores[g][j];
                float *a = acc[g];
                const float *v = values[j];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) a[d] += p * v[d];
            }
        }
    } else {
        for (int d = 0; d < head_dim; d += 4 * VW) {
            const spread_prefetch *first = d == 0 ? pf : NULL; /* the first slice's loop prefetches */
            int g0 = 0;
            for (; g0 + HEADS <= group; g0 += HEADS, first = NULL)
                values_slice(acc, g0, HEADS, values, n, d, scores, first);
            switch (group - g0) {
            case 3: values_slice(acc, g0, 3, values, n, d, scores, first); break;
            case 2: values_slice(acc, g0, 2, values, n, d, scores, first); break;
            case 1: values_slice(acc, g0, 1, values, n, d, scores, first); break;
            default: break;
            }
        }
        j = n;
    }
    for (; j < pf->n; j++) prefetch_row(pf, j);
}

/* One row's softmax step over a tile (online): the scores sg[a .. b) count (a < b), the rest of the tile weighs
 * nothing. Rescales the row's running sum *l and accumulator acc to a new running max *m, and turns sg into the
 * tile's weights. A whole tile wide (fixed trip counts vectorize with tree reductions). attend_chunk keeps its own
 * copy of these lines for [0, n): calling this there made the float32 decode 3-4% slower (2-core Zen 5, 48
 * sequences of 30-250 tokens: 197-206 against 192-202 us a layer, alternating). */
static inline __attribute__((always_inline)) void softmax_tile(float *restrict sg, int a, int b, float *restrict m,
                                                               float *restrict l,
                                                               float *restrict acc, int head_dim) {
    for (int j = 0; j < a; j++) sg[j] = -INFINITY;
    for (int j = b; j < KEY_TILE; j++) sg[j] = -INFINITY;
    float tile_max = *m;
#pragma omp simd reduction(max : tile_max)
    for (int j = 0; j < KEY_TILE; j++) tile_max = sg[j] > tile_max ? sg[j] : tile_max;
    if (tile_max > *m) {
        /* the first tile rescales zeros (m = -inf) */
        const float correction = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - tile_max);
        *l *= correction;
        for (int d = 0; d < head_dim; d++) acc[d] *= correction;
        *m = tile_max;
    }
    const float mg = *m;
    float lsum = 0.0f;
#pragma omp simd reduction(+ : lsum)
    for (int j = 0; j < KEY_TILE; j++) {
        const float w = j >= a && j < b ? exp_nonpositive(sg[j] - mg) : 0.0f;
        sg[j] = w;
        lsum += w;
    }
    *l += lsum;
}

/* Offsets of the key/value rows of KV head h for positions t0 .. min(t0 + KEY_TILE, pos + 1) - 1;
 * returns how many. */
static inline int tile_offsets(const int32_t *table, int t0, int pos, int block_size, int h, int64_t k_s0,
                               int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1, int64_t v_s2, int64_t *k_off,
                               int64_t *v_off) {
    const int n = pos + 1 - t0 < KEY_TILE ? pos + 1 - t0 : KEY_TILE;
    int b = t0 / block_size, o = t0 % block_size;
    for (int j = 0; j < n; j++) {
        const int64_t block = table[b];
        k_off[j] = block * k_s0 + o * k_s1 + h * k_s2;
        v_off[j] = block * v_s0 + o * v_s1 + h * v_s2;
        if (++o == block_size) {
            o = 0;
            b++;
        }
    }
    return n;
}

/* Prefetch row_bytes from each of the n rows at base + (off[j] + shift) elements, into L2 (a tile of all heads'
 * rows is more than L1 holds: prefetched into L1 they came in no faster). Always inlined, as is prefetch_tile: a
 * function whose only effects are prefetches is, to GCC's IPA pure-const pass, a void const function, and its
 * calls were deleted (GCC 12 -O1 and up emitted no prefetch instruction from this file before). */
static inline __attribute__((always_inline)) void prefetch_rows(const void *base, const int64_t *off, int n,
                                                                int64_t shift, int row_bytes, int elem_size) {
    for (int j = 0; j < n; j++) {
        const char *row = (const char *)base + (off[j] + shift) * elem_size;
        for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 1);
    }
}

/* Prefetch row_bytes of every key and value row of the tile starting at t0 (nothing past pos). */
static inline __attribute__((always_inline)) void prefetch_tile(const void *kc, const void *vc, const int32_t *table, int t0, int pos,
                                 int block_size, int h, int64_t k_s0, int64_t k_s1, int64_t k_s2, int64_t v_s0,
                                 int64_t v_s1, int64_t v_s2, int row_bytes, int elem_size) {
    if (t0 > pos) return;
    int64_t k_off[KEY_TILE], v_off[KEY_TILE];
    const int n = tile_offsets(table, t0, pos, block_size, h, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, k_off, v_off);
    prefetch_rows(kc, k_off, n, 0, row_bytes, elem_size);
    prefetch_rows(vc, v_off, n, 0, row_bytes, elem_size);
}

/* Queries [q_begin, q_end) of sequence s, KV heads h .. h + heads - 1: every query head of their groups (heads > 1
 * needs the heads' rows side by side in a token's row, k_s2 == v_s2 == head_dim, and heads * group <= MAX_GROUP).
 * Several heads go through each tile of keys together, so a sequence's blocks are read in one pass, each token's
 * rows of all heads at once. */
static void attend_chunk(const void *q, int64_t q_s0, int64_t q_s1, const void *kc, const void *vc, int64_t k_s0,
                         int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1, int64_t v_s2,
                         const int32_t *table, int block_size, int head_dim, int group, int h, int heads, int64_t q_row0,
                         int q_begin, int q_end, int first_pos, float scale, int sliding_window, float softcap,
                         void *out, int64_t o_s0, int64_t o_s1, int dtype, int cache_dtype, float k_scale,
                         float v_scale, int prefetch_bytes, int key_begin, int key_end, float *partial) {
    float qf[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float scores[MAX_GROUP][KEY_TILE];
    float tmp[MAX_HEAD_DIM];
    float ktile[KEY_TILE][MAX_HEAD_DIM]; /* keys converted to float32 (16-bit caches only) */
    const int elem_size = cache_dtype == 0 ? 4 : cache_dtype == 3 ? 1 : 2;
    const float q_scale = cache_dtype == 3 ? scale * k_scale : scale; /* e4m3 keys: k_scale folded in */
#if PK_BF16_DOT
    const int bf16_dot = dtype == 2 && cache_dtype == 2 && head_dim % 32 == 0;
    const uint16_t *qb[MAX_GROUP]; /* bf16_dot: the query rows of this pass, as they are */
#endif
    for (int i = q_begin; i < q_end; i++) {
        const int64_t row = q_row0 + i;
        const int pos_q = first_pos + i; /* this query's position: it sees keys lo_q..pos_q */
        const int lo_q = sliding_window > 0 && pos_q - sliding_window + 1 > 0 ? pos_q - sliding_window + 1 : 0;
        /* a split of a decode (partial != NULL) covers the keys in [key_begin, key_end) of those */
        const int lo = lo_q > key_begin ? lo_q : key_begin;
        const int pos = pos_q < key_end - 1 ? pos_q : key_end - 1;
        const int G = heads * group; /* query heads of this pass: head h * group + g for g < G */
        for (int g = 0; g < G; g++) {
            const int head = h * group + g;
#if PK_BF16_DOT
            if (bf16_dot) {
                qb[g] = (const uint16_t *)q + row * q_s0 + head * q_s1;
                memset(acc[g], 0, sizeof(float) * (size_t)head_dim);
                m[g] = -INFINITY;
                l[g] = 0.0f;
                continue;
            }
#endif
            const float *src = load_row(q, row * q_s0 + head * q_s1, dtype, head_dim, tmp);
            for (int d = 0; d < head_dim; d++) {
                qf[g][d] = src[d] * q_scale;
                acc[g][d] = 0.0f;
            }
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        /* Element offsets of a tile's key and value rows (walking the block table), for this tile and
         * the next: the first query of the chunk prefetches prefetch_bytes from each row of the next
         * tile while it works on this one (the caller's choice: this head's row, all heads' rows of the
         * token, or nothing when an earlier head's pass brought them in). Rows sit in blocks scattered
         * over the cache; without this every row is a DRAM latency the core waits out. */
        int64_t k_off[KEY_TILE], v_off[KEY_TILE];
        const int prefetch = i == q_begin && prefetch_bytes > 0;
        if (prefetch)
            for (int t = 0; t < PREFETCH_TILES; t++)
                prefetch_tile(kc, vc, table, lo + t * KEY_TILE, pos, block_size, h, k_s0, k_s1, k_s2, v_s0, v_s1,
                              v_s2, prefetch_bytes, elem_size);
        for (int t0 = lo; t0 <= pos; t0 += KEY_TILE) {
            const int n = tile_offsets(table, t0, pos, block_size, h, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, k_off,
                                       v_off);
            /* The tile PREFETCH_TILES ahead goes out head by head, each head's keys during its dots and its values
             * during its value sums, a row per key row the loop takes (spread_prefetch), its block table walked
             * once. Issued all at the tile's start, batch 48 x 140 tokens over 30 layers took 19.3-19.6 ms against
             * 17.1-17.2 issued head by head before each loop (2-core Zen 4); on a 2-core Zen 5 that took 15.1-16.5
             * ms (AVX2 build; AVX-512: 13.1-14.5), spread through the loops with one tile ahead 11.7-13.3 (11.1-12.6),
             * and one 4096-token sequence (split-K) 10.5-12.1 -> 8.5-10.0 ms. A burst of a tile's prefetches (32 rows
             * of 256 bytes per head) holds up the loads behind it until the fill buffers drain; two tiles ahead (96
             * KB of keys and values) are more than L1 holds. */
            int64_t pk_off[KEY_TILE], pv_off[KEY_TILE];
            const int t_ahead = t0 + PREFETCH_TILES * KEY_TILE;
            const int pn = prefetch && t_ahead <= pos ? tile_offsets(table, t_ahead, pos, block_size, h, k_s0, k_s1,
                                                                     k_s2, v_s0, v_s1, v_s2, pk_off, pv_off)
                                                      : 0;
            const int head_bytes = prefetch_bytes / heads;
            const float *keys[KEY_TILE];
            for (int hh = 0; hh < heads; hh++) {
                const spread_prefetch pf = {(const char *)kc, pk_off, pn, hh * k_s2, head_bytes, elem_size};
#if PK_BF16_DOT
                if (bf16_dot) {
                    const uint16_t *keys_b[KEY_TILE];
                    for (int j = 0; j < n; j++) keys_b[j] = (const uint16_t *)kc + k_off[j] + hh * k_s2;
                    tile_scores_bf16(qb + hh * group, group, keys_b, n, head_dim, q_scale, scores + hh * group, &pf);
                    continue;
                }
#endif
                for (int j = 0; j < n; j++)
                    keys[j] = load_row(kc, k_off[j] + hh * k_s2, cache_dtype, head_dim, ktile[j]);
                tile_scores(qf + hh * group, group, keys, n, head_dim, scores + hh * group, &pf);
            }
            if (softcap > 0.0f)
                for (int g = 0; g < G; g++)
                    for (int j = 0; j < n; j++) scores[g][j] = softcap * tanhf(scores[g][j] / softcap);
            /* the softmax over the tile: the scores past n weigh 0 */
            for (int g = 0; g < G; g++) {
                float *sg = scores[g];
                for (int j = n; j < KEY_TILE; j++) sg[j] = -INFINITY;
                float tile_max = m[g];
#pragma omp simd reduction(max : tile_max)
                for (int j = 0; j < KEY_TILE; j++) tile_max = sg[j] > tile_max ? sg[j] : tile_max;
                if (tile_max > m[g]) {
                    /* the first tile rescales zeros (m = -inf) */
                    const float correction = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - tile_max);
                    l[g] *= correction;
                    for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;
                    m[g] = tile_max;
                }
                const float mg = m[g];
                float lsum = 0.0f;
#pragma omp simd reduction(+ : lsum)
                for (int j = 0; j < KEY_TILE; j++) {
                    const float w = j < n ? exp_nonpositive(sg[j] - mg) : 0.0f;
                    sg[j] = w;
                    lsum += w;
                }
                l[g] += lsum;
            }
            const float *values[KEY_TILE];
            for (int hh = 0; hh < heads; hh++) {
                const spread_prefetch pf = {(const char *)vc, pv_off, pn, hh * v_s2, head_bytes, elem_size};
                for (int j = 0; j < n; j++)
                    values[j] = load_row(vc, v_off[j] + hh * v_s2, cache_dtype, head_dim, ktile[j]);
                tile_values(acc + hh * group, group, values, n, head_dim, scores + hh * group, &pf);
            }
        }
        if (partial) { /* unnormalized: max, sum of weights, weighted values (decode_split_k merges them) */
            for (int g = 0; g < G; g++) {
                float *p = partial + (int64_t)g * (head_dim + 2);
                p[0] = m[g];
                p[1] = l[g];
                memcpy(p + 2, acc[g], sizeof(float) * head_dim);
            }
            continue;
        }
        for (int g = 0; g < G; g++) {
            const float inv = (cache_dtype == 3 ? v_scale : 1.0f) / l[g];
            for (int d = 0; d < head_dim; d++) acc[g][d] *= inv;
            store_row(out, row * o_s0 + (h * group + g) * o_s1, dtype, head_dim, acc[g]);
        }
    }
}

/* Queries [q_begin, q_end) of sequence s against KV head h, all at once (a prefill's chunk): its (query, query head)
 * pairs are the rows of one pass over the keys, rows = queries x group <= MAX_GROUP, so each key and value row is
 * read (and a 16-bit or fp8 one widened) once for the chunk, not once per query. The pass covers the keys of the
 * chunk's first query's window start to its last query's position; the keys before a query's window or past its
 * position weigh nothing. Otherwise attend_chunk's arithmetic: the same dots, tiles and online softmax. A 1395-token
 * prefill step of 19 sequences of 16-128 tokens with SmolLM2's heads (2-core Zen 5, alternating): bf16 1126-1138 ->
 * 854-862 us a layer, float32 1347-1456 -> 1050-1169 us, where attend_chunk took one query at a time. */
static void attend_queries(const void *q, int64_t q_s0, int64_t q_s1, const void *kc, const void *vc, int64_t k_s0,
                           int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1, int64_t v_s2,
                           const int32_t *table, int block_size, int head_dim, int group, int h, int64_t q_row0,
                           int q_begin, int q_end, int first_pos, float scale, int sliding_window, float softcap,
                           void *out, int64_t o_s0, int64_t o_s1, int dtype, int cache_dtype, float k_scale,
                           float v_scale) {
    float qf[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float scores[MAX_GROUP][KEY_TILE];
    float tmp[MAX_HEAD_DIM];
    float ktile[KEY_TILE][MAX_HEAD_DIM]; /* keys or values widened to float32 (16-bit and fp8 caches) */
    int q_lo[MAX_GROUP], q_pos[MAX_GROUP]; /* per query of the chunk: the keys it sees, q_lo .. q_pos */
    const int elem_size = cache_dtype == 0 ? 4 : cache_dtype == 3 ? 1 : 2;
    const float q_scale = cache_dtype == 3 ? scale * k_scale : scale;
    const int nq = q_end - q_begin, rows = nq * group;
#if PK_BF16_DOT
    const int bf16_dot = dtype == 2 && cache_dtype == 2 && head_dim % 32 == 0;
    const uint16_t *qb[MAX_GROUP];
#endif
    for (int i = 0; i < nq; i++) {
        const int pos_q = first_pos + q_begin + i;
        q_pos[i] = pos_q;
        q_lo[i] = sliding_window > 0 && pos_q - sliding_window + 1 > 0 ? pos_q - sliding_window + 1 : 0;
        const int64_t row = q_row0 + q_begin + i;
        for (int g = 0; g < group; g++) {
            const int r = i * group + g;
            memset(acc[r], 0, sizeof(float) * (size_t)head_dim);
            m[r] = -INFINITY;
            l[r] = 0.0f;
#if PK_BF16_DOT
            if (bf16_dot) {
                qb[r] = (const uint16_t *)q + row * q_s0 + (h * group + g) * q_s1;
                continue;
            }
#endif
            const float *src = load_row(q, row * q_s0 + (h * group + g) * q_s1, dtype, head_dim, tmp);
            for (int d = 0; d < head_dim; d++) qf[r][d] = src[d] * q_scale;
        }
    }
    const int lo = q_lo[0], pos = q_pos[nq - 1];
    const spread_prefetch none = {(const char *)kc, NULL, 0, 0, 0, elem_size};
    int64_t k_off[KEY_TILE], v_off[KEY_TILE];
    for (int t0 = lo; t0 <= pos; t0 += KEY_TILE) {
        const int n = tile_offsets(table, t0, pos, block_size, h, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, k_off, v_off);
        /* the next tile's rows on their way while this one is worked on */
        if (t0 + KEY_TILE <= pos)
            prefetch_tile(kc, vc, table, t0 + KEY_TILE, pos, block_size, h, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
                          head_dim * elem_size, elem_size);
#if PK_BF16_DOT
        if (bf16_dot) {
            const uint16_t *keys_b[KEY_TILE];
            for (int j = 0; j < n; j++) keys_b[j] = (const uint16_t *)kc + k_off[j];
            tile_scores_bf16(qb, rows, keys_b, n, head_dim, q_scale, scores, &none);
        } else
#endif
        {
            const float *keys[KEY_TILE];
            for (int j = 0; j < n; j++) keys[j] = load_row(kc, k_off[j], cache_dtype, head_dim, ktile[j]);
            tile_scores(qf, rows, keys, n, head_dim, scores, &none);
        }
        if (softcap > 0.0f)
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < n; j++) scores[r][j] = softcap * tanhf(scores[r][j] / softcap);
        for (int i = 0; i < nq; i++) {
            /* this query's keys in the tile: [a, b) */
            const int a = q_lo[i] > t0 ? q_lo[i] - t0 : 0;
            const int b = q_pos[i] + 1 - t0 < n ? q_pos[i] + 1 - t0 : n;
            for (int g = 0; g < group; g++) {
                const int r = i * group + g;
                if (a < b)
                    softmax_tile(scores[r], a, b, &m[r], &l[r], acc[r], head_dim);
                else /* none: the tile weighs nothing for this row */
                    memset(scores[r], 0, sizeof(float) * KEY_TILE);
            }
        }
        const float *values[KEY_TILE];
        for (int j = 0; j < n; j++) values[j] = load_row(vc, v_off[j], cache_dtype, head_dim, ktile[j]);
        tile_values(acc, rows, values, n, head_dim, scores, &none);
    }
    for (int i = 0; i < nq; i++) {
        const int64_t row = q_row0 + q_begin + i;
        for (int g = 0; g < group; g++) {
            const int r = i * group + g;
            const float inv = (cache_dtype == 3 ? v_scale : 1.0f) / l[r];
            for (int d = 0; d < head_dim; d++) acc[r][d] *= inv;
            store_row(out, row * o_s0 + (h * group + g) * o_s1, dtype, head_dim, acc[r]);
        }
    }
}

/* Whether the metadata only index what exists: cu_seqlens_q starts at 0, ends at num_tokens and never
 * decreases; 0 <= q_len <= seq_len (decode: seq_len >= 0 and within the cache's capacity); the blocks a
 * sequence uses fit its table row and hold block ids in [0, num_blocks). */
static int metadata_ok(const int32_t *block_tables, int64_t table_stride, int64_t table_width,
                       const int32_t *cu_seqlens_q, const int32_t *seq_lens, int64_t num_seqs, int64_t num_tokens,
                       int64_t num_blocks, int block_size) {
    if (cu_seqlens_q && (cu_seqlens_q[0] != 0 || cu_seqlens_q[num_seqs] != num_tokens)) return 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = seq_lens[s];
        const int64_t q_len = cu_seqlens_q ? (int64_t)cu_seqlens_q[s + 1] - cu_seqlens_q[s] : 0;
        if (len < 0 || q_len < 0 || q_len > len) return 0;
        if (!cu_seqlens_q && len > num_blocks * block_size) return 0;
        const int64_t blocks = (len + block_size - 1) / block_size;
        if (blocks > table_width) return 0;
        const int32_t *row = block_tables + s * table_stride;
        for (int64_t b = 0; b < blocks; b++)
            if (row[b] < 0 || row[b] >= num_blocks) return 0;
    }
    return 1;
}

/* Decode with too few (sequence, KV head) items to occupy the threads (one sequence has as many items as KV
 * heads): each item's keys are split in ranges of whole key tiles, each range an item of its own writing its
 * unnormalized partial (max, weight sum, weighted values per query head), then the partials of an item merge
 * into its output rows. Returns 0 when done, 1 when splitting does not pay (short sequences: the caller goes
 * on unsplit), -2 out of memory. Rows of empty sequences are left to the caller. */
static int decode_split_k(const void *q, int64_t q_s0, int64_t q_s1, const void *kc, const void *vc, int64_t k_s0,
                          int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1, int64_t v_s2,
                          const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                          int64_t num_seqs, int num_kv_heads, int head_dim, int block_size, int group, float scale,
                          int sliding_window, float softcap, void *out, int64_t o_s0, int64_t o_s1, int dtype,
                          int num_threads, int64_t num_items, int cache_dtype, float k_scale, float v_scale,
                          int row_bytes) {
    int64_t max_len = 0;
    for (int64_t s = 0; s < num_seqs; s++) max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    /* ranges of at least SPLIT_MIN_KEYS keys, enough of them for four items a thread */
    int64_t splits = (4 * (int64_t)num_threads + num_items - 1) / (num_items > 0 ? num_items : 1);
    const int64_t most = max_len / SPLIT_MIN_KEYS;
    splits = splits < most ? splits : most;
    if (splits < 2) return 1;
    const int64_t pairs = num_seqs * num_kv_heads, stride = (int64_t)group * (head_dim + 2);
    float *partials = (float *)malloc(sizeof(float) * (size_t)(pairs * splits * stride));
    if (!partials) return -2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < pairs * splits; item++) {
        const int64_t s = item / (num_kv_heads * splits), h = (item / splits) % num_kv_heads, i = item % splits;
        const int len = seq_lens[s];
        if (len <= 0) continue;
        /* range i: ceil(len / splits) keys rounded up to whole tiles */
        const int chunk = (int)(((len + splits - 1) / splits + KEY_TILE - 1) / KEY_TILE * KEY_TILE);
        const int begin = (int)i * chunk, end = begin + chunk < len ? begin + chunk : len;
        float *partial = partials + item * stride;
        if (begin >= end) { /* past the end: a partial that weighs nothing */
            for (int g = 0; g < group; g++) {
                float *p = partial + (int64_t)g * (head_dim + 2);
                p[0] = -INFINITY;
                memset(p + 1, 0, sizeof(float) * (size_t)(head_dim + 1));
            }
            continue;
        }
        attend_chunk(q, q_s0, q_s1, kc, vc, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, block_tables + s * table_stride,
                     block_size, head_dim, group, (int)h, 1, s, 0, 1, len - 1, scale, sliding_window, softcap, out,
                     o_s0, o_s1, dtype, cache_dtype, k_scale, v_scale, row_bytes, begin, end, partial);
    }
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t s = pair / num_kv_heads, h = pair % num_kv_heads;
        if (seq_lens[s] <= 0) continue;
        for (int g = 0; g < group; g++) {
            float m = -INFINITY;
            for (int64_t i = 0; i < splits; i++) {
                const float mi = partials[(pair * splits + i) * stride + (int64_t)g * (head_dim + 2)];
                m = mi > m ? mi : m;
            }
            float acc[MAX_HEAD_DIM] = {0}, l = 0.0f;
            for (int64_t i = 0; i < splits; i++) {
                const float *p = partials + (pair * splits + i) * stride + (int64_t)g * (head_dim + 2);
                if (p[0] == -INFINITY) continue; /* saw no key (past the end, or before a sliding window) */
                const float w = exp_nonpositive(p[0] - m);
                l += w * p[1];
                for (int d = 0; d < head_dim; d++) acc[d] += w * p[2 + d];
            }
            const float inv = (cache_dtype == 3 ? v_scale : 1.0f) / l;
            for (int d = 0; d < head_dim; d++) acc[d] *= inv;
            store_row(out, s * o_s0 + (h * group + g) * o_s1, dtype, head_dim, acc);
        }
    }
    free(partials);
    return 0;
}

/* Returns 0; 1 when the metadata index out of range (nothing written); -1 when a shape is beyond the
 * fixed per-thread buffers (the caller checks first); -2 when out of memory. */
int pk_paged_attention(const void *q, int64_t q_s0, int64_t q_s1, const void *key_cache, const void *value_cache,
                       int64_t k_s0, int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1, int64_t v_s2,
                       const int32_t *block_tables, int64_t table_stride, const int32_t *cu_seqlens_q,
                       const int32_t *seq_lens, int64_t num_seqs, int num_q_heads, int num_kv_heads,
                       int head_dim, int block_size, float scale, int sliding_window, float softcap, void *out,
                       int64_t o_s0, int64_t o_s1, int dtype, int num_threads, int64_t num_blocks,
                       int64_t num_tokens, int64_t table_width, int cache_dtype, float k_scale, float v_scale) {
    const int group = num_q_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP) return -1;
    if (!metadata_ok(block_tables, table_stride, table_width, cu_seqlens_q, seq_lens, num_seqs, num_tokens,
                     num_blocks, block_size))
        return 1;
    /* Work items: (sequence, chunk of QUERY_CHUNK queries, KV heads). With enough items for every thread
     * an item takes all KV heads of its chunk, so it reads whole token rows of each block (all heads are
     * contiguous there) and prefetches them in its first head's pass; otherwise (few sequences, e.g. one
     * long decode) each KV head is an item of its own, so the threads share a sequence's heads.
     * item_start[s] = first item of sequence s. */
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!item_start) return -2;
    int64_t total_chunks = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = cu_seqlens_q ? cu_seqlens_q[s + 1] - cu_seqlens_q[s] : 1;
        total_chunks += seq_lens[s] > 0 ? (q_len + QUERY_CHUNK - 1) / QUERY_CHUNK : 0;
    }
    const int elem_size = cache_dtype == 0 ? 4 : cache_dtype == 3 ? 1 : 2, row_bytes = head_dim * elem_size;
    const int heads_contiguous = k_s2 == head_dim && v_s2 == head_dim;
    const int heads_per_item = total_chunks >= 4 * (int64_t)num_threads && heads_contiguous ? num_kv_heads : 1;
    const int kv_items = num_kv_heads / heads_per_item;
    item_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = cu_seqlens_q ? cu_seqlens_q[s + 1] - cu_seqlens_q[s] : 1;
        const int64_t chunks = seq_lens[s] > 0 ? (q_len + QUERY_CHUNK - 1) / QUERY_CHUNK : 0;
        item_start[s + 1] = item_start[s] + chunks * kv_items;
    }
    int64_t num_items = item_start[num_seqs];
    if (!cu_seqlens_q && num_threads > 1 && num_items < 4 * (int64_t)num_threads) {
        const int rc = decode_split_k(q, q_s0, q_s1, key_cache, value_cache, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
                                      block_tables, table_stride, seq_lens, num_seqs, num_kv_heads, head_dim,
                                      block_size, group, scale, sliding_window, softcap, out, o_s0, o_s1, dtype,
                                      num_threads, num_items, cache_dtype, k_scale, v_scale, row_bytes);
        if (rc < 0) {
            free(item_start);
            return rc;
        }
        if (rc == 0) num_items = 0; /* done: only the rows of empty sequences are left (below) */
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        int64_t lo = 0, hi = num_seqs - 1; /* the sequence owning this item: last s with start <= item */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (item_start[mid] <= item) lo = mid; else hi = mid - 1;
        }
        const int64_t s = lo, local = item - item_start[s];
        const int h0 = (int)(local % kv_items) * heads_per_item;
        const int chunk = (int)(local / kv_items);
        const int64_t q_row0 = cu_seqlens_q ? cu_seqlens_q[s] : s;
        const int q_len = cu_seqlens_q ? cu_seqlens_q[s + 1] - cu_seqlens_q[s] : 1;
        const int q_begin = chunk * QUERY_CHUNK;
        const int q_end = q_begin + QUERY_CHUNK < q_len ? q_begin + QUERY_CHUNK : q_len;
        if (!cu_seqlens_q && heads_per_item == num_kv_heads && item + num_threads < num_items) {
            /* A decode item's first tiles have nothing to overlap their fetch with (its own prefetch runs a few
             * tiles ahead of its own work): start on those of the item this thread likely takes next. */
            const int64_t next = item + num_threads; /* decode: item = sequence */
            const int next_pos = seq_lens[next] - 1;
            for (int t = 0; t < PREFETCH_TILES; t++)
                prefetch_tile(key_cache, value_cache, block_tables + next * table_stride, t * KEY_TILE, next_pos,
                              block_size, 0, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, row_bytes * num_kv_heads,
                              elem_size);
        }
        if (cu_seqlens_q && q_end - q_begin > 1 && 2 * group <= MAX_GROUP) {
            /* a prefill's chunk: its queries together, as many as fit a pass's rows at a time */
            const int per_pass = MAX_GROUP / group;
            for (int h = h0; h < h0 + heads_per_item; h++)
                for (int b = q_begin; b < q_end; b += per_pass)
                    attend_queries(q, q_s0, q_s1, key_cache, value_cache, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
                                   block_tables + s * table_stride, block_size, head_dim, group, h, q_row0, b,
                                   b + per_pass < q_end ? b + per_pass : q_end, seq_lens[s] - q_len, scale,
                                   sliding_window, softcap, out, o_s0, o_s1, dtype, cache_dtype, k_scale, v_scale);
            continue;
        }
        /* all heads of the item in one pass where their query heads fit (else one pass per head, head 0's
         * prefetching the whole token rows) */
        const int pass_heads = heads_per_item * group <= MAX_GROUP ? heads_per_item : 1;
        for (int h = h0; h < h0 + heads_per_item; h += pass_heads) {
            const int prefetch_bytes = h == h0 ? row_bytes * heads_per_item : 0;
            attend_chunk(q, q_s0, q_s1, key_cache, value_cache, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
                         block_tables + s * table_stride, block_size, head_dim, group, h, pass_heads, q_row0,
                         q_begin, q_end, seq_lens[s] - q_len, scale, sliding_window, softcap, out, o_s0, o_s1,
                         dtype, cache_dtype, k_scale, v_scale, prefetch_bytes, 0, INT32_MAX, NULL);
        }
    }
    /* Decode rows of empty sequences (seq_len 0) are zeros. */
    if (!cu_seqlens_q) {
        for (int64_t s = 0; s < num_seqs; s++) {
            if (seq_lens[s] > 0) continue;
            for (int hq = 0; hq < num_q_heads; hq++) {
                float zeros[MAX_HEAD_DIM] = {0};
                store_row(out, s * o_s0 + hq * o_s1, dtype, head_dim, zeros);
            }
        }
    }
    free(item_start);
    return 0;
}

/* Row of n values of dtype src_dt as e4m3 codes of value / scale. */
static void quantize_row_e4m3(const void *src, int64_t offset, int src_dt, int64_t n, float scale, uint8_t *dst) {
    float tmp[MAX_HEAD_DIM];
    const float *v = load_row(src, offset, src_dt, n, tmp);
    for (int64_t d = 0; d < n; d++) dst[d] = float_to_e4m3(v[d] / scale);
}

/* key/value [num_tokens, num_kv_heads, head_dim] (strides t_s0, t_s1) into the caches; slot < 0 skips.
 * cache_dtype 3: the caches are e4m3, written as code(x / k_scale) (v_scale for values) from key/value
 * of dtype src_dtype; otherwise the rows are copied (elem_size bytes per value).
 * Returns 0, or 1 (nothing written) when a slot is past the cache's num_blocks * block_size. */
int pk_reshape_and_cache(const void *key, int64_t k_s0, int64_t k_s1, const void *value, int64_t v_s0,
                         int64_t v_s1, void *key_cache, int64_t kc_s0, int64_t kc_s1, int64_t kc_s2,
                         void *value_cache, int64_t vc_s0, int64_t vc_s1, int64_t vc_s2, const int64_t *slots,
                         int64_t num_tokens, int num_kv_heads, int head_dim, int block_size, int elem_size,
                         int64_t num_blocks, int src_dtype, int cache_dtype, float k_scale, float v_scale) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_blocks * block_size) return 1;
    if (cache_dtype == 3) {
        if (head_dim > MAX_HEAD_DIM) return -1;
        for (int64_t t = 0; t < num_tokens; t++) {
            const int64_t slot = slots[t];
            if (slot < 0) continue;
            const int64_t block = slot / block_size, offset = slot % block_size;
            for (int h = 0; h < num_kv_heads; h++) {
                quantize_row_e4m3(key, t * k_s0 + h * k_s1, src_dtype, head_dim, k_scale,
                                  (uint8_t *)key_cache + block * kc_s0 + offset * kc_s1 + h * kc_s2);
                quantize_row_e4m3(value, t * v_s0 + h * v_s1, src_dtype, head_dim, v_scale,
                                  (uint8_t *)value_cache + block * vc_s0 + offset * vc_s1 + h * vc_s2);
            }
        }
        return 0;
    }
    const size_t row_bytes = (size_t)head_dim * elem_size;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            memcpy((char *)key_cache + (block * kc_s0 + offset * kc_s1 + h * kc_s2) * elem_size,
                   (const char *)key + (t * k_s0 + h * k_s1) * elem_size, row_bytes);
            memcpy((char *)value_cache + (block * vc_s0 + offset * vc_s1 + h * vc_s2) * elem_size,
                   (const char *)value + (t * v_s0 + h * v_s1) * elem_size, row_bytes);
        }
    }
    return 0;
}
