/* out [M, N] = x [M, K] @ W^T for a 16-bit float weight W [N, K] (bfloat16 or float16) and float32
 * activations, accumulated in float32: each weight value is widened exactly (bf16: a 16-bit shift; fp16:
 * the F16C conversion where the build has it), so the product is the float32 product of the same values,
 * reading half the weight bytes. Meant for decode-sized M: a product of few rows is bound by the bytes of its
 * weight, and at a few dozen rows the kernel keeps up with oneDNN's float32 one.
 *
 * The weight comes prepacked (pagedkernels.w16_gemm.pack_w16) in panels of NP = 32 output columns; the panel
 * micro-kernels (w16_panel.h) are shared with the MoE kernel (moe_cpu.c). This file spreads the panels over
 * the threads.
 *
 * Activations and outputs may be bf16 too (a bf16 model): the product is then the float32 product of the bf16 values,
 * rounded once to the output's dtype. Where the build has AVX512-BF16 (PK_BF16_DOT, cpu_common.h) a bf16 x times a bf16
 * weight takes panel_rows_dot (w16_panel.h), two k at a time in pair dot products, x never widened; elsewhere x's rows
 * are widened to float32 once per call and go through the float32 panel kernel. */
#include "w16_panel.h"

/* AMX tiles (Intel Xeons since Sapphire Rapids; a build with AMX-TILE and AMX-BF16): a bf16 x times a bf16 weight of
 * at least pk_w16_amx()'s rows in TDPBF16PS, which multiplies a tile of up to 16 rows by 32 k against 16 columns in
 * one instruction. The pair dot products (vdpbf16ps) are bound by their arithmetic from about 8 rows on such a Xeon
 * (2 cores of an Emerald Rapids VM: 130-145 GFLOP/s with the weight in cache, so a decode step's SmolLM2 weights at 16
 * rows took 34-49 ms against 13-14 ms at one row); the tiles multiply ~8x faster, so a decode step's products stay
 * bound by the weight's bytes at any batch. Each thread turns a panel into the tiles' layout once (its 32 columns as
 * pairs (W[c][k], W[c][k + 1]), two tiles of 16 columns: a permute per 16 columns and k pair, while the panel streams
 * in from memory), then runs every block of 16 rows over it from L1/L2. The sums are float32 (the tiles' own order of
 * additions within a pair of k, then k in order), rounded once to the output's dtype. */
#if PK_BF16_DOT == 1 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define PK_AMX 0
#endif

int pk_bf16_dot_path(void) { return PK_BF16_DOT; }

/* Rows from which a bf16 x bf16 product takes the tiles (set by pk_w16_amx; INT64_MAX: never). Below it the pair dot
 * products: turning each panel into the tiles' layout costs more than it saves for a few rows (a decode step's SmolLM2
 * weights streamed from memory on 2 cores of an Emerald Rapids VM, tiles against pair dot products, medians of 9
 * alternating rounds: 1.23x the time at 1 row, 1.07x at 3, 1.02x at 4, 0.93x at 5, 0.85-0.89x at 6-8, 0.78x at 10). */
static int64_t amx_min_rows = 5;
/* 1: the kernel may use AMX (the build has it and Linux granted this process the tile state); -1: it may not; 0: not
 * asked yet. Linux gives a process the tiles' 8 KB of state only on request (arch_prctl ARCH_REQ_XCOMP_PERM). */
static int amx_state = 0;

static int amx_usable(void) {
#if PK_AMX
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        const char *env = getenv("PAGEDKERNELS_CPU_AMX");
        const int off = env && (env[0] == '0' || env[0] == 'f' || env[0] == 'F');
        state = !off && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0
                    ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state > 0;
#else
    return 0;
#endif
}

/* Whether bf16 x bf16 products can take the AMX tiles here (the build has them, the kernel granted them, and
 * PAGEDKERNELS_CPU_AMX is not 0); with rows >= 0 first sets the rows from which they do (a huge value: never).
 * Returns 0 / 1, and the rows in *current. */
int pk_w16_amx(int64_t rows, int64_t *current) {
    if (rows >= 0) amx_min_rows = rows > 0 ? rows : 1;
    if (current) *current = amx_min_rows;
    return amx_usable();
}

#if PK_AMX
/* GCC's tile loads and stores (amxtileintrin.h) are asm statements that do not say they read or write memory, so
 * without this barrier the compiler may drop or sink the stores that fill a buffer before a tile load reads it (the
 * padded copy of a partial block of k came out NaN in a tile's third row), or read a buffer before a tile store fills
 * it. A compiler barrier only: no instruction. */
#define AMX_MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0, 1: the sums of columns 0-15 and 16-31 (mb rows of 16 floats); 2: x (mb rows of 32 bf16); 3, 4: 16 pairs of
 * k of the weight, columns 0-15 and 16-31 (16 rows of 16 pairs). */
static void amx_configure(int mb) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)(t < 3 ? mb : 16);
    }
    AMX_MEMORY_BARRIER();
    _tile_loadconfig(&cfg);
}

/* Panel rows k and k + 1 (32 bf16 each; r1 zero past K) as 32 pairs (W[c][k], W[c][k + 1]): 128 bytes, columns 0-15
 * in the first 64 (tile 3's row for this pair of k), 16-31 in the second (tile 4's). */
