/* Linear layers on quantized weights, out = x @ W^T (+ bias), for any number of rows, batch-invariant.
 *
 * The weights stay in their GGUF block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_NL, IQ4_XS; `--quantization int8|int4` makes Q8_0|Q4_1), packed at load (quant.py) into panels of
 * 16 output columns that keep each format's bits: a decode step streams no more bytes than the file
 * holds. quant.py's docstring draws the layout; each format makes its weights as w = d * v + m per group
 * of 16 or 32 k, from unsigned integers v in bit planes and its own scales.
 *
 * The activations are quantized per row and per 32 k, the way llama.cpp does for its VNNI dot
 * products: dx = amax / 127, x8 = round(x / dx). Then each group is one integer dot product (AVX512-VNNI
 * vpdpbusd: unsigned weight bytes x signed activation bytes, 64 products per instruction), and
 *     out[n] = sum over groups, in k order: (d * dx) * isum + m * (dx * sum of x8)
 * in float32. A row's quantization and sums depend on that row alone, and the integer sums are exact,
 * so a row's result is the same bits whether the call has 1 row or 2,048 (issue 12), and a token is
 * quantized the same way in a prefill, a chunk or a decode.
 *
 * How: the one per-format part is `decode_regs`, a 32-k block of 16 columns into bytes u in vpdpbusd's
 * order and float32 d and m. Each thread takes a unit of one or two panels and a block of up to 64 rows.
 * One row (a batch-1 decode, bound by the weight stream) uses the decoded block in registers
 * (`row_fused`). More rows decode each chunk of 8 blocks into a small buffer in L1 (`decode_block`) and
 * run every tile of rows of the block over it, the tile's accumulators in registers within the chunk:
 * a prefill pays the decoding once per 64 rows. Both do the same integer sums and float steps per block,
 * so a row's bits do not depend on which one ran.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* A format's shape, from ggml's type id (gguf_quants.BLOCK_FORMATS holds the same traits). */
typedef struct {
    int sb;          /* k per super-block: 256 (K-quants, IQ4_XS) or 32 */
    int bits;        /* of the integers: 2, 3, 4, 5, 6 or 8 */
    int group;       /* k per scale: 16 or 32 */
    int offset;      /* m = -offset * d where the format has no min */
    int lut;         /* IQ4: v = the non-uniform table's value + 128 */
    int has_min;     /* a float16 min (Q4_1, Q5_1) or min scale (Q2_K, Q4_K, Q5_K) */
    int sub_scales;  /* 0: none; 1: u8 scales and u8 mins (Q4_K, Q5_K); 2: i8 scales; 3: Q2_K's nibbles */
} Format;

static inline Format format_of(int qtype) {
    switch (qtype) {
        case 2: return (Format){32, 4, 32, 8, 0, 0, 0};      /* Q4_0 */
        case 3: return (Format){32, 4, 32, 0, 0, 1, 0};      /* Q4_1 */
        case 6: return (Format){32, 5, 32, 16, 0, 0, 0};     /* Q5_0 */
        case 7: return (Format){32, 5, 32, 0, 0, 1, 0};      /* Q5_1 */
        case 8: return (Format){32, 8, 32, 128, 0, 0, 0};    /* Q8_0 */
        case 10: return (Format){256, 2, 16, 0, 0, 1, 3};    /* Q2_K */
        case 11: return (Format){256, 3, 16, 4, 0, 0, 2};    /* Q3_K */
        case 12: return (Format){256, 4, 32, 0, 0, 1, 1};    /* Q4_K */
        case 13: return (Format){256, 5, 32, 0, 0, 1, 1};    /* Q5_K */
        case 14: return (Format){256, 6, 16, 32, 0, 0, 2};   /* Q6_K */
        case 20: return (Format){32, 4, 32, 128, 1, 0, 0};   /* IQ4_NL */
        default: return (Format){256, 4, 32, 128, 1, 0, 2};  /* 23: IQ4_XS */
    }
}

