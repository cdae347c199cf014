/* LoRA for many adapters in one step (punica's shrink and expand, segmented): the rows of a step come
 * grouped into segments, each a run of rows of one adapter, and each row gets
 *     out[row] += B (A x[row])          (the adapter's scaling folded into B by lora/adapter.py)
 * on top of the base layer's output, which is never touched otherwise. Rows of no adapter are in no
 * segment and keep their base output bit for bit.
 *
 * Layouts (in the model's dtype, made once per adapter by lora/manager.py; sums in float32): AT = A^T
 * [k][rank], BT = B^T [rank][n_pad],
 * rank padded with zeros to a multiple of LORA_LANES and n_pad to a multiple of LORA_CHUNK; a fused
 * layer's projections sit side by side in AT and block-diagonally in BT, and `bands` says per chunk of
 * LORA_CHUNK output columns which rows of BT [lo, hi) are not zero there.
 *   shrink  t[j] = sum_k x[k] * AT[k][j], one fma per k in k order
 *   expand  d[i] = sum_j t[j] * BT[j][i], one fma per j of its band in j order; out[i] = round(out[i] + d[i])
 * Vectors run across j (shrink) and across i (expand): every lane is its own output, so the sums have
 * the same roundings on every target and in the scalar build. Rows of one segment go through in tiles
 * of up to LORA_TILE, each weight vector loaded once for the tile, each row with its own sums in the
 * same order as alone: a row's result depends on its row and its adapter only, never on what else
 * shares the call (batch invariance).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "lora.h"
#include "simd.h"

/* shrink: t[i][j] = sum_k x[i][k] AT[k][j]; expand_chunk: d[i][c] = sum_{j in [lo, hi)} t[i][j] BT[j][i0 + c].
 * The weights are in the model's dtype (W), read as float32 vectors (WVEC) or scalars (WLOAD). */
#if defined(SIMD)
/* Both products are one strip product: for rows i < m and the LORA_LANES lanes of a strip of w,
 *   out[i][c] = sum_{p in [from, to)} a[i][p] w[p][c], one fma per p in p order,
 * with each row's STRIP vectors of sums in registers for the whole loop (strip_rows_ is inlined with m
 * a constant, the switch of strip_): a lane gets the same fmas in the same order as a sum kept in memory.
 * shrink: a = x, w = AT's strip j, p over k; expand: a = t, w = BT's columns i0 + c0, p over the band. */
#define STRIP (LORA_LANES / LANES)
_Static_assert(LORA_TILE == 4, "strip_ switches over the row counts 1 .. LORA_TILE");
#define DEFINE_PRODUCTS(S, W, WVEC, WLOAD)                                                                 \
static inline __attribute__((always_inline)) void strip_rows_##S(const float *a, int64_t a_stride, const int m, \
        const W *w, int64_t w_stride, int64_t from, int64_t to, float *out, int64_t out_stride) {           \
    vec acc[LORA_TILE][STRIP];                                                                             \
    for (int i = 0; i < m; i++)                                                                            \
        for (int v = 0; v < STRIP; v++) acc[i][v] = vec_zero();                                            \
    for (int64_t p = from; p < to; p++) {                                                                  \
        const W *row = w + p * w_stride;                                                                   \
        for (int v = 0; v < STRIP; v++) {                                                                  \
            const vec wv = WVEC(row + v * LANES);                                                          \
            for (int i = 0; i < m; i++) acc[i][v] = vec_fmadd(vec_set1(a[i * a_stride + p]), wv, acc[i][v]); \
        }                                                                                                  \
    }                                                                                                      \
    for (int i = 0; i < m; i++)                                                                            \
        for (int v = 0; v < STRIP; v++) vec_store(out + i * out_stride + v * LANES, acc[i][v]);            \
}                                                                                                          \
static inline void strip_##S(const float *a, int64_t a_stride, int64_t m, const W *w, int64_t w_stride,    \
                             int64_t from, int64_t to, float *out, int64_t out_stride) {                   \
    switch (m) {                                                                                           \
    case 1: strip_rows_##S(a, a_stride, 1, w, w_stride, from, to, out, out_stride); break;                 \
    case 2: strip_rows_##S(a, a_stride, 2, w, w_stride, from, to, out, out_stride); break;                 \
    case 3: strip_rows_##S(a, a_stride, 3, w, w_stride, from, to, out, out_stride); break;                 \
    default: strip_rows_##S(a, a_stride, 4, w, w_stride, from, to, out, out_stride);                       \
    }                                                                                                      \
}                                                                                                          \
static inline void shrink_##S(const float *x, int64_t m, int64_t k, const W *at, int64_t rank, float *t) {  \
    for (int64_t j = 0; j < rank; j += LORA_LANES) strip_##S(x, k, m, at + j, rank, 0, k, t + j, rank);     \
}                                                                                                          \
static inline void expand_chunk_##S(const float *t, int64_t m, int64_t rank, const W *bt, int64_t n_pad,     \
                                    int64_t i0, int64_t lo, int64_t hi, float *d) {                        \
    for (int c0 = 0; c0 < LORA_CHUNK; c0 += LORA_LANES)                                                    \
        strip_##S(t, rank, m, bt + i0 + c0, n_pad, lo, hi, d + c0, LORA_CHUNK);                            \
}
#else
#define DEFINE_PRODUCTS(S, W, WVEC, WLOAD)                                                                 \
static inline void shrink_##S(const float *x, int64_t m, int64_t k, const W *at, int64_t rank, float *t) {  \
    for (int64_t i = 0; i < m * rank; i++) t[i] = 0.f;                                                     \
    for (int64_t kk = 0; kk < k; kk++)                                                                     \
        for (int64_t i = 0; i < m; i++)                                                                    \
            for (int64_t j = 0; j < rank; j++)                                                             \
                t[i * rank + j] = fmaf(x[i * k + kk], WLOAD(at[kk * rank + j]), t[i * rank + j]);          \
}                                                                                                          \
static inline void expand_chunk_##S(const float *t, int64_t m, int64_t rank, const W *bt, int64_t n_pad,     \
                                    int64_t i0, int64_t lo, int64_t hi, float *d) {                        \
    for (int64_t i = 0; i < m * LORA_CHUNK; i++) d[i] = 0.f;                                               \
    for (int64_t j = lo; j < hi; j++)                                                                      \
        for (int64_t i = 0; i < m; i++)                                                                    \
            for (int c = 0; c < LORA_CHUNK; c++)                                                           \
                d[i * LORA_CHUNK + c] = fmaf(t[i * rank + j], WLOAD(bt[j * n_pad + i0 + c]), d[i * LORA_CHUNK + c]); \
}
#endif