static inline void amx_pair_rows(const uint16_t *r0, const uint16_t *r1, uint16_t *dst) {
    const __m512i a = _mm512_loadu_si512((const void *)r0);
    const __m512i b = r1 ? _mm512_loadu_si512((const void *)r1) : _mm512_setzero_si512();
    static const uint16_t lo_index[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512((const void *)lo_index);   /* element 2c: r0[c], 2c + 1: r1[c] */
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    _mm512_storeu_si512((void *)dst, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_storeu_si512((void *)(dst + 32), _mm512_permutex2var_epi16(a, hi, b));
}

/* One panel (columns n0 .. n0 + nc - 1) of all M rows of bf16 x: the panel into `pairs` (kp16 * 16 pairs of k, zero
 * past K), then each block of 16 rows; `ahead`: the next panel, prefetched while this one is read. */
static void amx_panel(const uint16_t *x, int64_t x_s0, int64_t M, int64_t K, const uint16_t *panel_w, int64_t n0,
                      int nc, void *out, int64_t o_s0, int o_dt, const uint16_t *ahead, uint16_t *pairs,
                      int64_t kblocks, int *configured) {
    const int64_t kp_total = kblocks * 16;
    for (int64_t kp = 0; kp < kp_total; kp++) {
        const int64_t k = 2 * kp;
        uint16_t *dst = pairs + kp * 64;
        if (k >= K) {
            memset(dst, 0, 128);
            continue;
        }
        if (ahead) {
            __builtin_prefetch(ahead + k * NP, 0, 1);
            if (k + 1 < K) __builtin_prefetch(ahead + (k + 1) * NP, 0, 1);
        }
        amx_pair_rows(panel_w + k * NP, k + 1 < K ? panel_w + (k + 1) * NP : NULL, dst);
    }
    AMX_MEMORY_BARRIER();
    const int64_t k_full = K / 32; /* blocks of 32 k read straight from x; a last partial one from a padded copy */
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int mb = M - m0 < 16 ? (int)(M - m0) : 16;
        if (*configured != mb) {
            amx_configure(mb);
            *configured = mb;
        }
        _tile_zero(0);
        _tile_zero(1);
        const uint16_t *xm = x + m0 * x_s0;
        for (int64_t kb = 0; kb < kblocks; kb++) {
            if (kb < k_full) {
                _tile_loadd(2, xm + kb * 32, x_s0 * 2);
            } else {
                uint16_t tail[16 * 32];
                memset(tail, 0, sizeof tail);
                for (int i = 0; i < mb; i++) memcpy(tail + i * 32, xm + i * x_s0 + kb * 32, (size_t)(K - kb * 32) * 2);
                AMX_MEMORY_BARRIER();
                _tile_loadd(2, tail, 64);
                AMX_MEMORY_BARRIER();
            }
            _tile_loadd(3, pairs + kb * 16 * 64, 128);
            _tile_loadd(4, pairs + kb * 16 * 64 + 32, 128);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
        }
        float sums[2][16 * 16];
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        AMX_MEMORY_BARRIER();
        for (int i = 0; i < mb; i++) {
            float cols[NP];
            memcpy(cols, sums[0] + i * 16, 64);
            memcpy(cols + 16, sums[1] + i * 16, 64);
            store_cols(out, (m0 + i) * o_s0 + n0, o_dt, cols, nc);
        }
    }
}

static int amx_gemm(const uint16_t *x, int64_t x_s0, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                    void *out, int64_t o_s0, int o_dt, int threads) {
    const int64_t panels = (N + NP - 1) / NP, kblocks = (K + 31) / 32;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *pairs = (uint16_t *)aligned_alloc(64, (size_t)(kblocks * 16 * 128));
        int configured = 0;
        if (!pairs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < panels; t++) {
            if (!pairs) continue;
            const int64_t n0 = t * NP;
            const int nc = N - n0 < NP ? (int)(N - n0) : NP;
            const uint16_t *panel_w = packed + t * K * NP, *ahead = t + 1 < panels ? panel_w + K * NP : NULL;
            amx_panel(x, x_s0, M, K, panel_w, n0, nc, out, o_s0, o_dt, ahead, pairs, kblocks, &configured);
        }
        if (configured) _tile_release();
        free(pairs);
    }
    return failed ? -2 : 0;
}
#endif

/* x [M, K] (row stride x_s0, unit column stride; x_dt 0 = float32, 1 = float16, 2 = bfloat16), packed as above for N
 * columns (w_dt 1 = float16, 2 = bfloat16), out [M, N] (row stride o_s0, unit column stride; o_dt as x_dt). Returns 0,
 * -1 for an unsupported dtype, -2 out of memory. */
int pk_w16_gemm(const void *x, int64_t x_s0, int x_dt, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                int w_dt, void *out, int64_t o_s0, int o_dt, int num_threads) {
    if ((w_dt != 1 && w_dt != 2) || x_dt < 0 || x_dt > 2 || o_dt < 0 || o_dt > 2 || K < 0) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int64_t panels = (N + NP - 1) / NP;
    const int threads = N * K >= W16_PARALLEL_MIN ? num_threads : 1;
#if PK_AMX
    if (x_dt == 2 && w_dt == 2 && M >= amx_min_rows && K > 0 && amx_usable())
        return amx_gemm((const uint16_t *)x, x_s0, M, K, packed, N, out, o_s0, o_dt, threads);
#endif
#if PK_BF16_DOT
    if (x_dt == 2 && w_dt == 2) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t t = 0; t < panels; t++) {
            const int64_t n0 = t * NP;
            const int nc = N - n0 < NP ? (int)(N - n0) : NP;
            const uint16_t *panel_w = packed + t * K * NP, *ahead = t + 1 < panels ? panel_w + K * NP : NULL;
            panel_rows_dot((const uint16_t *)x, x_s0, NULL, M, K, panel_w, n0, nc, out, o_s0, o_dt, ahead);
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
        panel_rows(xf, xf_s0, NULL, M, K, panel_w, n0, nc, w_dt, out, o_s0, o_dt, ahead);
    }
    free(widened);
    return 0;
}