static inline int low_bits(int bits) { return bits == 8 ? 8 : bits >= 4 ? 4 : 2; }
static inline int plane_bytes(const Format *f) { return 16 * 32 * f->bits / 8; }
static inline int scale_bytes(const Format *f) {
    const int groups = f->sub_scales ? f->sb / f->group : 0;
    return 32 * (1 + f->has_min) + groups * 16 * (1 + (f->sub_scales == 1));
}
static inline int64_t superblock_bytes(const Format *f) { return (int64_t)(f->sb / 32) * plane_bytes(f) + scale_bytes(f); }

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define QPANEL 16     /* output columns per panel: one vector of 16 int32 / float32 */
#define QMAX_ROWS 8   /* rows per one-panel tile: 8 accumulators + 8 weight vectors + scales fit the registers */
#define QPAIR_ROWS 6  /* rows per two-panel tile: 12 accumulators + 12 integer sums + 4 weight vectors */
#define QROW_BLOCK 64 /* rows of x a thread works through per unit, while its decoded chunk sits in L1 */
#define CHUNK 8       /* 32-k blocks decoded at a time */
#define DECODED 768   /* bytes per decoded 32-k block of a panel: 512 of u, then float d[16] and m[16] per sub (<= 2) */
#define META 4        /* per row and 32-k block: dx, then dx * (sum of x8) over the block and over each half */

static inline int64_t qmin64(int64_t a, int64_t b) { return a < b ? a : b; }

/* 16 activations as float32 vectors, from either dtype. */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* a / b, rounded once: -ffast-math would make it a * (1 / b), rounded twice, and a product that the twin
 * (quant.quantize_activations) puts at 43.499996 could land on 43.5 and round the other way. */
static inline float exact_div(float a, float b) { return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b))); }

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
            const float dx = exact_div(amax, 127.f), inv = amax > 0.f ? exact_div(127.f, amax) : 0.f; \
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

/* -- decoding: one 32-k block of one panel into u bytes (8 groups of 64, vpdpbusd's order) and float d, m -- */

/* The `bits`-wide fields (8, 4 or 2) of a plane (quant.py's layout) as 8 vectors of bytes, groups 0..7. */
static inline __attribute__((always_inline)) void plane_fields(const uint8_t *p, int bits, __m512i *w) {
    if (bits == 8) {
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(p + 64 * g);
    } else if (bits == 4) {
        const __m512i mask = _mm512_set1_epi8(0x0F);
        for (int t = 0; t < 4; t++) {
            const __m512i v = _mm512_loadu_si512(p + 64 * t);
            w[t] = _mm512_and_si512(v, mask);
            w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        }
    } else {  /* 2 */
        const __m512i mask = _mm512_set1_epi8(0x03);
        for (int t = 0; t < 2; t++) {
            const __m512i v = _mm512_loadu_si512(p + 64 * t);
            for (int s = 0; s < 4; s++) w[t + 2 * s] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * s), mask);
        }
    }
}

/* Block b (0 .. sb / 32 - 1) of super-block `src` of one panel -> its u bytes w[8] (groups of 4 k) and per
 * sub (1 or 2) its d and m, in registers. Every scale is exact in float32 (a float16 times a small integer,
 * or times a power of 2), so where the values are kept does not change a bit. */
