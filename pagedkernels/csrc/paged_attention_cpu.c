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
 * dtype: 0 = float32, 1 = float16, 2 = bfloat16. Arithmetic is float32 with an online softmax over
 * tiles of keys; the GQA group's query heads share each key/value row they read.
 */
#include "cpu_common.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 64
#define KEY_TILE 32
#define QUERY_CHUNK 16

static inline float dot(const float *a, const float *b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < n; d++) acc += a[d] * b[d];
    return acc;
}

/* scores[g][j] = qf[g] . keys[j] for the n keys of a tile and every query head of the group. Four keys
 * at a time with a vector accumulator each: four independent FMA chains per head instead of one
 * latency-bound chain per dot product (head_dim a multiple of 16; other sizes take the plain dots). */
static inline void tile_scores(float qf[][MAX_HEAD_DIM], int group, const float *const *keys, int n, int head_dim,
                               float scores[][KEY_TILE]) {
    int j = 0;
    if (head_dim % 16 == 0) {
        for (; j + 4 <= n; j += 4) {
            const float *k0 = keys[j], *k1 = keys[j + 1], *k2 = keys[j + 2], *k3 = keys[j + 3];
            for (int g = 0; g < group; g++) {
                const float *qg = qf[g];
                vf16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int d = 0; d < head_dim; d += 16) {
                    const vf16 qv = vload16(qg + d);
                    a0 += qv * vload16(k0 + d);
                    a1 += qv * vload16(k1 + d);
                    a2 += qv * vload16(k2 + d);
                    a3 += qv * vload16(k3 + d);
                }
                scores[g][j] = vsum16(a0);
                scores[g][j + 1] = vsum16(a1);
                scores[g][j + 2] = vsum16(a2);
                scores[g][j + 3] = vsum16(a3);
            }
        }
    }
    for (; j < n; j++)
        for (int g = 0; g < group; g++) scores[g][j] = dot(qf[g], keys[j], head_dim);
}

