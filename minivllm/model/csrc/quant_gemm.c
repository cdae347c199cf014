/* Linear layers on quantized weights, out = x @ W^T (+ bias), for any number of rows, batch-invariant.
 *
 * The weights stay in their GGUF block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_NL, IQ4_XS, MXFP4; `--quantization int8|int4` makes Q8_0|Q4_1), packed at load (quant.py) into panels of
 * 16 output columns that keep each format's bits: a decode step streams no more bytes than the file
 * holds. quant.py's docstring draws the layout; each format makes its weights as w = d * v + m per group
 * of 16 or 32 k, from unsigned integers v in bit planes and its own scales.
 *
 * The activations are quantized per row and per 32 k, the way llama.cpp does for its VNNI dot
 * products: dx = amax / 127, x8 = round(x / dx). Then each group is one integer dot product (vpdpbusd:
 * unsigned weight bytes x signed activation bytes, 64 products per AVX-512 instruction; simd.h's
 * ivec_dot4 gives the same exact sums on AVX2 and NEON), and
 *     out[n] = sum over groups, in k order: (d * dx) * isum + m * (dx * sum of x8)
 * in float32. A format without a min has m = -offset * d (its integers are v - offset), and there the
 * second term goes into the integers instead: (isum - offset * sum of x8) * (d * dx), the integer part
 * exact. The float steps share the VNNI pipes with the dot products, so this takes one of the four per
 * group and 16 columns off the formats most files are made of (Q5_0, Q6_K, Q8_0). On a Zen 4 the 0.5B
 * file's layer GEMMs and LM head ran 5.5-6.6 % faster at 56 rows (a decode step), and -1.5 to +4.7 % at
 * 512, with the calls of the two builds alternated in one process (BENCHMARKS.md, issue 30's seventh
 * sitting). A row's quantization and sums depend on that row alone, and the integer sums are exact, so a
 * row's result is the same bits whether the call has 1 row or 2,048 (issue 12), and a token is
 * quantized the same way in a prefill, a chunk or a decode.
 *
 * How: the one per-format part is `decode_regs`, a 32-k block of 16 columns into bytes u in vpdpbusd's
 * order and float32 d and m. Each thread takes a unit of one or two panels and a block of up to 128 rows.
 * Up to four rows (a decode step, bound by the weight stream, or the few tokens that chose one expert)
 * use the decoded block in registers (`rows_fused`). More rows decode each chunk of 32 blocks (1,024 k)
 * into a buffer (`decode_block`) and run every tile of rows of the block over it, the tile's
 * accumulators in registers within the chunk: a prefill pays the decoding once per 128 rows. Both do the
 * same integer sums and float steps per block, so a row's bits do not depend on which one ran. The chunk
 * and row block sizes change no bit, only the speed: 32 blocks and 128 rows made the 0.5B model's layer
 * GEMMs at 512 rows 17 % faster than 8 and 64 (477 against 408 GOPS, means of five alternating runs on a
 * 2-core Zen 4), the same at 32 rows.
 *
 * Targets: the code is written once over simd.h's primitives, a panel row of 16 columns being 1, 2 or 4
 * native vectors (AVX-512, AVX2, NEON); only the tile sizes differ (the registers). Every target does the
 * same integer sums and the same float32 steps per output, so the results are the same bits on each.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "quant_gemm.h"
#include "simd.h"

/* The small helpers below, inlined in every copy of the kernels: past GCC's unit-growth limit it would
 * otherwise call some of them from the hot loops. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* A format's shape, from ggml's type id (gguf_quants.BLOCK_FORMATS holds the same traits). */
typedef struct {
    int sb;          /* k per super-block: 256 (K-quants, IQ4_XS) or 32 */
    int bits;        /* of the integers: 2, 3, 4, 5, 6 or 8 */
    int group;       /* k per scale: 16 or 32 */
    int offset;      /* m = -offset * d where the format has no min */
    int lut;         /* v = a table's value + 128: 1 IQ4's non-uniform levels, 2 MXFP4's */
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
        case 39: return (Format){32, 4, 32, 128, 2, 0, 0};   /* MXFP4 (its scale an exponent byte) */
        default: return (Format){256, 4, 32, 128, 1, 0, 2};  /* 23: IQ4_XS */
    }
}

ALWAYS_INLINE int low_bits(int bits) { return bits == 8 ? 8 : bits >= 4 ? 4 : 2; }
ALWAYS_INLINE int plane_bytes(const Format *f) { return 16 * 32 * f->bits / 8; }
ALWAYS_INLINE int scale_bytes(const Format *f) {
    const int groups = f->sub_scales ? f->sb / f->group : 0;
    return (f->lut == 2 ? 16 : 32) + 32 * f->has_min + groups * 16 * (1 + (f->sub_scales == 1));
}
ALWAYS_INLINE int64_t superblock_bytes(const Format *f) { return (int64_t)(f->sb / 32) * plane_bytes(f) + scale_bytes(f); }

#if defined(SIMD)

#define QPANEL 16     /* output columns per panel: 16 int32 / float32, vpdpbusd's 64 bytes per group of 4 k */
#define QV (QPANEL / LANES)  /* native vectors per panel row: 1 (AVX-512), 2 (AVX2) */
#if defined(SIMD_AVX512)
#define QMAX_ROWS 8   /* rows per one-panel tile: 8 accumulators + 8 weight vectors + scales fit the registers */
#define QPAIR_ROWS 6  /* rows per two-panel tile: 12 accumulators + 12 integer sums + 4 weight vectors */
#define QPAIRS 1      /* sub-1 formats run two panels per unit, sharing each activation broadcast */
#else
#define QMAX_ROWS 4   /* a panel row is two ymm (AVX2: 8 integer sums + 4 weight vectors of 16 registers) or */
#define QPAIR_ROWS 1  /* four q registers (NEON: 16 + 8 of 32) */
#define QPAIRS 0      /* two panels' sums would not fit the registers: one panel per unit */
#endif
#define QROW_BLOCK 128 /* rows of x a thread works through per unit, while its decoded chunk stays in cache */
#define CHUNK 32       /* 32-k blocks decoded at a time: 24 KB per panel */
#define DECODED 768   /* bytes per decoded 32-k block of a panel: 512 of u, then float d[16] and m[16] per sub (<= 2) */

/* A panel row: 64 bytes of u (one group of 4 k of 16 columns, or 16 int32 sums), or 16 floats. */
typedef struct { ivec v[QV]; } pints;
typedef struct { vec v[QV]; } pfloats;

/* Per row and 32-k block of the quantized activations; [0] is the whole block, [1] and [2] its halves
 * (the sub-2 formats' groups of 16). */