static inline __attribute__((always_inline)) void decode_regs(const Format f, const uint8_t *src, int b,
                                                              __m512i *w, __m512 *d, __m512 *m) {
    const int low = low_bits(f.bits), high = f.bits - low;
    const uint8_t *plane = src + b * plane_bytes(&f);
    plane_fields(plane, low, w);
    const uint8_t *upper = plane + 16 * 32 * low / 8;
    if (high == 1) {  /* bit g of each byte is group g's: a byte mask adds 1 << low (off the shift port) */
        const __m512i v = _mm512_loadu_si512(upper), add = _mm512_set1_epi8((char)(1 << low));
        for (int g = 0; g < 8; g++)
            w[g] = _mm512_mask_add_epi8(w[g], _mm512_test_epi8_mask(v, _mm512_set1_epi8((char)(1 << g))), w[g], add);
    } else if (high == 2) {  /* Q6_K's bits 4-5: each 2-bit field moved to bits 4-5 by one shift, then masked */
        const __m512i mask = _mm512_set1_epi8(0x30);
        for (int t = 0; t < 2; t++) {
            const __m512i v = _mm512_loadu_si512(upper + 64 * t);
            w[t] = _mm512_or_si512(w[t], _mm512_and_si512(_mm512_slli_epi16(v, 4), mask));
            w[t + 2] = _mm512_or_si512(w[t + 2], _mm512_and_si512(_mm512_slli_epi16(v, 2), mask));
            w[t + 4] = _mm512_or_si512(w[t + 4], _mm512_and_si512(v, mask));
            w[t + 6] = _mm512_or_si512(w[t + 6], _mm512_and_si512(_mm512_srli_epi16(v, 2), mask));
        }
    }
    if (f.lut) {  /* IQ4_VALUES + 128 in each 128-bit lane, for vpshufb */
        const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(
            1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181, (char)197,
            (char)217, (char)241));
        for (int g = 0; g < 8; g++) w[g] = _mm512_shuffle_epi8(table, w[g]);
    }
    const uint8_t *scales = src + (f.sb / 32) * plane_bytes(&f);
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
    const __m512 dmin = f.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32))) : d0;
    const uint8_t *subs = scales + 32 * (1 + f.has_min);
    const int sub = 32 / f.group, groups = f.sb / f.group;
    for (int h = 0; h < sub; h++) {
        if (!f.sub_scales) {
            d[h] = d0;
            m[h] = f.has_min ? dmin : _mm512_mul_ps(d0, _mm512_set1_ps((float)-f.offset));
            continue;
        }
        const __m128i raw = _mm_loadu_si128((const __m128i *)(subs + (b * sub + h) * 16));
        __m512i sc, mn = _mm512_setzero_si512();
        if (f.sub_scales == 2) {
            sc = _mm512_cvtepi8_epi32(raw);
        } else if (f.sub_scales == 3) {  /* scale | min << 4 */
            const __m512i both = _mm512_cvtepu8_epi32(raw);
            sc = _mm512_and_si512(both, _mm512_set1_epi32(0x0F));
            mn = _mm512_srli_epi32(both, 4);
        } else {
            sc = _mm512_cvtepu8_epi32(raw);
            mn = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(subs + (groups + b * sub + h) * 16)));
        }
        d[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), d0);
        m[h] = f.has_min ? _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(_mm512_cvtepi32_ps(mn), dmin))
                         : _mm512_mul_ps(d[h], _mm512_set1_ps((float)-f.offset));
    }
}

/* decode_regs, stored: u (512 bytes) and dm (per sub: d[16], m[16]). */
static inline __attribute__((always_inline)) void decode_block(const Format f, const uint8_t *src, int b,
                                                               uint8_t *u, float *dm) {
    __m512i w[8];
    __m512 d[2], m[2];
    decode_regs(f, src, b, w, d, m);
    for (int g = 0; g < 8; g++) _mm512_storeu_si512(u + 64 * g, w[g]);
    for (int h = 0; h < 32 / f.group; h++) {
        _mm512_storeu_ps(dm + 32 * h, d[h]);
        _mm512_storeu_ps(dm + 32 * h + 16, m[h]);
    }
}

/* Asks for the bytes PREFETCH_BYTES past block b's share of its panel (past the panel's end: the next
 * panel's, which the thread reads next), a block's worth at a time so that the requests never queue: a
 * panel of a 896-wide matrix is a stream of only ~10 KB, too short for the hardware prefetcher to ramp up. */
#define PREFETCH_BYTES 4096
static inline __attribute__((always_inline)) void prefetch_block(const Format f, const uint8_t *panel, int64_t b) {
    const int64_t per_block = superblock_bytes(&f) * 32 / f.sb;
    const uintptr_t start = (uintptr_t)(panel + b * per_block + PREFETCH_BYTES);
    for (uintptr_t line = start & ~(uintptr_t)63; line < start + per_block; line += 64)
        _mm_prefetch((const char *)line, _MM_HINT_T1);
}

