/* The model's linear layers on the CPU, out = x @ W^T (+ bias), for any number of rows, batch-invariant.
 *
 * One kernel serves 1 row (a decode step of one sequence) and 2,048 rows (a prefill chunk), and every
 * output element is summed in the same order whatever the row count, the tile it falls in or the thread
 * that computes it: acc = 0; for each k (bf16: each pair of k) in order, acc += x[m][k] * W[n][k] in
 * float32; then one rounding to the output dtype (bias added in float32 first). Nothing is split along K.
 * So a token's activations are the same bits whether it is computed alone, in a crowd, in a prefill or in
 * a decode (issue 12), which oneDNN (blocking chosen by row count) and a few-row kernel beside a many-row
 * one cannot promise.
 *
 * It vectorizes over output columns: the weights are packed once (pack_*) into panels of PANEL columns,
 * each panel contiguous over K, so a column vector's k-th weights are one 64-byte load; a row's x[k] is
 * broadcast. bf16 computes what AVX512-BF16's vdpbf16ps computes (16 lanes x one k pair per
 * instruction), with that instruction or with float32 FMAs (below); float32 uses FMAs. A tile is up to
 * MAX_ROWS rows x PANEL columns, held in registers for the whole K loop. Written once over simd.h's
 * vectors: the targets differ in the vector width, MAX_ROWS, and AVX-512's vdpbf16ps for 1 or 2 rows.
 *
 * Threads split the column panels, each taking its panels for every row block; no split changes any sum.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "simd.h"

#if defined(SIMD)

#define PANEL 32      /* output columns per panel: 2 vectors of 16 lanes (AVX-512), 4 of 8 (AVX2), 8 of 4 (NEON) */
#define PV (PANEL / LANES)
#if defined(SIMD_AVX512)
#define MAX_ROWS 12   /* rows per tile: 24 accumulators + 2 weight vectors of the 32 zmm registers */
#else
#define MAX_ROWS 3    /* AVX2: 12 accumulators + 4 weight vectors of the 16 ymm; NEON: 24 + 8 of 32 q registers */
#endif
#define ROW_BLOCK 96  /* rows of x a thread works through per panel, while the panel sits in L2 */
#define PREFETCH 1024 /* bytes ahead in the panel's weight stream: DRAM latency at a few rows */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Store one tile row's accumulators (columns n0..n0+32, of which `valid` exist) with the bias (padded
 * to whole panels). */
#define STORE_ROW(OUT_T, STORE_N)                                                                     \
    static inline void store_row_##OUT_T(OUT_T *dst, const vec *acc, const float *bias, int valid) {  \
        for (int v = 0; v < PV && valid > LANES * v; v++)                                             \
            STORE_N(dst + LANES * v, bias ? vec_add(acc[v], vec_load(bias + LANES * v)) : acc[v], valid - LANES * v); \
    }

STORE_ROW(uint16_t, vec_store_bf16_n)
STORE_ROW(float, vec_store_n)

/* The packed bf16 panel: for each pair of k, 32 columns x 2 k = 32 uint32 (64 bytes per vector of 16).
 *
 * Two tiles compute the same bits. vdpbf16ps adds the odd k's product, then the even k's, each exact
 * product rounded once into the float32 sum (to nearest even, input denormals read as 0, output
 * denormals flushed): what an FMA on the two bf16 values widened to float32 does with MXCSR's DAZ and
 * FTZ set. On CPUs without AMX vdpbf16ps issues half an instruction a cycle (16 MACs) where FMAs issue
 * two (32 MACs), so calls of 3 rows or more widen x once and run FMAs (up to 1.6x faster); calls of 1 or
 * 2 rows, bound by the weight stream and by one chain's latency, keep the one-instruction vdpbf16ps.
 * Targets without vdpbf16ps run the FMAs for every row count: the same bits. */