typedef struct {
    float dx;          /* amax / 127: x = dx * x8 */
    float sx[3];       /* dx * (sum of x8): the factor of a min */
    int32_t zero[3];   /* -offset * (sum of x8): a zero point's term, added to the integer sums */
    int32_t pad;       /* to 32 bytes */
} RowBlock;

ALWAYS_INLINE pints pints_load(const uint8_t *p) {
    pints r;
    for (int i = 0; i < QV; i++) r.v[i] = ivec_load(p + 64 / QV * i);
    return r;
}
ALWAYS_INLINE void pints_store(uint8_t *p, pints a) {
    for (int i = 0; i < QV; i++) ivec_store(p + 64 / QV * i, a.v[i]);
}
ALWAYS_INLINE pints pints_zero(void) {
    pints r;
    for (int i = 0; i < QV; i++) r.v[i] = ivec_zero();
    return r;
}
ALWAYS_INLINE pints pints_set1(int32_t x) {
    pints r;
    for (int i = 0; i < QV; i++) r.v[i] = ivec_set1_32(x);
    return r;
}
ALWAYS_INLINE pfloats pfloats_load(const float *p) {
    pfloats r;
    for (int i = 0; i < QV; i++) r.v[i] = vec_load(p + LANES * i);
    return r;
}
ALWAYS_INLINE void pfloats_store(float *p, pfloats a) { for (int i = 0; i < QV; i++) vec_store(p + LANES * i, a.v[i]); }
ALWAYS_INLINE pfloats pfloats_set1(float x) {
    pfloats r;
    for (int i = 0; i < QV; i++) r.v[i] = vec_set1(x);
    return r;
}
/* acc + a * b, lane by lane. */
ALWAYS_INLINE pfloats pfloats_fmadd(pfloats a, pfloats b, pfloats acc) {
    for (int i = 0; i < QV; i++) acc.v[i] = vec_fmadd(a.v[i], b.v[i], acc.v[i]);
    return acc;
}
ALWAYS_INLINE pfloats pfloats_mul(pfloats a, pfloats b) {
    for (int i = 0; i < QV; i++) a.v[i] = vec_mul(a.v[i], b.v[i]);
    return a;
}
ALWAYS_INLINE pfloats pfloats_of(pints a) {
    pfloats r;
    for (int i = 0; i < QV; i++) r.v[i] = vec_from_ivec(a.v[i]);
    return r;
}
/* part's column sums += u's 4 bytes per column (unsigned) . the row's 4 activations at xq (signed): a
 * part of at most part_groups groups (simd.h's ivec_dot4), then added to int32 sums by pints_add_part. */
ALWAYS_INLINE pints pints_dot4(pints part, pints u, const int8_t *xq, int wide) {
    int32_t x4;
    memcpy(&x4, xq, 4);
    for (int i = 0; i < QV; i++) part.v[i] = ivec_dot4(part.v[i], u.v[i], x4, wide);
    return part;
}
ALWAYS_INLINE pints pints_add_part(pints sum, pints part, int wide) {
    for (int i = 0; i < QV; i++) sum.v[i] = ivec_add32(sum.v[i], ivec_part_sum(part.v[i], wide));
    return sum;
}
/* A block's integer sum and its first part start: the zero point goes in the part itself where a part is
 * int32 sums (simd.h's part_is_sum; exact, and the part's add into the sum folds away), else in the sum.
 * By value: through pointers, GCC kept a tile's sums in memory (0.5-0.6x at 64 rows). */
ALWAYS_INLINE pints block_sum_start(int32_t zero, int wide) {
    return part_is_sum(wide) ? pints_zero() : pints_set1(zero);
}
ALWAYS_INLINE pints block_part_start(int32_t zero, int wide) {
    return part_is_sum(wide) ? pints_set1(zero) : pints_zero();
}

ALWAYS_INLINE int64_t qmin64(int64_t a, int64_t b) { return a < b ? a : b; }

/* A row x [K] (float32 or bf16) -> x8 [K] int8 and meta [K / 32], for a format whose
 * integers are v - offset (0: it has a min instead). Vectorized:
 * a scalar loop cost as much as a quarter of a 64-row GEMM. The max and the integer sums are exact, and
 * the vector rounding is lrintf's (to nearest even), so the bits are those of the scalar definition on
 * every target. */
#define QUANTIZE_ROW(S, T, LOAD)                                                                   \
static void quantize_row_##S(const T *x, int64_t K, int offset, int8_t *x8, RowBlock *meta) {         \
    for (int64_t b = 0; b < K / 32; b++) {                                                         \
        const T *xb = x + b * 32;                                                                  \
        vec v[32 / LANES], amax_v = vec_zero();                                                    \
        for (int i = 0; i < 32 / LANES; i++) {                                                     \
            v[i] = LOAD(xb + LANES * i);                                                           \
            amax_v = vec_max(amax_v, vec_abs(v[i]));                                               \
        }                                                                                          \
        const float amax = vec_reduce_max(amax_v);                                                 \
        const float dx = exact_div(amax, 127.f), inv = amax > 0.f ? exact_div(127.f, amax) : 0.f;  \
        int8_t *q = x8 + b * 32;                                                                   \
        int32_t sums[2] = {0, 0};                                                                  \
        for (int i = 0; i < 32 / LANES; i++) {                                                     \
            const ivec qi = ivec_round(vec_mul(v[i], vec_set1(inv)));                              \
            ivec_store_i8(q + LANES * i, qi);                                                      \
            sums[i * LANES / 16] += ivec_reduce_add32(qi);                                         \
        }                                                                                          \
        RowBlock *m = meta + b;                                                                    \
        const int32_t parts[3] = {sums[0] + sums[1], sums[0], sums[1]};                            \
        m->dx = dx;                                                                                \
        for (int h = 0; h < 3; h++) {                                                              \
            m->sx[h] = dx * (float)parts[h];                                                       \
            m->zero[h] = -offset * parts[h];                                                       \
        }                                                                                          \
        m->pad = 0;                                                                                \
    }                                                                                              \
}

QUANTIZE_ROW(f32, float, vec_load)
QUANTIZE_ROW(bf16, uint16_t, vec_from_bf16)

/* -- decoding: one 32-k block of one panel into u bytes (8 groups of 64, vpdpbusd's order) and float d, m -- */

