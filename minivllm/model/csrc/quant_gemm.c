/* Linear layers on quantized weights, out = x @ W^T (+ bias), for any number of rows, batch-invariant.
 *
 * The weights stay quantized: every format (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, our int8/int4) is
 * repacked at load (quant.py) into one of four layouts, unsigned integers u with a float16 scale d and
 * offset m per group of 32 (or 16) k, w = d * u + m:
 *   bits 4 or 8   u in 0..15 (two per byte) or 0..255
 *   sub 1 or 2    one (d, m) pair per 32 k, or one per 16 k (Q6_K's sub-blocks)
 * The activations are quantized too, per row and per 32 k, the way llama.cpp does for its VNNI dot
 * products: dx = amax / 127, x8 = round(x / dx). Then each 32-k block is one integer dot product
 * (AVX512-VNNI vpdpbusd: unsigned weight bytes x signed activation bytes, 64 products per
 * instruction), and
 *     out[n] = sum over blocks, in k order: (d * dx) * isum + m * (dx * sum of x8)
 * in float32. A row's quantization and sums depend on that row alone, and the integer sums are exact,
 * so a row's result is the same bits whether the call has 1 row or 2,048 (issue 12), and a token is
 * quantized the same way in a prefill, a chunk or a decode. Twice the multiplies per instruction of
 * bf16 (vdpbf16ps) and a quarter of its weight bytes: both the decode (memory) and the prefill (compute)
 * gain.
 *
 * Packed layout, per panel of 16 output columns, per 32-k block, BLOCK_BYTES(bits, sub) bytes:
 *   weights: 8 groups of 4 k; group g is 64 bytes, column c's 4 bytes at c * 4 (what vpdpbusd takes).
 *            bits 4: 256 bytes; byte t * 64 + c * 4 + j holds group t (low nibble) and t + 4 (high).
 *   scales:  per sub-block, 16 float16 d then 16 float16 m (64 bytes).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* The packed layout's sizes: a block's integers (16 columns x 32 k), then its scales (64 bytes per sub). */
static inline int weight_bytes(int bits) { return 16 * 32 * bits / 8; }
static inline int block_bytes(int bits, int sub) { return weight_bytes(bits) + sub * 64; }

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define QPANEL 16     /* output columns per panel: one vector of 16 int32 / float32 */
#define QMAX_ROWS 8   /* rows per one-panel tile: 8 accumulators + 8 weight vectors + scales fit the registers */
#define QPAIR_ROWS 6  /* rows per two-panel tile: 12 accumulators + 12 integer sums + 4 weight vectors */
#define QROW_BLOCK 64 /* rows of x a thread works through per panel, while the panel sits in L1/L2 */

static inline int64_t qmin64(int64_t a, int64_t b) { return a < b ? a : b; }


/* One row's activations per 32-k block: dx, then dx * (sum of x8) over the whole block and over each
 * half (for sub 2). */
#define META 4

/* 16 activations as float32 vectors, from either dtype. */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* x [M, K] (float32 or bf16, row stride ldx) -> x8 [M, K] int8 and meta [M, K / 32, META]. Vectorized:
 * a scalar loop cost as much as a quarter of a 64-row GEMM. The max and the integer sums are exact, and
 * the vector rounding is lrintf's (to nearest even), so the bits are those of the scalar definition. */
#define QUANTIZE_ROWS(S, T)                                                                        \
static void quantize_rows_##S(const T *x, int64_t ldx, int64_t M, int64_t K, int8_t *x8, float *meta) { \
    _Pragma("omp for schedule(static)")                                                            \
    for (int64_t r = 0; r < M; r++)                                                                \
        for (int64_t b = 0; b < K / 32; b++) {                                                     \
            const __m512 lo = load16_##S(x + r * ldx + b * 32), hi = load16_##S(x + r * ldx + b * 32 + 16); \
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))); \
            const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;                 \
            const __m512 vinv = _mm512_set1_ps(inv);                                               \
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));                       \
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));                       \
            int8_t *q = x8 + r * K + b * 32;                                                       \
            _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qlo));                             \
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qhi));                      \
            const int sum_lo = _mm512_reduce_add_epi32(qlo), sum_hi = _mm512_reduce_add_epi32(qhi); \
            float *m = meta + (r * (K / 32) + b) * META;                                           \
            m[0] = dx;                                                                             \
            m[1] = dx * (float)(sum_lo + sum_hi);                                                  \
            m[2] = dx * (float)sum_lo;                                                             \
            m[3] = dx * (float)sum_hi;                                                             \
        }                                                                                          \
}