/* Queries [q_begin, q_end) of sequence s, KV head h: every query head of h's group. */
static void attend_chunk(const void *q, int64_t q_s0, int64_t q_s1, const void *kc, const void *vc, int64_t k_s0,
                         int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1, int64_t v_s2,
                         const int32_t *table, int block_size, int head_dim, int group, int h, int64_t q_row0,
                         int q_begin, int q_end, int first_pos, float scale, int sliding_window, float softcap,
                         void *out, int64_t o_s0, int64_t o_s1, int dtype) {
    float qf[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float scores[MAX_GROUP][KEY_TILE];
    float tmp[MAX_HEAD_DIM];
    float ktile[KEY_TILE][MAX_HEAD_DIM]; /* keys converted to float32 (16-bit caches only) */
    for (int i = q_begin; i < q_end; i++) {
        const int64_t row = q_row0 + i;
        const int pos = first_pos + i; /* this query's position: it sees keys lo..pos */
        const int lo = sliding_window > 0 && pos - sliding_window + 1 > 0 ? pos - sliding_window + 1 : 0;
        for (int g = 0; g < group; g++) {
            const int head = h * group + g;
            const float *src = load_row(q, row * q_s0 + head * q_s1, dtype, head_dim, tmp);
            for (int d = 0; d < head_dim; d++) {
                qf[g][d] = src[d] * scale;
                acc[g][d] = 0.0f;
            }
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        for (int t0 = lo; t0 <= pos; t0 += KEY_TILE) {
            const int n = pos + 1 - t0 < KEY_TILE ? pos + 1 - t0 : KEY_TILE;
            /* element offsets of this tile's key and value rows, walking the block table */
            int64_t k_off[KEY_TILE], v_off[KEY_TILE];
            {
                int b = t0 / block_size, o = t0 % block_size;
                for (int j = 0; j < n; j++) {
                    const int64_t block = table[b];
                    k_off[j] = block * k_s0 + o * k_s1 + h * k_s2;
                    v_off[j] = block * v_s0 + o * v_s1 + h * v_s2;
                    if (++o == block_size) { o = 0; b++; }
                }
            }
            const float *keys[KEY_TILE];
            for (int j = 0; j < n; j++) keys[j] = load_row(kc, k_off[j], dtype, head_dim, ktile[j]);
            tile_scores(qf, group, keys, n, head_dim, scores);
            if (softcap > 0.0f)
                for (int g = 0; g < group; g++)
                    for (int j = 0; j < n; j++) scores[g][j] = softcap * tanhf(scores[g][j] / softcap);
            for (int g = 0; g < group; g++) {
                float tile_max = m[g];
                for (int j = 0; j < n; j++) tile_max = scores[g][j] > tile_max ? scores[g][j] : tile_max;
                if (tile_max > m[g]) {
                    /* the first tile rescales zeros (m = -inf) */
                    const float correction = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - tile_max);
                    l[g] *= correction;
                    for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;
                    m[g] = tile_max;
                }
                const float mg = m[g];
                float *sg = scores[g];
                float lsum = 0.0f;
#pragma omp simd reduction(+ : lsum)
                for (int j = 0; j < n; j++) {
                    sg[j] = exp_nonpositive(sg[j] - mg);
                    lsum += sg[j];
                }
                l[g] += lsum;
            }
            for (int j = 0; j < n; j++) {
                const float *v = load_row(vc, v_off[j], dtype, head_dim, tmp);
                for (int g = 0; g < group; g++) {
                    const float p = scores[g][j];
                    float *a = acc[g];
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) a[d] += p * v[d];
                }
            }
        }
        for (int g = 0; g < group; g++) {
            const float inv = 1.0f / l[g];
            for (int d = 0; d < head_dim; d++) acc[g][d] *= inv;
            store_row(out, row * o_s0 + (h * group + g) * o_s1, dtype, head_dim, acc[g]);
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

/* Returns 0; 1 when the metadata index out of range (nothing written); -1 when a shape is beyond the
 * fixed per-thread buffers (the caller checks first); -2 when out of memory. */
int pk_paged_attention(const void *q, int64_t q_s0, int64_t q_s1, const void *key_cache, const void *value_cache,
                       int64_t k_s0, int64_t k_s1, int64_t k_s2, int64_t v_s0, int64_t v_s1, int64_t v_s2,
                       const int32_t *block_tables, int64_t table_stride, const int32_t *cu_seqlens_q,
                       const int32_t *seq_lens, int64_t num_seqs, int num_q_heads, int num_kv_heads,
                       int head_dim, int block_size, float scale, int sliding_window, float softcap, void *out,
                       int64_t o_s0, int64_t o_s1, int dtype, int num_threads, int64_t num_blocks,
                       int64_t num_tokens, int64_t table_width) {
    const int group = num_q_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP) return -1;
    if (!metadata_ok(block_tables, table_stride, table_width, cu_seqlens_q, seq_lens, num_seqs, num_tokens,
                     num_blocks, block_size))
        return 1;
    /* Work items: (sequence, KV head, chunk of QUERY_CHUNK queries); item_start[s] = first item of s. */
    int64_t *item_start = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!item_start) return -2;
    item_start[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = cu_seqlens_q ? cu_seqlens_q[s + 1] - cu_seqlens_q[s] : 1;
        const int64_t chunks = seq_lens[s] > 0 ? (q_len + QUERY_CHUNK - 1) / QUERY_CHUNK : 0;
        item_start[s + 1] = item_start[s] + chunks * num_kv_heads;
    }
    const int64_t num_items = item_start[num_seqs];
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        int64_t lo = 0, hi = num_seqs - 1; /* the sequence owning this item: last s with start <= item */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (item_start[mid] <= item) lo = mid; else hi = mid - 1;
        }
        const int64_t s = lo, local = item - item_start[s];
        const int h = (int)(local % num_kv_heads);
        const int chunk = (int)(local / num_kv_heads);
        const int64_t q_row0 = cu_seqlens_q ? cu_seqlens_q[s] : s;
        const int q_len = cu_seqlens_q ? cu_seqlens_q[s + 1] - cu_seqlens_q[s] : 1;
        const int q_begin = chunk * QUERY_CHUNK;
        const int q_end = q_begin + QUERY_CHUNK < q_len ? q_begin + QUERY_CHUNK : q_len;
        attend_chunk(q, q_s0, q_s1, key_cache, value_cache, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
                     block_tables + s * table_stride, block_size, head_dim, group, h, q_row0, q_begin, q_end,
                     seq_lens[s] - q_len, scale, sliding_window, softcap, out, o_s0, o_s1, dtype);
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

/* key/value [num_tokens, num_kv_heads, head_dim] (strides t_s0, t_s1) into the caches; slot < 0 skips.
 * Returns 0, or 1 (nothing written) when a slot is past the cache's num_blocks * block_size. */
int pk_reshape_and_cache(const void *key, int64_t k_s0, int64_t k_s1, const void *value, int64_t v_s0,
                         int64_t v_s1, void *key_cache, int64_t kc_s0, int64_t kc_s1, int64_t kc_s2,
                         void *value_cache, int64_t vc_s0, int64_t vc_s1, int64_t vc_s2, const int64_t *slots,
                         int64_t num_tokens, int num_kv_heads, int head_dim, int block_size, int elem_size,
                         int64_t num_blocks) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_blocks * block_size) return 1;
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