/* The `bits`-wide fields (8, 4 or 2) of a plane (quant.py's layout) as 8 panel rows of bytes, groups 0..7. */
static inline __attribute__((always_inline)) void plane_fields(const uint8_t *p, int bits, pints *w) {
    if (bits == 8) {
        for (int g = 0; g < 8; g++) w[g] = pints_load(p + 64 * g);
    } else if (bits == 4) {
        for (int t = 0; t < 4; t++) {
            const pints v = pints_load(p + 64 * t);
            for (int i = 0; i < QV; i++) {
                w[t].v[i] = ivec_and8(v.v[i], 0x0F);
                w[t + 4].v[i] = ivec_and8(ivec_shr16(v.v[i], 4), 0x0F);
            }
        }
    } else {  /* 2 */
        for (int t = 0; t < 2; t++) {
            const pints v = pints_load(p + 64 * t);
            for (int s = 0; s < 4; s++)
                for (int i = 0; i < QV; i++) w[t + 2 * s].v[i] = ivec_and8(ivec_shr16(v.v[i], 2 * s), 0x03);
        }
    }
}

/* IQ4_VALUES + 128, for a byte lookup. */
static const uint8_t IQ4_TABLE[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
/* MXFP4_VALUES + 128: E2M1 doubled. */
static const uint8_t MXFP4_TABLE[16] = {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116};

/* MXFP4's scales of LANES columns from their exponent bytes: 2^(e - 128), float32's bits built directly
 * (e < 2 gives a subnormal). */
ALWAYS_INLINE vec vec_from_e8m0(const uint8_t *e) {
    float d[LANES];
    for (int c = 0; c < LANES; c++) {
        const uint32_t bits = e[c] >= 2 ? (uint32_t)(e[c] - 1) << 23 : 0x00200000u << e[c];
        memcpy(&d[c], &bits, sizeof bits);
    }
    return vec_load(d);
}

/* Block b (0 .. sb / 32 - 1) of super-block `src` of one panel -> its u bytes w[8] (groups of 4 k) and per
 * sub (1 or 2) its d and m, in registers. Every scale is exact in float32 (a float16 times a small integer,
 * or times a power of 2), so where the values are kept does not change a bit. */
static inline __attribute__((always_inline)) void decode_regs(const Format f, const uint8_t *src, int b,
                                                              pints *w, pfloats *d, pfloats *m) {
    const int low = low_bits(f.bits), high = f.bits - low;
    const uint8_t *plane = src + b * plane_bytes(&f);
    plane_fields(plane, low, w);
    const uint8_t *upper = plane + 16 * 32 * low / 8;
    if (high == 1) {  /* bit g of each byte is group g's */
        const pints v = pints_load(upper);
        for (int g = 0; g < 8; g++)
            for (int i = 0; i < QV; i++)
                w[g].v[i] = ivec_add8_where(w[g].v[i], v.v[i], (uint8_t)(1 << g), (uint8_t)(1 << low));
    } else if (high == 2) {  /* Q6_K's bits 4-5: each 2-bit field moved to bits 4-5 by one shift, then masked */
        for (int t = 0; t < 2; t++) {
            const pints v = pints_load(upper + 64 * t);
            for (int i = 0; i < QV; i++) {
                w[t].v[i] = ivec_or(w[t].v[i], ivec_and8(ivec_shl16(v.v[i], 4), 0x30));
                w[t + 2].v[i] = ivec_or(w[t + 2].v[i], ivec_and8(ivec_shl16(v.v[i], 2), 0x30));
                w[t + 4].v[i] = ivec_or(w[t + 4].v[i], ivec_and8(v.v[i], 0x30));
                w[t + 6].v[i] = ivec_or(w[t + 6].v[i], ivec_and8(ivec_shr16(v.v[i], 2), 0x30));
            }
        }
    }
    if (f.lut)
        for (int g = 0; g < 8; g++)
            for (int i = 0; i < QV; i++) w[g].v[i] = ivec_lut8(f.lut == 2 ? MXFP4_TABLE : IQ4_TABLE, w[g].v[i]);
    const uint8_t *scales = src + (f.sb / 32) * plane_bytes(&f);
    pfloats d0, dmin;
    for (int i = 0; i < QV; i++) {
        d0.v[i] = f.lut == 2 ? vec_from_e8m0(scales + LANES * i) : vec_from_half(scales + 2 * LANES * i);
        dmin.v[i] = f.has_min ? vec_from_half(scales + 32 + 2 * LANES * i) : d0.v[i];
    }
    const uint8_t *subs = scales + 32 * (1 + f.has_min);
    const int sub = 32 / f.group, groups = f.sb / f.group;
    for (int h = 0; h < sub; h++) {
        for (int i = 0; i < QV; i++) {
            if (!f.sub_scales) {
                d[h].v[i] = d0.v[i];
                m[h].v[i] = f.has_min ? dmin.v[i] : vec_mul(d0.v[i], vec_set1((float)-f.offset));
                continue;
            }
            const uint8_t *raw = subs + (b * sub + h) * 16 + LANES * i;
            ivec sc, mn = ivec_zero();
            if (f.sub_scales == 2) {
                sc = ivec_from_i8(raw);
            } else if (f.sub_scales == 3) {  /* scale | min << 4 */
                const ivec both = ivec_from_u8(raw);
                sc = ivec_and32(both, 0x0F);
                mn = ivec_shr32(both, 4);
            } else {
                sc = ivec_from_u8(raw);
                mn = ivec_from_u8(subs + (groups + b * sub + h) * 16 + LANES * i);
            }
            d[h].v[i] = vec_mul(vec_from_ivec(sc), d0.v[i]);
            m[h].v[i] = f.has_min ? vec_sub(vec_zero(), vec_mul(vec_from_ivec(mn), dmin.v[i]))
                                  : vec_mul(d[h].v[i], vec_set1((float)-f.offset));
        }
    }
    /* The scales as decode_block stores them, also where they stay in registers (rows_fused): seen
     * through, -ffast-math may reassociate sc * d0 * dx differently there (it did, on NEON). */
    for (int h = 0; h < sub; h++)
        for (int i = 0; i < QV; i++) {
            d[h].v[i] = vec_fence(d[h].v[i]);
            m[h].v[i] = vec_fence(m[h].v[i]);
        }
}

/* Whether a format's u reach 128 (Q8_0, the IQ4 tables): AVX2's vpmaddubsw then needs two steps. */
ALWAYS_INLINE int wide(const Format f) { return f.bits == 8 || f.lut; }

/* decode_regs, stored: u (512 bytes) and dm (per sub: d[16], m[16]). */
static inline __attribute__((always_inline)) void decode_block(const Format f, const uint8_t *src, int b,
                                                               uint8_t *u, float *dm) {
    pints w[8];
    pfloats d[2], m[2];
    decode_regs(f, src, b, w, d, m);
    for (int g = 0; g < 8; g++) pints_store(u + 64 * g, w[g]);
    for (int h = 0; h < 32 / f.group; h++) {
        pfloats_store(dm + 32 * h, d[h]);
        pfloats_store(dm + 32 * h + 16, m[h]);
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
        __builtin_prefetch((const void *)line, 0, 2);
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
        DECODE_CASE(39)
#undef DECODE_CASE
    }
}

/* -- the dot products over a decoded chunk ------------------------------------------------------- */

/* acc[r * np + p] += a chunk of nb blocks (first block kb) for `rows` rows and np (1 or 2) panels whose
 * decoded chunks are `chunk_bytes` apart, one (d, m) per 32 k (sub 1). Two panels share each activation
 * broadcast, and the dot-product chains run group-major over rows and panels: rows * np independent
 * chains. A row's sum for a column is the same integers and the same float steps per block whatever
 * the tile, so its bits do not depend on np or on the rows beside it. */
static inline __attribute__((always_inline)) void tile_sub1(
        const int8_t *x8, const RowBlock *meta, int64_t K, int64_t kb, int nb, const uint8_t *dec,
        int64_t chunk_bytes, int np, int rows, int span, int wide, int has_min, float *acc_mem) {
    const int64_t blocks = K / 32;
    pfloats acc[2 * QMAX_ROWS];
    for (int i = 0; i < rows * np; i++) acc[i] = pfloats_load(acc_mem + 16 * i);
    for (int i = 0; i < nb; i++) {
        const int64_t b = kb + i;
        pints isum[2 * QMAX_ROWS], part[2 * QMAX_ROWS];  /* part: the groups since the last pints_add_part */
        for (int r = 0; r < rows; r++)
            for (int p = 0; p < np; p++) {
                isum[r * np + p] = block_sum_start(meta[r * blocks + b].zero[0], wide);
                part[r * np + p] = block_part_start(meta[r * blocks + b].zero[0], wide);
            }
        for (int t = 0; t < 4; t++) {
            pints lo[2], hi[2];  /* groups t and t + 4 of each panel */
            for (int p = 0; p < np; p++) {
                const uint8_t *u = dec + p * chunk_bytes + i * DECODED;
                lo[p] = pints_load(u + 64 * t);
                hi[p] = pints_load(u + 64 * (t + 4));
            }
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = x8 + r * K + b * 32;
                for (int p = 0; p < np; p++) part[r * np + p] = pints_dot4(part[r * np + p], lo[p], xq + 4 * t, wide);
                for (int p = 0; p < np; p++)
                    part[r * np + p] = pints_dot4(part[r * np + p], hi[p], xq + 4 * (t + 4), wide);
            }
            if (2 * (t + 1) % span == 0)  /* 2 (t + 1) groups so far */
                for (int j = 0; j < rows * np; j++) {
                    isum[j] = pints_add_part(isum[j], part[j], wide);
                    part[j] = pints_zero();
                }
        }
        pfloats d[2], m[2];
        for (int p = 0; p < np; p++) {
            const float *dm = (const float *)(dec + p * chunk_bytes + i * DECODED + 512);
            d[p] = pfloats_load(dm);
            m[p] = pfloats_load(dm + 16);
        }
        for (int r = 0; r < rows; r++) {
            const RowBlock *mt = meta + r * blocks + b;
            const pfloats dx = pfloats_set1(mt->dx), sx = pfloats_set1(mt->sx[0]);
            for (int p = 0; p < np; p++) {
                pfloats *a = &acc[r * np + p];
                *a = pfloats_fmadd(pfloats_of(isum[r * np + p]), pfloats_mul(d[p], dx), *a);
                if (has_min) *a = pfloats_fmadd(m[p], sx, *a);
            }
        }
    }
    for (int i = 0; i < rows * np; i++) pfloats_store(acc_mem + 16 * i, acc[i]);
}

