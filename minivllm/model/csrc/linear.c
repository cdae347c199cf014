/* y = x W^T for a few rows of x, in bfloat16 on the CPU: the decode-time GEMM of small batches.
 *
 * With a handful of rows a linear layer is a pass over its weights, and its speed is how fast that
 * pass streams them. oneDNN's bf16 GEMM reads them at about a third of this machine's bandwidth at
 * one row; this kernel gets close to the bandwidth: each thread walks its own contiguous range of
 * weight rows, prefetches a few rows ahead, and uses each weight vector for every row of x (up to
 * four at a time) with AVX512-BF16 dot products (bf16 pairs multiplied, summed in float32).
 * Built only where the compiler targets AVX512-BF16; kernels.py falls back to torch elsewhere.
 */
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define WEIGHT_ROWS 2  /* weight rows per tile, each used by up to 4 x rows: 2 beats 4 and 8 by 2-15 % */
#define PREFETCH_ROWS 8  /* how far ahead the next weight rows are requested, into L2: 1.3x over none */

/* Rows m0..m0+x_rows of the output, columns n0..n0+WEIGHT_ROWS. x_rows is a literal at each call. */
static inline __attribute__((always_inline)) void linear_tile(
        const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t m0, int x_rows, int64_t n0, int64_t N, int64_t K) {
    const uint16_t *rows[WEIGHT_ROWS];
    for (int r = 0; r < WEIGHT_ROWS; r++) rows[r] = w + (n0 + r < N ? n0 + r : N - 1) * K;  /* tail: repeat */
    const uint16_t *ahead = w + (n0 + PREFETCH_ROWS < N ? n0 + PREFETCH_ROWS : N - 1) * K;
    __m512 acc[4][WEIGHT_ROWS];
    for (int m = 0; m < x_rows; m++)
        for (int r = 0; r < WEIGHT_ROWS; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        if (m0 == 0)  /* later x rows find the weights in L1 */
            for (int r = 0; r < WEIGHT_ROWS; r++) _mm_prefetch((const char *)(ahead + r * K + k), _MM_HINT_T1);
        __m512bh wv[WEIGHT_ROWS];
        for (int r = 0; r < WEIGHT_ROWS; r++) wv[r] = (__m512bh)_mm512_loadu_si512(rows[r] + k);
        for (int m = 0; m < x_rows; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + m) * K + k);
            for (int r = 0; r < WEIGHT_ROWS; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    for (int m = 0; m < x_rows; m++)
        for (int r = 0; r < WEIGHT_ROWS && n0 + r < N; r++)
            out[(m0 + m) * N + n0 + r] = float_to_bf16(_mm512_reduce_add_ps(acc[m][r]));
}

/* x [M, K], w [N, K], out [M, N], all bf16 and contiguous; K a multiple of 32 (kernels.py checks). */
void linear_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t M, int64_t N, int64_t K) {
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += WEIGHT_ROWS)
        for (int64_t m0 = 0; m0 < M; m0 += 4)
            switch (M - m0 < 4 ? M - m0 : 4) {
                case 1: linear_tile(x, w, out, m0, 1, n0, N, K); break;
                case 2: linear_tile(x, w, out, m0, 2, n0, N, K); break;
                case 3: linear_tile(x, w, out, m0, 3, n0, N, K); break;
                default: linear_tile(x, w, out, m0, 4, n0, N, K); break;
            }
}
#endif
