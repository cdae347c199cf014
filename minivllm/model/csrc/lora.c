/* LoRA for many adapters in one step (punica's shrink and expand, segmented): the rows of a step come
 * grouped into segments, each a run of rows of one adapter, and each row gets
 *     out[row] += B (A x[row])          (the adapter's scaling folded into B by lora/adapter.py)
 * on top of the base layer's output, which is never touched otherwise. Rows of no adapter are in no
 * segment and keep their base output bit for bit.
 *
 * Layouts (float32, made once per adapter by lora/manager.py): AT = A^T [k][rank], BT = B^T [rank][n_pad],
 * rank padded with zeros to a multiple of LORA_LANES and n_pad to a multiple of LORA_CHUNK.
 *   shrink  t[j] = sum_k x[k] * AT[k][j], one fma per k in k order
 *   expand  d[i] = sum_j t[j] * BT[j][i], one fma per j in j order; out[i] = round(out[i] + d[i])
 * Vectors run across j (shrink) and across i (expand): every lane is its own output, so the sums have
 * the same roundings on every target and in the scalar build, and a row's result depends on its row
 * and its adapter alone, never on what else shares the call (batch invariance). The padding adds
 * exact zeros.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "simd.h"

#define LORA_LANES 16      /* rank padding: a multiple of every target's LANES */
#define LORA_CHUNK 64      /* expand: output columns per pass, kept in registers */
#define MAX_LORA_RANK 1536  /* a fused q/k/v's three ranks of at most 512 each, padded */
#define PARALLEL_ROWS 4    /* fewer rows than this run on the calling thread */

#if defined(SIMD)
static inline void shrink(const float *x, const float *at, int64_t k, int64_t rank, float *t) {
    for (int64_t j = 0; j < rank; j += LANES) vec_store(t + j, vec_zero());
    for (int64_t kk = 0; kk < k; kk++) {
        const vec xk = vec_set1(x[kk]);
        const float *row = at + kk * rank;
        for (int64_t j = 0; j < rank; j += LANES) vec_store(t + j, vec_fmadd(xk, vec_load(row + j), vec_load(t + j)));
    }
}

static inline void expand_chunk(const float *t, const float *bt, int64_t rank, int64_t n_pad, int64_t i0,
                                float *d) {
    vec acc[LORA_CHUNK / LANES];
    for (int v = 0; v < LORA_CHUNK / LANES; v++) acc[v] = vec_zero();
    for (int64_t j = 0; j < rank; j++) {
        const vec tj = vec_set1(t[j]);
        const float *row = bt + j * n_pad + i0;
        for (int v = 0; v < LORA_CHUNK / LANES; v++) acc[v] = vec_fmadd(tj, vec_load(row + v * LANES), acc[v]);
    }
    for (int v = 0; v < LORA_CHUNK / LANES; v++) vec_store(d + v * LANES, acc[v]);
}
#else
static inline void shrink(const float *x, const float *at, int64_t k, int64_t rank, float *t) {
    for (int64_t j = 0; j < rank; j++) t[j] = 0.f;
    for (int64_t kk = 0; kk < k; kk++)
        for (int64_t j = 0; j < rank; j++) t[j] = fmaf(x[kk], at[kk * rank + j], t[j]);
}

static inline void expand_chunk(const float *t, const float *bt, int64_t rank, int64_t n_pad, int64_t i0,
                                float *d) {
    for (int i = 0; i < LORA_CHUNK; i++) d[i] = 0.f;
    for (int64_t j = 0; j < rank; j++)
        for (int i = 0; i < LORA_CHUNK; i++) d[i] = fmaf(t[j], bt[j * n_pad + i0 + i], d[i]);
}
#endif

/* x [rows][k] (x_stride apart), out [rows][n] (out_stride apart). Segment s covers rows
 * starts[s] .. + lens[s]; weights[3 s .. 3 s + 2] are its adapter's AT and BT for this layer (0: the
 * adapter leaves this layer alone) and their padded rank. */
#define DEFINE_LORA(S, T, LOAD, STORE)                                                                     \
void lora_##S(const T *x, int64_t x_stride, T *out, int64_t out_stride, int64_t k, int64_t n, int64_t n_pad, \
              int64_t num_segments, const int64_t *starts, const int64_t *lens, const int64_t *weights) {    \
    int64_t total = 0;                                                                                     \
    for (int64_t s = 0; s < num_segments; s++) total += lens[s];                                           \
    _Pragma("omp parallel for schedule(static) if(total >= PARALLEL_ROWS)")                                \
    for (int64_t r = 0; r < total; r++) {                                                                  \
        int64_t s = 0, before = 0;                                                                         \
        while (r - before >= lens[s]) before += lens[s++];                                                 \
        const float *at = (const float *)(intptr_t)weights[3 * s];                                         \
        const float *bt = (const float *)(intptr_t)weights[3 * s + 1];                                     \
        const int64_t row = starts[s] + r - before, rank = weights[3 * s + 2];                             \
        if (at == 0 || bt == 0 || rank > MAX_LORA_RANK) continue;                                          \
        float xf[k], t[MAX_LORA_RANK], d[LORA_CHUNK];                                                      \
        const T *xr = x + row * x_stride;                                                                  \
        for (int64_t kk = 0; kk < k; kk++) xf[kk] = LOAD(xr[kk]);                                          \
        shrink(xf, at, k, rank, t);                                                                        \
        T *o = out + row * out_stride;                                                                     \
        for (int64_t i0 = 0; i0 < n; i0 += LORA_CHUNK) {                                                   \
            expand_chunk(t, bt, rank, n_pad, i0, d);                                                       \
            const int64_t m = n - i0 < LORA_CHUNK ? n - i0 : LORA_CHUNK;                                   \
            for (int64_t i = 0; i < m; i++) o[i0 + i] = STORE(LOAD(o[i0 + i]) + d[i]);                     \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_LORA(bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_LORA(f32, float, f32_load, f32_store)