/* Blocks kb .. kb + nb - 1 of a panel (its packed bytes at `panel`) into `out` (nb x DECODED bytes). */
static inline __attribute__((always_inline)) void decode_chunk(const Format f, const uint8_t *panel, int64_t kb,
                                                               int nb, uint8_t *out) {
    const int per_sb = f.sb / 32;
    const int64_t sb_bytes = superblock_bytes(&f);
    for (int i = 0; i < nb; i++) {
        const int64_t block = kb + i;
        prefetch_block(f, panel, block);
        decode_block(f, panel + (block / per_sb) * sb_bytes, (int)(block % per_sb), out + i * DECODED,
                     (float *)(out + i * DECODED + 512));
    }
}

static void decode_any(int qtype, const uint8_t *panel, int64_t kb, int nb, uint8_t *out) {
    switch (qtype) {  /* a copy per format, with its shape as constants */
#define DECODE_CASE(Q) case Q: decode_chunk(format_of(Q), panel, kb, nb, out); break;
        DECODE_CASE(2) DECODE_CASE(3) DECODE_CASE(6) DECODE_CASE(7) DECODE_CASE(8) DECODE_CASE(10)
        DECODE_CASE(11) DECODE_CASE(12) DECODE_CASE(13) DECODE_CASE(14) DECODE_CASE(20) DECODE_CASE(23)
#undef DECODE_CASE
    }
}

/* -- the dot products over a decoded chunk ------------------------------------------------------- */

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc[r * np + p] += a chunk of nb blocks (first block kb) for `rows` rows and np (1 or 2) panels whose
 * decoded chunks are `chunk_bytes` apart, one (d, m) per 32 k (sub 1). Two panels share each activation
 * broadcast, and the dpbusd chains run group-major over rows and panels: rows * np independent chains. A
 * row's sum for a column is the same integers and the same two float steps per block whatever the tile,
 * so its bits do not depend on np or on the rows beside it. */