#if defined(SIMD_AVX512)
static inline __attribute__((always_inline)) void tile_bf16_dp(
        const uint16_t *x, int64_t ldx, const uint32_t *panel, int64_t pairs, int rows,
        const float *bias, uint16_t *out, int64_t ldo, int valid) {
    __m512 acc[MAX_ROWS][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *w = panel + p * PANEL;
        _mm_prefetch((const char *)w + PREFETCH, _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 16);
        for (int m = 0; m < rows; m++) {
            uint32_t pair;
            __builtin_memcpy(&pair, x + m * ldx + 2 * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
        }
    }
    for (int m = 0; m < rows; m++) store_row_uint16_t(out + m * ldo, acc[m], bias, valid);
}
#endif

static inline __attribute__((always_inline)) void tile_bf16_fma(
        const float *x, int64_t ldx, const uint32_t *panel, int64_t pairs, int rows,
        const float *bias, uint16_t *out, int64_t ldo, int valid) {
    vec acc[MAX_ROWS][PV];
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < PV; v++) acc[m][v] = vec_zero();
    const unsigned csr = denormals_off();
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *w = panel + p * PANEL;
        if (rows <= 8) __builtin_prefetch((const char *)w + PREFETCH, 0, 3);
        vec odd[PV], even[PV];
        for (int v = 0; v < PV; v++) {
            const ivec wv = ivec_load(w + LANES * v);
            odd[v] = vec_bits(ivec_and32(wv, 0xFFFF0000u));
            even[v] = vec_bits(ivec_shl32(wv, 16));
        }
        for (int m = 0; m < rows; m++) {  /* per accumulator: the odd k's product, then the even k's */
            const vec x_odd = vec_set1(x[m * ldx + 2 * p + 1]), x_even = vec_set1(x[m * ldx + 2 * p]);
            for (int v = 0; v < PV; v++) acc[m][v] = vec_fmadd(x_odd, odd[v], acc[m][v]);
            for (int v = 0; v < PV; v++) acc[m][v] = vec_fmadd(x_even, even[v], acc[m][v]);
        }
    }
    denormals_restore(csr);
    for (int m = 0; m < rows; m++) store_row_uint16_t(out + m * ldo, acc[m], bias, valid);
}

static inline __attribute__((always_inline)) void tile_f32(
        const float *x, int64_t ldx, const float *panel, int64_t K, int rows,
        const float *bias, float *out, int64_t ldo, int valid) {
    vec acc[MAX_ROWS][PV];
    for (int m = 0; m < rows; m++)
        for (int v = 0; v < PV; v++) acc[m][v] = vec_zero();
    for (int64_t k = 0; k < K; k++) {
        const float *w = panel + k * PANEL;
        if (rows <= 8) __builtin_prefetch((const char *)w + PREFETCH, 0, 3);
        vec wv[PV];
        for (int v = 0; v < PV; v++) wv[v] = vec_load(w + LANES * v);
        for (int m = 0; m < rows; m++) {
            const vec xv = vec_set1(x[m * ldx + k]);
            for (int v = 0; v < PV; v++) acc[m][v] = vec_fmadd(xv, wv[v], acc[m][v]);
        }
    }
    for (int m = 0; m < rows; m++) store_row_float(out + m * ldo, acc[m], bias, valid);
}

/* Dispatch a tile of `rows` (1..MAX_ROWS) to a copy of the tile function with that literal row count,
 * so that its accumulators live in registers (counts past MAX_ROWS never occur: clamped to compile). */
#define CLAMP(R) ((R) < MAX_ROWS ? (R) : MAX_ROWS)
#define DISPATCH(TILE, rows, ...)                                                                     \
    switch (rows) {                                                                                   \
        case 1: TILE(__VA_ARGS__, 1); break;   case 2: TILE(__VA_ARGS__, CLAMP(2)); break;           \
        case 3: TILE(__VA_ARGS__, CLAMP(3)); break;   case 4: TILE(__VA_ARGS__, CLAMP(4)); break;    \
        case 5: TILE(__VA_ARGS__, CLAMP(5)); break;   case 6: TILE(__VA_ARGS__, CLAMP(6)); break;    \
        case 7: TILE(__VA_ARGS__, CLAMP(7)); break;   case 8: TILE(__VA_ARGS__, CLAMP(8)); break;    \
        case 9: TILE(__VA_ARGS__, CLAMP(9)); break;   case 10: TILE(__VA_ARGS__, CLAMP(10)); break;  \
        case 11: TILE(__VA_ARGS__, CLAMP(11)); break; default: TILE(__VA_ARGS__, CLAMP(12)); break;  \
    }
/* The loop over (panel, row block) tasks, shared by both dtypes. PROLOGUE runs first in every thread (an
 * `omp for` that prepares x); TILE_CALL(m0, rows, n0) computes one tile. */