/* zero + the integer dot product of one row's 16 activations (groups g0 .. g0 + 3) with a panel block: two
 * chains (latency) of two groups, a part each (part_groups is at least 2). */
static inline __attribute__((always_inline)) pints dot_groups(int32_t zero, const pints *w, const int8_t *xq, int g0,
                                                              int wide) {
    const pints sum = block_sum_start(zero, wide);
    pints even = block_part_start(zero, wide), odd = pints_zero();
    for (int g = g0; g < g0 + 4; g += 2) {
        even = pints_dot4(even, w[g], xq + 4 * g, wide);
        odd = pints_dot4(odd, w[g + 1], xq + 4 * (g + 1), wide);
    }
    return pints_add_part(pints_add_part(sum, even, wide), odd, wide);  /* integer: exact in any order */
}

/* acc[r] += a chunk for `rows` rows of one panel with a (d, m) per 16 k (sub 2). */
static inline __attribute__((always_inline)) void tile_sub2(
        const int8_t *x8, const RowBlock *meta, int64_t K, int64_t kb, int nb, const uint8_t *dec, int rows,
        int wide, int has_min, float *acc_mem) {
    const int64_t blocks = K / 32;
    pfloats acc[QMAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = pfloats_load(acc_mem + 16 * r);
    for (int i = 0; i < nb; i++) {
        const int64_t b = kb + i;
        const uint8_t *u = dec + i * DECODED;
        pints w[8];
        for (int g = 0; g < 8; g++) w[g] = pints_load(u + 64 * g);
        const float *dm = (const float *)(u + 512);
        const pfloats d0 = pfloats_load(dm), m0 = pfloats_load(dm + 16);
        const pfloats d1 = pfloats_load(dm + 32), m1 = pfloats_load(dm + 48);
        /* Unrolled, so that the rows' sums stay in registers: left to itself GCC kept the loop and each
         * row's acc in memory, a load and a store per row and block. */
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const RowBlock *mt = meta + r * blocks + b;
            const int8_t *xq = x8 + r * K + b * 32;
            const pfloats dx = pfloats_set1(mt->dx);
            const pints lo = dot_groups(mt->zero[1], w, xq, 0, wide), hi = dot_groups(mt->zero[2], w, xq, 4, wide);
            acc[r] = pfloats_fmadd(pfloats_of(lo), pfloats_mul(d0, dx), acc[r]);
            acc[r] = pfloats_fmadd(pfloats_of(hi), pfloats_mul(d1, dx), acc[r]);
            if (has_min) {
                acc[r] = pfloats_fmadd(m0, pfloats_set1(mt->sx[1]), acc[r]);
                acc[r] = pfloats_fmadd(m1, pfloats_set1(mt->sx[2]), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) pfloats_store(acc_mem + 16 * r, acc[r]);
}

/* A few rows (up to FUSED_ROWS) over all of K for np panels, each block decoded in registers once for all
 * of them (no buffer): a decode step, or an expert that a few of the step's tokens chose. The same integer
 * sums and the same float steps per block as tile_sub1 / tile_sub2, so the same bits as a row computed
 * among others. At two to four rows on Zen 3 this took 0.72-0.92x the time of decoding each chunk into the
 * buffer first and tiling it (Q4_K, Q5_0, Q6_K, Q8_0; one thread, the two builds' calls alternated). */
#define FUSED_ROWS 4
static inline __attribute__((always_inline)) void rows_fused(const Format f, const int8_t *x8, const RowBlock *meta,
                                                             int64_t K, const uint8_t *panel, int64_t panel_bytes,
                                                             int np, int rows, pfloats *out) {
    const int per_sb = f.sb / 32, sub = 32 / f.group;
    const int64_t sb_bytes = superblock_bytes(&f), blocks = K / 32;
    /* Two to four rows' sums local, so that they stay in registers: through `out` GCC kept them in memory
     * (the 16-sequence decode of a mixture of experts 0.95x the time). One row's stay there: 2 % faster. */
    pfloats local[2 * FUSED_ROWS], *acc = rows > 1 ? local : out;
    for (int j = 0; j < rows * np; j++) acc[j] = pfloats_set1(0.f);
    for (int64_t b = 0; b < blocks; b++) {
        for (int p = 0; p < np; p++) {
            const uint8_t *src = panel + p * panel_bytes + (b / per_sb) * sb_bytes;
            prefetch_block(f, panel + p * panel_bytes, b);
            pints w[8];
            pfloats d[2], m[2];
            decode_regs(f, src, (int)(b % per_sb), w, d, m);
            for (int r = 0; r < rows; r++) {
                const int8_t *xq = x8 + r * K + b * 32;
                const RowBlock *mt = meta + r * blocks + b;
                const pfloats dx = pfloats_set1(mt->dx);
                pfloats *a = &acc[r * np + p];
                if (sub == 1) {
                    pints isum = block_sum_start(mt->zero[0], wide(f)), part = block_part_start(mt->zero[0], wide(f));
                    for (int t = 0; t < 4; t++) {
                        part = pints_dot4(part, w[t], xq + 4 * t, wide(f));
                        part = pints_dot4(part, w[t + 4], xq + 4 * (t + 4), wide(f));
                        if (2 * (t + 1) % part_groups(f.bits, wide(f)) == 0) {
                            isum = pints_add_part(isum, part, wide(f));
                            part = pints_zero();
                        }
                    }
                    *a = pfloats_fmadd(pfloats_of(isum), pfloats_mul(d[0], dx), *a);
                    if (f.has_min) *a = pfloats_fmadd(m[0], pfloats_set1(mt->sx[0]), *a);
                } else {
                    const pints lo = dot_groups(mt->zero[1], w, xq, 0, wide(f));
                    const pints hi = dot_groups(mt->zero[2], w, xq, 4, wide(f));
                    *a = pfloats_fmadd(pfloats_of(lo), pfloats_mul(d[0], dx), *a);
                    *a = pfloats_fmadd(pfloats_of(hi), pfloats_mul(d[1], dx), *a);
                    if (f.has_min) {
                        *a = pfloats_fmadd(m[0], pfloats_set1(mt->sx[1]), *a);
                        *a = pfloats_fmadd(m[1], pfloats_set1(mt->sx[2]), *a);
                    }
                }
            }
        }
    }
    if (rows > 1)
        for (int j = 0; j < rows * np; j++) out[j] = acc[j];
}

/* rows_fused in a copy per format, panel count and row count; a function per row count (one holding all
 * of them made the one-row copies 1.1-1.5x slower). */
#define FUSED_CASE(Q, R) case Q: if (QPAIRS && np == 2) rows_fused(format_of(Q), x8, meta, K, panel, panel_bytes, 2, R, acc); \
                              else rows_fused(format_of(Q), x8, meta, K, panel, panel_bytes, 1, R, acc); break;
#define DEFINE_ROWS(R)                                                                                 \
static void rows_##R(int qtype, const int8_t *x8, const RowBlock *meta, int64_t K, const uint8_t *panel, \
                     int64_t panel_bytes, int np, pfloats *acc) {                                      \
    switch (qtype) {                                                                                   \
        FUSED_CASE(2, R) FUSED_CASE(3, R) FUSED_CASE(6, R) FUSED_CASE(7, R) FUSED_CASE(8, R) FUSED_CASE(10, R)           \
        FUSED_CASE(11, R) FUSED_CASE(12, R) FUSED_CASE(13, R) FUSED_CASE(14, R) FUSED_CASE(20, R) FUSED_CASE(23, R)      \
        FUSED_CASE(39, R)                                                                                 \
    }                                                                                                  \
}
DEFINE_ROWS(1)
DEFINE_ROWS(2)
DEFINE_ROWS(3)
DEFINE_ROWS(4)
#undef DEFINE_ROWS
#undef FUSED_CASE

static void rows_any(int qtype, const int8_t *x8, const RowBlock *meta, int64_t K, const uint8_t *panel,
                     int64_t panel_bytes, int np, int rows, pfloats *acc) {
    switch (rows) {
        case 1: rows_1(qtype, x8, meta, K, panel, panel_bytes, np, acc); break;
        case 2: rows_2(qtype, x8, meta, K, panel, panel_bytes, np, acc); break;
        case 3: rows_3(qtype, x8, meta, K, panel, panel_bytes, np, acc); break;
        default: rows_4(qtype, x8, meta, K, panel, panel_bytes, np, acc); break;
    }
}

/* One tile, dispatched to a copy with literal rows, panels, part span and width so that its loops unroll
 * into registers. */
#define SUB1(R, NP, WIDE) tile_sub1(x8, meta, K, kb, nb, dec, chunk_bytes, NP, R, span, WIDE, has_min, acc)
#define SUB2(R, NP, WIDE) tile_sub2(x8, meta, K, kb, nb, dec, R, WIDE, has_min, acc)
#define ROWS(F, NP, WIDE, MAX)                                                                     \
    switch (rows < MAX ? rows : MAX) {                                                             \
        case 1: F(1, NP, WIDE); break; case 2: F(2 < MAX ? 2 : MAX, NP, WIDE); break;              \
        case 3: F(3 < MAX ? 3 : MAX, NP, WIDE); break; case 4: F(4 < MAX ? 4 : MAX, NP, WIDE); break; \
        case 5: F(5 < MAX ? 5 : MAX, NP, WIDE); break; case 6: F(6 < MAX ? 6 : MAX, NP, WIDE); break; \
        case 7: F(7 < MAX ? 7 : MAX, NP, WIDE); break; default: F(8 < MAX ? 8 : MAX, NP, WIDE); break; \
    }
#define TILES(WIDE)                                                                                \
    if (sub == 2) {                                                                                \
        ROWS(SUB2, 1, WIDE, QMAX_ROWS)                                                             \
    } else if (QPAIRS && np == 2) {                                                                \
        ROWS(SUB1, 2, WIDE, QPAIR_ROWS)                                                            \
    } else {                                                                                       \
        ROWS(SUB1, 1, WIDE, QMAX_ROWS)                                                             \
    }
static void tile_any(const int8_t *x8, const RowBlock *meta, int64_t K, int64_t kb, int nb, const uint8_t *dec,
                     int64_t chunk_bytes, int np, int sub, int bits, int is_wide, int has_min, int rows, float *acc) {
    const int groups = part_groups(bits, is_wide);  /* 8 but for 5 and 6 bits on AVX2 without VNNI */
    if (is_wide) {
        const int span = 8;
        TILES(1)
    } else if (groups == 2) {
        const int span = 2;
        TILES(0)
    } else if (groups == 4) {
        const int span = 4;
        TILES(0)
    } else {
        const int span = 8;
        TILES(0)
    }
}

/* -- AMX: the same integer sums on the tiles --------------------------------------------------------
 * Where the CPU has AMX-INT8, a block of 16 or more rows takes each 32-k block of a panel as one tile
 * product: tdpbssd multiplies the rows' signed activation bytes (A: 16 rows x 32 bytes) by the panel's
 * weight bytes, which decode_block already lays out as the B operand (8 rows of 4 k x 16 columns), into
 * 16 x 16 exact int32 sums. The chunk's bytes first become the weights' own signed integers v - offset
 * (they fit a byte in every format), so the sums hold the zero point's term the vector path adds per row
 * and block (that add was a quarter of the float steps: 0.78-0.91x the time at 512 rows). The sums are
 * the integers the vector path makes, and the float steps per block after them are tile_sub1's and
 * tile_sub2's, in the same order: so a row's bits are the same on the tiles, on the vector path and in
 * a batch-1 decode, and the choice between them (rows per block) changes no bit. A sub-2 format (groups
 * of 16) takes two half products (16 bytes of A, 4 rows of B). Blocks take two tile pairs in turn: a
 * block's sums are stored a step after its product was issued, so the unit multiplies the next block
 * while the vector pipes apply the last one's scales (stored right after the product, the store waited
 * for it: 1.3x as long). */
#if defined(SIMD_AVX512) && defined(__AMX_INT8__)
#define AMX_GEMM 1
#define AMX_CHUNK amx_tiles_chunk
#define AMX_GEMM_ROWS 16

/* sub 1: tmm0-1 and tmm2-3 the two panels' sums for even and odd blocks, tmm4 A, tmm5-6 B. sub 2: tmm0-1
 * and tmm2-3 the halves' sums, tmm4 and tmm7 the halves of A, tmm5-6 their B. */
static void configure_gemm_tiles(int sub) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, (uint8_t)(8 / sub), (uint8_t)(8 / sub), 16};
    const uint16_t colsb[8] = {64, 64, 64, 64, (uint16_t)(32 / sub), 64, 64, 16};
    configure_tiles(rows, colsb);
}