QUANTIZE_ROWS(f32, float)
QUANTIZE_ROWS(bf16, uint16_t)

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The integer dot product of one row's 32 (or 16: groups g0 .. g0 + 3) activations with a panel block. */
static inline __attribute__((always_inline)) __m512i dot_groups(const __m512i *w, const int8_t *xq, int g0, int n) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  /* two chains: latency */
    for (int g = g0; g < g0 + n; g += 2) {
        even = _mm512_dpbusd_epi32(even, w[g], bcast4(xq + 4 * g));
        odd = _mm512_dpbusd_epi32(odd, w[g + 1], bcast4(xq + 4 * (g + 1)));
    }
    return _mm512_add_epi32(even, odd);  /* integer: exact in any order */
}

/* acc[r * np + p] (16 columns each) for `rows` rows over all K / 32 blocks of np (1 or 2) panels `panel_bytes`
 * apart, with one (d, m) per 32 k (sub 1). Two panels share each activation broadcast and scale load, and
 * the dpbusd chains run group-major over rows and panels: rows * np independent chains. A row's sum for a
 * column is the same integers and the same two float steps per block whatever the tile, so its bits do
 * not depend on np or on the rows beside it. */
static inline __attribute__((always_inline)) void qtile_sub1(
        const int8_t *x8, const float *meta, int64_t K, const uint8_t *panel, int64_t panel_bytes, int np,
        int bits, int rows, __m512 *acc) {
    const int64_t blocks = K / 32, stride = block_bytes(bits, 1);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < rows * np; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i isum[2 * QMAX_ROWS];
        for (int i = 0; i < rows * np; i++) isum[i] = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            __m512i lo[2], hi[2];  /* groups t and t + 4 of each panel */
            for (int p = 0; p < np; p++) {
                const uint8_t *blk = panel + p * panel_bytes + b * stride;
                if (t == 0 && rows <= 2) _mm_prefetch((const char *)blk + 8 * stride, _MM_HINT_T0);
                if (bits == 8) {
                    lo[p] = _mm512_loadu_si512(blk + 64 * t);
                    hi[p] = _mm512_loadu_si512(blk + 64 * (t + 4));
                } else {
                    const __m512i v = _mm512_loadu_si512(blk + 64 * t);
                    lo[p] = _mm512_and_si512(v, low);
                    hi[p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
            }
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = x8 + r * K + b * 32;
                const __m512i xl = bcast4(xq + 4 * t), xh = bcast4(xq + 4 * (t + 4));
                for (int p = 0; p < np; p++) isum[r * np + p] = _mm512_dpbusd_epi32(isum[r * np + p], lo[p], xl);
                for (int p = 0; p < np; p++) isum[r * np + p] = _mm512_dpbusd_epi32(isum[r * np + p], hi[p], xh);
            }
        }
        __m512 d[2], m[2];
        for (int p = 0; p < np; p++) {
            const uint8_t *sc = panel + p * panel_bytes + b * stride + weight_bytes(bits);
            d[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
            m[p] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
        }
        for (int r = 0; r < rows; r++) {
            const float *mt = meta + (r * blocks + b) * META;
            const __m512 dx = _mm512_set1_ps(mt[0]), sx = _mm512_set1_ps(mt[1]);
            for (int p = 0; p < np; p++) {
                __m512 *a = &acc[r * np + p];
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r * np + p]), _mm512_mul_ps(d[p], dx), *a);
                *a = _mm512_fmadd_ps(m[p], sx, *a);
            }
        }
    }
}

/* acc[r] (16 columns) for `rows` rows over all K / 32 blocks of one panel with a (d, m) per 16 k (sub 2). */
static inline __attribute__((always_inline)) void qtile_sub2(
        const int8_t *x8, const float *meta, int64_t K, const uint8_t *panel, int bits, int rows, __m512 *acc) {
    const int64_t blocks = K / 32, stride = block_bytes(bits, 2);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * stride;
        if (rows <= 2) _mm_prefetch((const char *)blk + 8 * stride, _MM_HINT_T0);
        __m512i w[8];
        if (bits == 8) {
            for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(blk + 64 * g);
        } else {
            const __m512i low = _mm512_set1_epi8(0x0F);
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512(blk + 64 * t);
                w[t] = _mm512_and_si512(v, low);
                w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        const uint8_t *sc = blk + weight_bytes(bits);
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
        const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 64)));
        const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 96)));
        for (int r = 0; r < rows; r++) {
            const float *mt = meta + (r * blocks + b) * META;
            const int8_t *xq = x8 + r * K + b * 32;
            const __m512 dx = _mm512_set1_ps(mt[0]);
            const __m512i lo = dot_groups(w, xq, 0, 4), hi = dot_groups(w, xq, 4, 4);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(d0, dx), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(d1, dx), acc[r]);
            acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(mt[2]), acc[r]);
            acc[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(mt[3]), acc[r]);
        }
    }
}