static inline __attribute__((always_inline)) void tile_sub1(
        const int8_t *x8, const float *meta, int64_t K, int64_t kb, int nb, const uint8_t *dec, int64_t chunk_bytes,
        int np, int rows, float *acc_mem) {
    const int64_t blocks = K / 32;
    __m512 acc[2 * QMAX_ROWS];
    for (int i = 0; i < rows * np; i++) acc[i] = _mm512_loadu_ps(acc_mem + 16 * i);
    for (int i = 0; i < nb; i++) {
        const int64_t b = kb + i;
        __m512i isum[2 * QMAX_ROWS];
        for (int j = 0; j < rows * np; j++) isum[j] = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            __m512i lo[2], hi[2];  /* groups t and t + 4 of each panel */
            for (int p = 0; p < np; p++) {
                const uint8_t *u = dec + p * chunk_bytes + i * DECODED;
                lo[p] = _mm512_loadu_si512(u + 64 * t);
                hi[p] = _mm512_loadu_si512(u + 64 * (t + 4));
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
            const float *dm = (const float *)(dec + p * chunk_bytes + i * DECODED + 512);
            d[p] = _mm512_loadu_ps(dm);
            m[p] = _mm512_loadu_ps(dm + 16);
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
    for (int i = 0; i < rows * np; i++) _mm512_storeu_ps(acc_mem + 16 * i, acc[i]);
}

/* The integer dot product of one row's 16 activations (groups g0 .. g0 + 3) with a panel block. */
static inline __attribute__((always_inline)) __m512i dot_groups(const __m512i *w, const int8_t *xq, int g0) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  /* two chains: latency */
    for (int g = g0; g < g0 + 4; g += 2) {
        even = _mm512_dpbusd_epi32(even, w[g], bcast4(xq + 4 * g));
        odd = _mm512_dpbusd_epi32(odd, w[g + 1], bcast4(xq + 4 * (g + 1)));
    }
    return _mm512_add_epi32(even, odd);  /* integer: exact in any order */
}

/* acc[r] += a chunk for `rows` rows of one panel with a (d, m) per 16 k (sub 2). */
static inline __attribute__((always_inline)) void tile_sub2(
        const int8_t *x8, const float *meta, int64_t K, int64_t kb, int nb, const uint8_t *dec, int rows,
        float *acc_mem) {
    const int64_t blocks = K / 32;
    __m512 acc[QMAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_loadu_ps(acc_mem + 16 * r);
    for (int i = 0; i < nb; i++) {
        const int64_t b = kb + i;
        const uint8_t *u = dec + i * DECODED;
        __m512i w[8];
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(u + 64 * g);
        const float *dm = (const float *)(u + 512);
        const __m512 d0 = _mm512_loadu_ps(dm), m0 = _mm512_loadu_ps(dm + 16);
        const __m512 d1 = _mm512_loadu_ps(dm + 32), m1 = _mm512_loadu_ps(dm + 48);
        for (int r = 0; r < rows; r++) {
            const float *mt = meta + (r * blocks + b) * META;
            const int8_t *xq = x8 + r * K + b * 32;
            const __m512 dx = _mm512_set1_ps(mt[0]);
            const __m512i lo = dot_groups(w, xq, 0), hi = dot_groups(w, xq, 4);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(d0, dx), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(d1, dx), acc[r]);
            acc[r] = _mm512_fmadd_ps(m0, _mm512_set1_ps(mt[2]), acc[r]);
            acc[r] = _mm512_fmadd_ps(m1, _mm512_set1_ps(mt[3]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc_mem + 16 * r, acc[r]);
}

/* One row over all of K for np panels, decoded in registers (no buffer): a batch-1 decode step. The same
 * integer sums and the same float steps per block as tile_sub1 / tile_sub2, so the same bits as that row
 * computed among others. */
static inline __attribute__((always_inline)) void row_fused(const Format f, const int8_t *x8, const float *meta,
                                                            int64_t K, const uint8_t *panel, int64_t panel_bytes,
                                                            int np, __m512 *acc) {
    const int per_sb = f.sb / 32, sub = 32 / f.group;
    const int64_t sb_bytes = superblock_bytes(&f);
    for (int p = 0; p < np; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        const int8_t *xq = x8 + b * 32;
        const float *mt = meta + b * META;
        const __m512 dx = _mm512_set1_ps(mt[0]);
        for (int p = 0; p < np; p++) {
            const uint8_t *src = panel + p * panel_bytes + (b / per_sb) * sb_bytes;
            prefetch_block(f, panel + p * panel_bytes, b);
            __m512i w[8];
            __m512 d[2], m[2];
            decode_regs(f, src, (int)(b % per_sb), w, d, m);
            if (sub == 1) {
                __m512i isum = _mm512_setzero_si512();
                for (int t = 0; t < 4; t++) {
                    isum = _mm512_dpbusd_epi32(isum, w[t], bcast4(xq + 4 * t));
                    isum = _mm512_dpbusd_epi32(isum, w[t + 4], bcast4(xq + 4 * (t + 4)));
                }
                acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d[0], dx), acc[p]);
                acc[p] = _mm512_fmadd_ps(m[0], _mm512_set1_ps(mt[1]), acc[p]);
            } else {
                const __m512i lo = dot_groups(w, xq, 0), hi = dot_groups(w, xq, 4);
                acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(d[0], dx), acc[p]);
                acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(d[1], dx), acc[p]);
                acc[p] = _mm512_fmadd_ps(m[0], _mm512_set1_ps(mt[2]), acc[p]);
                acc[p] = _mm512_fmadd_ps(m[1], _mm512_set1_ps(mt[3]), acc[p]);
            }
        }
    }
}

static void row_any(int qtype, const int8_t *x8, const float *meta, int64_t K, const uint8_t *panel,
                    int64_t panel_bytes, int np, __m512 *acc) {
    switch (qtype) {  /* a copy per format and panel count */
#define ROW_CASE(Q) case Q: if (np == 2) row_fused(format_of(Q), x8, meta, K, panel, panel_bytes, 2, acc); \
                            else row_fused(format_of(Q), x8, meta, K, panel, panel_bytes, 1, acc); break;
        ROW_CASE(2) ROW_CASE(3) ROW_CASE(6) ROW_CASE(7) ROW_CASE(8) ROW_CASE(10)
        ROW_CASE(11) ROW_CASE(12) ROW_CASE(13) ROW_CASE(14) ROW_CASE(20) ROW_CASE(23)
#undef ROW_CASE
    }
}