/* acc[r * np + p] (16 floats) += one block's sums c[p] (16 x 16 int32) for `rows` rows: tile_sub1's steps. */
static inline void apply_sub1(int32_t (*c)[256], const RowBlock *meta, int64_t blocks, int64_t b,
                              const uint8_t *dec, int64_t chunk_bytes, int i, int np, int rows, int has_min,
                              float *acc) {
    for (int p = 0; p < np; p++) {
        const float *dm = (const float *)(dec + p * chunk_bytes + i * DECODED + 512);
        const vec d = vec_load(dm), m = vec_load(dm + 16);
        for (int r = 0; r < rows; r++) {
            const RowBlock *mt = meta + r * blocks + b;
            const ivec isum = _mm512_loadu_si512(c[p] + 16 * r);
            float *a = acc + (r * np + p) * QPANEL;
            vec v = vec_fmadd(vec_from_ivec(isum), vec_mul(d, vec_set1(mt->dx)), vec_load(a));
            if (has_min) v = vec_fmadd(m, vec_set1(mt->sx[0]), v);
            vec_store(a, v);
        }
    }
}

/* acc[r] += one block's half sums c[0] (k 0-15) and c[1] (16-31) for `rows` rows: tile_sub2's steps. */
static inline void apply_sub2(int32_t (*c)[256], const RowBlock *meta, int64_t blocks, int64_t b,
                              const uint8_t *dec, int i, int rows, int has_min, float *acc) {
    const float *dm = (const float *)(dec + i * DECODED + 512);
    const vec d0 = vec_load(dm), m0 = vec_load(dm + 16), d1 = vec_load(dm + 32), m1 = vec_load(dm + 48);
    for (int r = 0; r < rows; r++) {
        const RowBlock *mt = meta + r * blocks + b;
        const vec dx = vec_set1(mt->dx);
        const ivec lo = _mm512_loadu_si512(c[0] + 16 * r), hi = _mm512_loadu_si512(c[1] + 16 * r);
        float *a = acc + r * QPANEL;
        vec v = vec_fmadd(vec_from_ivec(lo), vec_mul(d0, dx), vec_load(a));
        v = vec_fmadd(vec_from_ivec(hi), vec_mul(d1, dx), v);
        if (has_min) {
            v = vec_fmadd(m0, vec_set1(mt->sx[1]), v);
            v = vec_fmadd(m1, vec_set1(mt->sx[2]), v);
        }
        vec_store(a, v);
    }
}