#define GEMM_LOOP(M, N, PROLOGUE, TILE_CALL)                                                          \
    /* Split even a one-row call across threads unless the weights are tiny (under 128 KiB): a decode  \
     * step is bound by the weight stream, which needs every core. */                                  \
    const int64_t panels = (N + PANEL - 1) / PANEL, row_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;    \
    _Pragma("omp parallel if(panels * K >= 2048)")                                                    \
    {                                                                                                 \
        PROLOGUE;                                                                                     \
        /* Panels outer: each thread takes a run of column panels for every row block, so the      \
         * threads share any row count evenly (see quant_gemm.c). */                                  \
        _Pragma("omp for collapse(2) schedule(static)")                                               \
        for (int64_t pn = 0; pn < panels; pn++)                                                       \
            for (int64_t rb = 0; rb < row_blocks; rb++) {                                             \
                const int64_t n0 = pn * PANEL, m_end = min64(M, (rb + 1) * ROW_BLOCK);                 \
                for (int64_t m0 = rb * ROW_BLOCK; m0 < m_end; m0 += MAX_ROWS) {                       \
                    const int rows = (int)min64(MAX_ROWS, m_end - m0);                                \
                    TILE_CALL(m0, rows, n0);                                                          \
                }                                                                                     \
            }                                                                                         \
    }

#define BF16_FMA_TILE(m0, n0, R)                                                                      \
    tile_bf16_fma(xf + (m0) * K, K, w + (n0) * (K / 2), K / 2, R, bias ? bias + (n0) : 0,            \
                  out + (m0) * ldo + (n0), ldo, (int)min64(PANEL, N - (n0)))
#define BF16_FMA_CALL(m0, rows, n0) DISPATCH(BF16_FMA_TILE, rows, m0, n0)
#if defined(SIMD_AVX512)
#define BF16_DP_TILE(m0, n0, R)                                                                       \
    tile_bf16_dp(x + (m0) * ldx, ldx, w + (n0) * (K / 2), K / 2, R, bias ? bias + (n0) : 0,          \
                 out + (m0) * ldo + (n0), ldo, (int)min64(PANEL, N - (n0)))
#define BF16_DP_CALL(m0, rows, n0)                                                                    \
    if (rows == 1) BF16_DP_TILE(m0, n0, 1); else BF16_DP_TILE(m0, n0, 2);
#endif

/* x [M, K] bf16 (row stride ldx) -> xf [M, K] float32, split over the threads. */
static void widen_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, float *xf) {
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf16_to_float(x[m * ldx + k]);
}

/* x [M, K] (row stride ldx), packed weights from pack_bf16, bias float32 [>= padded N] or NULL,
 * out [M, N] (row stride ldo). K must be even. */
void gemm_bf16(const uint16_t *x, int64_t ldx, const uint32_t *w, const float *bias, uint16_t *out, int64_t ldo,
               int64_t M, int64_t N, int64_t K) {
#if defined(SIMD_AVX512)
    if (M <= 2) {
        GEMM_LOOP(M, N, (void)0, BF16_DP_CALL)
        return;
    }
#endif
    float *xf = malloc(sizeof(float) * (size_t)(M * K));
    GEMM_LOOP(M, N, widen_rows(x, ldx, M, K, xf), BF16_FMA_CALL)
    free(xf);
}

#define F32_TILE(m0, n0, R)                                                                           \
    tile_f32(x + (m0) * ldx, ldx, w + (n0) * K, K, R, bias ? bias + (n0) : 0,                        \
             out + (m0) * ldo + (n0), ldo, (int)min64(PANEL, N - (n0)))
#define F32_CALL(m0, rows, n0) DISPATCH(F32_TILE, rows, m0, n0)

void gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *out, int64_t ldo,
              int64_t M, int64_t N, int64_t K) {
    GEMM_LOOP(M, N, (void)0, F32_CALL)
}

/* W [N, K] of 32-bit words -> panels [ceil(N / PANEL)][K][PANEL]; the columns past N are zero. float32
 * weights are packed as they are; bf16 ones as [N, K / 2] words, each a pair (W[n][2p], W[n][2p + 1]) in
 * the order vdpbf16ps takes it. */
void pack_panels(const uint32_t *w, uint32_t *packed, int64_t N, int64_t K) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for
    for (int64_t pn = 0; pn < panels; pn++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t n = pn * PANEL + c;
                packed[(pn * K + k) * PANEL + c] = n < N ? w[n * K + k] : 0;
            }
}
#endif