#if defined(SIMD)
static inline vec vec_load_f32(const float *p) { return vec_load(p); }
DEFINE_PRODUCTS(bf16, uint16_t, vec_from_bf16, bf16_to_float)
DEFINE_PRODUCTS(f32, float, vec_load_f32, f32_load)
#else
DEFINE_PRODUCTS(bf16, uint16_t, , bf16_to_float)
DEFINE_PRODUCTS(f32, float, , f32_load)
#endif

/* x [rows][k] (x_stride apart), out [rows][n] (out_stride apart). Segment s covers rows
 * starts[s] .. + lens[s]; weights[4 s .. 4 s + 3] are its adapter's AT, BT and bands (int64 [chunks][2])
 * for this layer and their padded rank (0: the adapter leaves this layer alone). */
#define DEFINE_LORA(S, T, LOAD, STORE)                                                                     \
void lora_##S(const T *x, int64_t x_stride, T *out, int64_t out_stride, int64_t k, int64_t n, int64_t n_pad, \
              int64_t num_segments, const int64_t *starts, const int64_t *lens, const int64_t *weights) {    \
    int64_t tiles = 0;                                                                                     \
    for (int64_t s = 0; s < num_segments; s++) tiles += (lens[s] + LORA_TILE - 1) / LORA_TILE;             \
    _Pragma("omp parallel for schedule(static) if(tiles > 1)")                                             \
    for (int64_t tile = 0; tile < tiles; tile++) {                                                         \
        int64_t s = 0, before = 0;  /* the tile's segment, and the tiles of the segments before it */     \
        while (tile - before >= (lens[s] + LORA_TILE - 1) / LORA_TILE) before += (lens[s++] + LORA_TILE - 1) / LORA_TILE; \
        const T *at = (const T *)(intptr_t)weights[4 * s];                                                 \
        const T *bt = (const T *)(intptr_t)weights[4 * s + 1];                                             \
        const int64_t *bands = (const int64_t *)(intptr_t)weights[4 * s + 2];                              \
        const int64_t rank = weights[4 * s + 3];                                                           \
        if (at == 0 || rank <= 0 || rank > MAX_LORA_RANK) continue;                                        \
        const int64_t first = starts[s] + (tile - before) * LORA_TILE;                                     \
        const int64_t left = starts[s] + lens[s] - first, m = left < LORA_TILE ? left : LORA_TILE;          \
        float xf[LORA_TILE * k], t[LORA_TILE * rank], d[LORA_TILE * LORA_CHUNK];                           \
        for (int64_t i = 0; i < m; i++)                                                                    \
            for (int64_t kk = 0; kk < k; kk++) xf[i * k + kk] = LOAD(x[(first + i) * x_stride + kk]);      \
        shrink_##S(xf, m, k, at, rank, t);                                                                        \
        for (int64_t i0 = 0, c = 0; i0 < n; i0 += LORA_CHUNK, c++) {                                       \
            expand_chunk_##S(t, m, rank, bt, n_pad, i0, bands[2 * c], bands[2 * c + 1], d);                \
            const int64_t cols = n - i0 < LORA_CHUNK ? n - i0 : LORA_CHUNK;                                \
            for (int64_t i = 0; i < m; i++) {                                                              \
                T *o = out + (first + i) * out_stride + i0;                                                \
                for (int64_t c2 = 0; c2 < cols; c2++) o[c2] = STORE(LOAD(o[c2]) + d[i * LORA_CHUNK + c2]); \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_LORA(bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_LORA(f32, float, f32_load, f32_store)