/* Block i (k block b) of the chunk for the 16 rows at x (K apart): its product into tile pair T0, T1. */
#define AMX_BLOCK(T0, T1)                                                                          \
    if (sub == 1) {                                                                                \
        _tile_loadd(4, x + b * 32, K);                                                            \
        _tile_zero(T0);                                                                            \
        _tile_loadd(5, dec + i * DECODED, 64);                                                     \
        _tile_dpbssd(T0, 4, 5);                                                                    \
        if (np == 2) {                                                                             \
            _tile_zero(T1);                                                                        \
            _tile_loadd(6, dec + chunk_bytes + i * DECODED, 64);                                   \
            _tile_dpbssd(T1, 4, 6);                                                                \
        }                                                                                          \
    } else {                                                                                       \
        _tile_loadd(4, x + b * 32, K);                                                            \
        _tile_loadd(7, x + b * 32 + 16, K);                                                       \
        _tile_zero(T0);                                                                            \
        _tile_zero(T1);                                                                            \
        _tile_loadd(5, dec + i * DECODED, 64);                                                     \
        _tile_loadd(6, dec + i * DECODED + 256, 64);                                               \
        _tile_dpbssd(T0, 4, 5);                                                                    \
        _tile_dpbssd(T1, 7, 6);                                                                    \
    }