/* One tile, dispatched to a copy with literal rows and panels so that its loops unroll into registers. */
#define SUB1(R, NP) tile_sub1(x8, meta, K, kb, nb, dec, chunk_bytes, NP, R, acc)
#define SUB2(R, NP) tile_sub2(x8, meta, K, kb, nb, dec, R, acc)
#define ROWS_6(F, NP)                                                                              \
    switch (rows) {                                                                                \
        case 1: F(1, NP); break; case 2: F(2, NP); break; case 3: F(3, NP); break;                 \
        case 4: F(4, NP); break; case 5: F(5, NP); break; default: F(6, NP); break;                \
    }
#define ROWS_8(F, NP)                                                                              \
    switch (rows) {                                                                                \
        case 1: F(1, NP); break; case 2: F(2, NP); break; case 3: F(3, NP); break;                 \
        case 4: F(4, NP); break; case 5: F(5, NP); break; case 6: F(6, NP); break;                 \
        case 7: F(7, NP); break; default: F(8, NP); break;                                         \
    }
static void tile_any(const int8_t *x8, const float *meta, int64_t K, int64_t kb, int nb, const uint8_t *dec,
                     int64_t chunk_bytes, int np, int sub, int rows, float *acc) {
    if (sub == 2) {
        ROWS_8(SUB2, 1)
    } else if (np == 2) {
        ROWS_6(SUB1, 2)
    } else {
        ROWS_8(SUB1, 1)
    }
}

/* Work units: a pair of panels (sub 1) or one panel (sub 2, or sub 1's last panel when their count is odd). */
static inline int unit_panels(int sub, int64_t panels, int64_t pn) { return sub == 1 && pn + 1 < panels ? 2 : 1; }