/* One tile, dispatched to a copy with literal rows, panels and bits so that its loops unroll into registers. */
#define SUB1(R, NP, BITS) qtile_sub1(x8, meta, K, panel, panel_bytes, NP, BITS, R, acc)
#define SUB2(R, NP, BITS) qtile_sub2(x8, meta, K, panel, BITS, R, acc)
#define ROWS_6(F, NP, BITS)                                                                        \
    switch (rows) {                                                                                \
        case 1: F(1, NP, BITS); break; case 2: F(2, NP, BITS); break; case 3: F(3, NP, BITS); break; \
        case 4: F(4, NP, BITS); break; case 5: F(5, NP, BITS); break; default: F(6, NP, BITS); break; \
    }
#define ROWS_8(F, NP, BITS)                                                                        \
    switch (rows) {                                                                                \
        case 1: F(1, NP, BITS); break; case 2: F(2, NP, BITS); break; case 3: F(3, NP, BITS); break; \
        case 4: F(4, NP, BITS); break; case 5: F(5, NP, BITS); break; case 6: F(6, NP, BITS); break; \
        case 7: F(7, NP, BITS); break; default: F(8, NP, BITS); break;                             \
    }
static void qtile_any(const int8_t *x8, const float *meta, int64_t K, const uint8_t *panel, int64_t panel_bytes,
                      int np, int bits, int sub, int rows, __m512 *acc) {
    if (sub == 2) {
        if (bits == 4) { ROWS_8(SUB2, 1, 4) } else { ROWS_8(SUB2, 1, 8) }
    } else if (np == 2) {
        if (bits == 4) { ROWS_6(SUB1, 2, 4) } else { ROWS_6(SUB1, 2, 8) }
    } else {
        if (bits == 4) { ROWS_8(SUB1, 1, 4) } else { ROWS_8(SUB1, 1, 8) }
    }
}

/* Work units: a pair of panels (sub 1) or one panel (sub 2, or sub 1's last panel when their count is odd). */
static inline int unit_panels(int sub, int64_t panels, int64_t pn) { return sub == 1 && pn + 1 < panels ? 2 : 1; }