/* The sums of tile pair T0, T1 into c. */
#define AMX_STORE(T0, T1)                                                                          \
    _tile_stored(T0, c[0], 64);                                                                    \
    if (sub == 2 || np == 2) _tile_stored(T1, c[1], 64);

/* tile_any's work for all `rows` rows of a row block (16 at a time; x8 padded to whole tiles):
 * acc[r * np + p] += the chunk's blocks kb .. kb + nb - 1. */
static void amx_tiles_chunk(const int8_t *x8, const RowBlock *meta, int64_t K, int64_t kb, int nb,
                            uint8_t *dec, int64_t chunk_bytes, int np, int sub, int offset, int has_min, int rows,
                            float *acc) {
    const int64_t blocks = K / 32;
    _Alignas(64) int32_t sums[2][256];  /* a block's sums: [panel or half][16 x 16] */
    if (offset)  /* the weights' own signed integers v - offset: their sums take the zero point in */
        for (int p = 0; p < np; p++)
            for (int i = 0; i < nb; i++)
                for (int j = 0; j < 512; j += 64) {
                    uint8_t *u = dec + p * chunk_bytes + i * DECODED + j;
                    _mm512_storeu_si512(u, _mm512_sub_epi8(_mm512_loadu_si512(u), _mm512_set1_epi8((char)offset)));
                }
    configure_gemm_tiles(sub);
    for (int r0 = 0; r0 < rows; r0 += AMX_GEMM_ROWS) {
        const int n = rows - r0 < AMX_GEMM_ROWS ? rows - r0 : AMX_GEMM_ROWS;
        const int8_t *x = x8 + (int64_t)r0 * K;
        const RowBlock *mt = meta + (int64_t)r0 * blocks;
        float *a = acc + (int64_t)r0 * np * QPANEL;
        for (int i = 0; i <= nb; i++) {
            if (i < nb) {  /* multiply block i ... */
                const int64_t b = kb + i;
                if (i & 1) {
                    AMX_BLOCK(2, 3)
                } else {
                    AMX_BLOCK(0, 1)
                }
            }
            if (i > 0) {  /* ... while block i - 1's sums, multiplied a step ago, take their scales */
                int32_t (*c)[256] = sums;
                if (i & 1) {
                    AMX_STORE(0, 1)
                } else {
                    AMX_STORE(2, 3)
                }
                if (sub == 1) apply_sub1(sums, mt, blocks, kb + i - 1, dec, chunk_bytes, i - 1, np, n, has_min, a);
                else apply_sub2(sums, mt, blocks, kb + i - 1, dec, i - 1, n, has_min, a);
            }
        }
    }
    _tile_release();
}
#else
#define AMX_GEMM 0
#define AMX_CHUNK(...) (void)0
#endif

/* Work units: a pair of panels (sub 1, where the target has the registers) or one panel (sub 2, sub 1's
 * last panel when their count is odd, or a call of two to FUSED_ROWS rows: there a pair's sums leave the
 * registers, and one panel at a time made a 16-sequence step of Granite's experts 0.95x the time). */
static inline int unit_panels(int pair, int64_t panels, int64_t pn) {
    return pair && pn + 1 < panels ? 2 : 1;
}

/* A call's shape: its format, its panels and panel units, its row blocks, a panel's bytes. */
typedef struct {
    Format f;
    int sub, pair;
    int64_t panels, units, row_blocks, panel_bytes;
} Shape;

static Shape shape_of(const QGemmCall *c) {
    Shape s = {.f = format_of((int)c->qtype)};
    s.sub = 32 / s.f.group;
    s.pair = QPAIRS && s.sub == 1 && (c->M == 1 || c->M > FUSED_ROWS);
    s.panels = (c->N + QPANEL - 1) / QPANEL;
    s.units = s.pair ? (s.panels + 1) / 2 : s.panels;
    s.row_blocks = (c->M + QROW_BLOCK - 1) / QROW_BLOCK;
    s.panel_bytes = c->K / s.f.sb * superblock_bytes(&s.f);
    return s;
}

/* What a unit of row block rb of call c costs, to share a batch's units evenly: its blocks, each decoded
 * once (about half a row's dot products) and dotted with each of its rows. A step's experts differ in
 * rows, so even counts of units left one thread with more of the work. */
static inline int64_t unit_cost(const QGemmCall *c, int64_t rb) {
    return c->K / 32 * (1 + 2 * qmin64(QROW_BLOCK, c->M - rb * QROW_BLOCK));
}

/* Unit `un` of row block `rb` of call c: its output columns for up to QROW_BLOCK rows. dec, acc: the
 * thread's scratch. */