#define QGEMM(S, T, STORE_VEC)                                                                     \
void qgemm_##S(const T *x, int64_t ldx, const uint8_t *w, int qtype, const float *bias,           \
               T *out, int64_t ldo, int64_t M, int64_t N, int64_t K) {                             \
    const Format f = format_of(qtype);                                                             \
    const int sub = 32 / f.group;                                                                  \
    int8_t *x8 = malloc((size_t)(M * K));                                                          \
    float *meta = malloc((size_t)(M * (K / 32) * META) * sizeof(float));                           \
    const int64_t panels = (N + QPANEL - 1) / QPANEL, row_blocks = (M + QROW_BLOCK - 1) / QROW_BLOCK; \
    const int64_t units = sub == 1 ? (panels + 1) / 2 : panels, blocks = K / 32;                   \
    const int64_t panel_bytes = K / f.sb * superblock_bytes(&f), chunk_bytes = CHUNK * DECODED;     \
    /* Split even a one-row call across threads: a decode step is bound by the weight stream. */   \
    _Pragma("omp parallel if(panels * K >= 2048)")                                                 \
    {                                                                                              \
        quantize_rows_##S(x, ldx, M, K, x8, meta);                                                 \
        uint8_t *dec = aligned_alloc(64, 2 * chunk_bytes);                                         \
        float *acc = aligned_alloc(64, sizeof(float) * QROW_BLOCK * 2 * QPANEL);                   \
        /* Units outer: each thread takes a run of column units for every row block, so the threads \
         * share any row count evenly. */                                                          \
        _Pragma("omp for collapse(2) schedule(static)")                                            \
        for (int64_t un = 0; un < units; un++)                                                     \
            for (int64_t rb = 0; rb < row_blocks; rb++) {                                          \
                const int64_t pn = sub == 1 ? 2 * un : un, m0 = rb * QROW_BLOCK;                   \
                const int64_t m_end = qmin64(M, m0 + QROW_BLOCK);                                  \
                const int np = unit_panels(sub, panels, pn), tile_rows = np == 2 ? QPAIR_ROWS : QMAX_ROWS; \
                if (M == 1) {  /* a batch-1 decode: decoded in registers */                        \
                    __m512 row[2];                                                                 \
                    row_any(qtype, x8, meta, K, w + pn * panel_bytes, panel_bytes, np, row);       \
                    for (int p = 0; p < np; p++) _mm512_storeu_ps(acc + p * QPANEL, row[p]);       \
                } else {                                                                           \
                memset(acc, 0, sizeof(float) * (size_t)((m_end - m0) * np * QPANEL));              \
                for (int64_t kb = 0; kb < blocks; kb += CHUNK) {                                   \
                    const int nb = (int)qmin64(CHUNK, blocks - kb);                                \
                    for (int p = 0; p < np; p++)                                                   \
                        decode_any(qtype, w + (pn + p) * panel_bytes, kb, nb, dec + p * chunk_bytes); \
                    for (int64_t r0 = m0; r0 < m_end; r0 += tile_rows) {                           \
                        const int rows = (int)qmin64(tile_rows, m_end - r0);                       \
                        tile_any(x8 + r0 * K, meta + r0 * blocks * META, K, kb, nb, dec, chunk_bytes, np, \
                                 sub, rows, acc + (r0 - m0) * np * QPANEL);                        \
                    }                                                                              \
                }                                                                                  \
                }                                                                                  \
                for (int p = 0; p < np; p++) {                                                     \
                    const int64_t n0 = (pn + p) * QPANEL;                                          \
                    const int valid = (int)qmin64(QPANEL, N - n0);                                 \
                    const __mmask16 mask = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1);  \
                    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps(); \
                    for (int64_t r = m0; r < m_end; r++) {                                         \
                        T *dst = out + r * ldo + n0;                                               \
                        const __m512 a = _mm512_add_ps(_mm512_loadu_ps(acc + ((r - m0) * np + p) * QPANEL), bv); \
                        STORE_VEC                                                                  \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        free(dec);                                                                                 \
        free(acc);                                                                                 \
    }                                                                                              \
    free(x8);                                                                                      \
    free(meta);                                                                                    \
}

QGEMM(f32, float, { _mm512_mask_storeu_ps(dst, mask, a); })
#if defined(__AVX512BF16__)
QGEMM(bf16, uint16_t, { _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(a)); })
#endif

/* Rows `ids` of a packed weight, dequantized as w = d * v + m (the embedding table, when it is quantized). */
#define QROWS(S, T, STORE)                                                                         \
void qrows_##S(const uint8_t *w, int qtype, int64_t K, const int64_t *ids, int64_t count, T *out) { \
    const Format f = format_of(qtype);                                                             \
    const int sub = 32 / f.group;                                                                  \
    const int64_t panel_bytes = K / f.sb * superblock_bytes(&f);                                   \
    uint8_t *dec = aligned_alloc(64, CHUNK * DECODED);                                             \
    for (int64_t i = 0; i < count; i++) {                                                          \
        const int64_t c = ids[i] % 16;                                                             \
        for (int64_t kb = 0; kb < K / 32; kb += CHUNK) {                                           \
            const int nb = (int)qmin64(CHUNK, K / 32 - kb);                                        \
            decode_any(qtype, w + (ids[i] / 16) * panel_bytes, kb, nb, dec);                       \
            for (int b = 0; b < nb; b++)                                                           \
                for (int kk = 0; kk < 32; kk++) {                                                  \
                    const uint8_t *u = dec + b * DECODED;                                          \
                    const float *dm = (const float *)(u + 512) + (sub == 2 && kk >= 16) * 32;      \
                    const float v = (float)u[(kk / 4) * 64 + c * 4 + kk % 4];                     \
                    out[i * K + (kb + b) * 32 + kk] = STORE(dm[c] * v + dm[16 + c]);               \
                }                                                                                  \
        }                                                                                          \
    }                                                                                              \
    free(dec);                                                                                     \
}

QROWS(f32, float, f32_store)
QROWS(bf16, uint16_t, float_to_bf16)

#endif