#define QGEMM(S, T, STORE_VEC)                                                                     \
void qgemm_##S(const T *x, int64_t ldx, const uint8_t *w, int bits, int sub, const float *bias,   \
               T *out, int64_t ldo, int64_t M, int64_t N, int64_t K) {                             \
    int8_t *x8 = malloc((size_t)(M * K));                                                          \
    float *meta = malloc((size_t)(M * (K / 32) * META) * sizeof(float));                           \
    const int64_t panels = (N + QPANEL - 1) / QPANEL, row_blocks = (M + QROW_BLOCK - 1) / QROW_BLOCK; \
    const int64_t units = sub == 1 ? (panels + 1) / 2 : panels;                                    \
    const int64_t panel_bytes = (K / 32) * block_bytes(bits, sub);                                 \
    /* Split even a one-row call across threads: a decode step is bound by the weight stream. */   \
    _Pragma("omp parallel if(panels * K >= 2048)")                                                 \
    {                                                                                              \
        quantize_rows_##S(x, ldx, M, K, x8, meta);                                                 \
        /* Units outer: each thread takes a run of column units for every row block, so the threads \
         * share any row count evenly (row blocks outer gave one thread all of a 64-row block and the \
         * other the few rows past it: a 67-token prefill took 53 ms against 41 ms at 64 tokens). */ \
        _Pragma("omp for collapse(2) schedule(static)")                                            \
        for (int64_t u = 0; u < units; u++)                                                        \
            for (int64_t rb = 0; rb < row_blocks; rb++) {                                          \
                const int64_t pn = sub == 1 ? 2 * u : u, m_end = qmin64(M, (rb + 1) * QROW_BLOCK); \
                const int np = unit_panels(sub, panels, pn), tile_rows = np == 2 ? QPAIR_ROWS : QMAX_ROWS; \
                __mmask16 mask[2];                                                                 \
                __m512 bv[2];                                                                      \
                for (int p = 0; p < np; p++) {                                                     \
                    const int64_t n0 = (pn + p) * QPANEL;                                          \
                    const int valid = (int)qmin64(QPANEL, N - n0);                                 \
                    mask[p] = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1);              \
                    bv[p] = bias ? _mm512_maskz_loadu_ps(mask[p], bias + n0) : _mm512_setzero_ps(); \
                }                                                                                  \
                for (int64_t m0 = rb * QROW_BLOCK; m0 < m_end; m0 += tile_rows) {                  \
                    const int rows = (int)qmin64(tile_rows, m_end - m0);                           \
                    __m512 acc[2 * QMAX_ROWS];                                                     \
                    qtile_any(x8 + m0 * K, meta + m0 * (K / 32) * META, K, w + pn * panel_bytes,  \
                              panel_bytes, np, bits, sub, rows, acc);                              \
                    for (int r = 0; r < rows; r++)                                                 \
                        for (int p = 0; p < np; p++) {                                             \
                            T *dst = out + (m0 + r) * ldo + (pn + p) * QPANEL;                     \
                            const __m512 a = _mm512_add_ps(acc[r * np + p], bv[p]);                \
                            STORE_VEC                                                              \
                        }                                                                          \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
    free(x8);                                                                                      \
    free(meta);                                                                                    \
}

QGEMM(f32, float, { _mm512_mask_storeu_ps(dst, mask[p], a); })
#if defined(__AVX512BF16__)
QGEMM(bf16, uint16_t, { _mm256_mask_storeu_epi16(dst, mask[p], (__m256i)_mm512_cvtneps_pbh(a)); })
#endif

#endif

/* Rows `ids` of a packed weight, dequantized (the embedding table when it is the tied LM head). */
#define QROWS(S, T, STORE)                                                                         \
void qrows_##S(const uint8_t *w, int bits, int sub, int64_t K, const int64_t *ids, int64_t count, T *out) { \
    const int64_t stride = block_bytes(bits, sub), panel_bytes = (K / 32) * stride;                 \
    for (int64_t i = 0; i < count; i++) {                                                          \
        const int64_t n = ids[i], c = n % 16;                                                      \
        const uint8_t *panel = w + (n / 16) * panel_bytes;                                         \
        for (int64_t k = 0; k < K; k++) {                                                          \
            const uint8_t *blk = panel + (k / 32) * stride;                                        \
            const int kk = (int)(k % 32), g = kk / 4, j = kk % 4;                                  \
            int u;                                                                                 \
            if (bits == 8) u = blk[g * 64 + c * 4 + j];                                            \
            else u = (blk[(g % 4) * 64 + c * 4 + j] >> (g < 4 ? 0 : 4)) & 0x0F;                    \
            const _Float16 *sc = (const _Float16 *)(blk + weight_bytes(bits) + (sub == 2 && kk >= 16) * 64); \
            out[i * K + k] = STORE((float)sc[c] * (float)u + (float)sc[16 + c]);                   \
        }                                                                                          \
    }                                                                                              \
}

QROWS(f32, float, f32_store)
QROWS(bf16, uint16_t, float_to_bf16)

/* A QuantizedTensor (quant.py: u [N, K] uint8, d and m [N, K / 32 * sub] float16) -> the packed layout
 * above, [panels][K / 32][block_bytes]; the columns past N are zero. */
void pack_quantized(const uint8_t *u, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K, int bits,
                    int sub, uint8_t *out) {
    const int64_t blocks = K / 32, groups = blocks * sub, stride = block_bytes(bits, sub);
    const int64_t panels = (N + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *blk = out + (p * blocks + b) * stride;
            uint16_t *sc = (uint16_t *)(blk + weight_bytes(bits));
            memset(blk, 0, (size_t)stride);
            for (int64_t c = 0; c < 16; c++) {
                const int64_t n = p * 16 + c;
                if (n >= N) break;
                const uint8_t *row = u + n * K + b * 32;
                for (int kk = 0; kk < 32; kk++) {
                    const int g = kk / 4, j = kk % 4;
                    if (bits == 8) blk[g * 64 + c * 4 + j] = row[kk];
                    else blk[(g % 4) * 64 + c * 4 + j] |= (uint8_t)(row[kk] << (g < 4 ? 0 : 4));
                }
                for (int s = 0; s < sub; s++) {
                    sc[s * 32 + c] = d[n * groups + b * sub + s];
                    sc[s * 32 + 16 + c] = m[n * groups + b * sub + s];
                }
            }
        }
}