#define QGEMM_UNIT(S, T, STORE_N)                                                                  \
static void qgemm_unit_##S(const QGemmCall *c, const Shape *s, const int8_t *x8, const RowBlock *meta, \
                           int64_t rb, int64_t un, uint8_t *dec, float *acc) {                     \
    const Format f = s->f;                                                                         \
    const int64_t M = c->M, N = c->N, K = c->K, blocks = K / 32, chunk_bytes = CHUNK * DECODED;    \
    const uint8_t *w = c->w;                                                                       \
    const int64_t pn = s->pair ? 2 * un : un, m0 = rb * QROW_BLOCK, m_end = qmin64(M, m0 + QROW_BLOCK); \
    const int np = unit_panels(s->pair, s->panels, pn), tile_rows = np == 2 ? QPAIR_ROWS : QMAX_ROWS; \
    if (m_end - m0 <= FUSED_ROWS) {  /* a decode step, or an expert's few rows: decoded in registers */   \
        pfloats rows[2 * FUSED_ROWS];                                                              \
        rows_any((int)c->qtype, x8 + m0 * K, meta + m0 * blocks, K, w + pn * s->panel_bytes, s->panel_bytes, \
                 np, (int)(m_end - m0), rows);                                                     \
        for (int j = 0; j < (m_end - m0) * np; j++) pfloats_store(acc + j * QPANEL, rows[j]);     \
    } else {                                                                                       \
        memset(acc, 0, sizeof(float) * (size_t)((m_end - m0) * np * QPANEL));                      \
        for (int64_t kb = 0; kb < blocks; kb += CHUNK) {                                           \
            const int nb = (int)qmin64(CHUNK, blocks - kb);                                        \
            for (int p = 0; p < np; p++)                                                           \
                decode_any((int)c->qtype, w + (pn + p) * s->panel_bytes, kb, nb, dec + p * chunk_bytes); \
            if (AMX_GEMM && amx_tiles_ready() && m_end - m0 >= 16) {                               \
                AMX_CHUNK(x8 + m0 * K, meta + m0 * blocks, K, kb, nb, dec, chunk_bytes, np, s->sub, \
                          f.offset, f.has_min, (int)(m_end - m0), acc);                            \
                continue;                                                                          \
            }                                                                                      \
            for (int64_t r0 = m0; r0 < m_end; r0 += tile_rows) {                                   \
                const int rows = (int)qmin64(tile_rows, m_end - r0);                               \
                tile_any(x8 + r0 * K, meta + r0 * blocks, K, kb, nb, dec, chunk_bytes, np, s->sub, \
                         f.bits, wide(f), f.has_min, rows, acc + (r0 - m0) * np * QPANEL);         \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    T *out = c->out;                                                                               \
    for (int p = 0; p < np; p++) {                                                                 \
        const int64_t n0 = (pn + p) * QPANEL;                                                      \
        const int valid = (int)qmin64(QPANEL, N - n0);                                             \
        for (int i = 0; i < QV; i++) {                                                             \
            const int lanes = valid - LANES * i;                                                   \
            if (lanes <= 0) break;                                                                 \
            const vec bv = c->bias ? vec_load_n(c->bias + n0 + LANES * i, lanes) : vec_zero();     \
            for (int64_t r = m0; r < m_end; r++) {                                                 \
                const float *a = acc + ((r - m0) * np + p) * QPANEL + LANES * i;                   \
                STORE_N(out + r * c->ldo + n0 + LANES * i, vec_add(vec_load(a), bv), lanes);       \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

/* Every call of a batch in one parallel region: first all their rows quantized, then all their work
 * units (row blocks outer, collapsed with the units, so that the threads share any row count evenly and a
 * row block's activations stay in cache while the units pass over them: units outer streamed all of x8
 * once per unit, 10 MB a unit for a 2,048-row down projection, which bound the tiles), each thread
 * taking an even share of the batch's cost (unit_cost) in one contiguous run of units. A decode step's
 * chosen experts' small GEMMs (or a fused q/k/v's three segments) thus pay one fork and two barriers, not
 * one fork and two barriers each, and each call's units are exactly those it would run alone: a row's
 * bits do not depend on the batch. */
#define QGEMM_CALLS(S, T)                                                                          \
void qgemm_calls_##S(const QGemmCall *calls, int64_t count) {                                      \
    Shape shapes[count];                                                                           \
    int64_t first_row[count + 1], x8_at[count + 1], meta_at[count + 1], work = 0, total = 0;    \
    first_row[0] = x8_at[0] = meta_at[0] = 0;                                                      \
    for (int64_t i = 0; i < count; i++) {                                                          \
        const QGemmCall *c = &calls[i];                                                            \
        shapes[i] = shape_of(c);                                                                   \
        first_row[i + 1] = first_row[i] + c->M;                                                    \
        x8_at[i + 1] = x8_at[i] + (c->M + 16) * c->K;  /* + a tile's rows: AMX reads whole tiles */ \
        meta_at[i + 1] = meta_at[i] + c->M * (c->K / 32);                                          \
        work += shapes[i].panels * c->K;                                                           \
        for (int64_t rb = 0; rb < shapes[i].row_blocks; rb++) total += unit_cost(c, rb) * shapes[i].units; \
    }                                                                                              \
    int8_t *x8 = malloc((size_t)x8_at[count]);                                                     \
    RowBlock *meta = malloc(sizeof(RowBlock) * (size_t)meta_at[count]);                            \
    /* Split even a one-row call across threads: a decode step is bound by the weight stream. */   \
    _Pragma("omp parallel if(work >= 2048)")                                                       \
    {                                                                                              \
        int64_t i = 0;  /* the call of iteration g: static schedules hand out increasing g */       \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t g = 0; g < first_row[count]; g++) {                                           \
            while (g >= first_row[i + 1]) i++;                                                     \
            const QGemmCall *c = &calls[i];                                                        \
            const int64_t r = g - first_row[i];                                                    \
            quantize_row_##S((const T *)c->x + r * c->ldx, c->K, shapes[i].f.offset,               \
                             x8 + x8_at[i] + r * c->K, meta + meta_at[i] + r * (c->K / 32));       \
        }                                                                                          \
        uint8_t *dec = aligned_alloc(64, 2 * CHUNK * DECODED);                                     \
        float *acc = aligned_alloc(64, sizeof(float) * QROW_BLOCK * 2 * QPANEL);                   \
        /* The units whose cumulative cost starts in this thread's share of the total, in order. */      \
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();                  \
        const int64_t lo = total * me / threads, hi = total * (me + 1) / threads;                  \
        for (int64_t ci = 0, before = 0; ci < count && before < hi; ci++)                             \
            for (int64_t rb = 0; rb < shapes[ci].row_blocks && before < hi; rb++) {                 \
                const int64_t cost = unit_cost(&calls[ci], rb), units = shapes[ci].units;            \
                const int64_t first = lo > before ? (lo - before + cost - 1) / cost : 0;           \
                const int64_t last = qmin64(units, (hi - before + cost - 1) / cost);               \
                for (int64_t un = first; un < last; un++)                                          \
                    qgemm_unit_##S(&calls[ci], &shapes[ci], x8 + x8_at[ci], meta + meta_at[ci], rb, un, dec, acc); \
                before += cost * units;                                                            \
            }                                                                                      \
        free(dec);                                                                                 \
        free(acc);                                                                                 \
    }                                                                                              \
    free(x8);                                                                                      \
    free(meta);                                                                                    \
}                                                                                                  \
                                                                                                   \
void qgemm_##S(const T *x, int64_t ldx, const uint8_t *w, int qtype, const float *bias,           \
               T *out, int64_t ldo, int64_t M, int64_t N, int64_t K) {                             \
    const QGemmCall call = {x, ldx, w, qtype, bias, out, ldo, M, N, K};                            \
    qgemm_calls_##S(&call, 1);                                                                     \
}

QGEMM_UNIT(f32, float, vec_store_n)
QGEMM_UNIT(bf16, uint16_t, vec_store_bf16_n)
QGEMM_CALLS(f32, float)
QGEMM_CALLS(bf16, uint16_t)

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
