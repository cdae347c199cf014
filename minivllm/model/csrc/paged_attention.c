/* Attention read straight from the paged KV pool, for the CPU: every query token of a step, decode or
 * prefill, through one per-query computation.
 *
 * A step's queries come in spans, one per sequence: `len` consecutive tokens whose first one sees `ctx0`
 * tokens of context (itself included), so query i of the span sees ctx0 + i. Their K/V are already in
 * the pool (the layer writes them first), so a prefill chunk, the tail of a prompt after a prefix-cache
 * hit and a decode all read the same blocks the same way. For one query and one head the arithmetic
 * depends on its context length alone: scores block by block, a softmax over exactly its context, the
 * values accumulated block by block. So a token's attention output is the same bits whether it is
 * computed in a prefill, a chunk or a decode, and whatever else shares the step (issue 12).
 *
 * A task is (span, tile of up to Q_TILE queries, kv head): each K/V tile is converted once and used by
 * the tile's queries and the query heads that share the kv head (grouped-query attention). Nothing is
 * gathered: K and V are read once per task, where they lie.
 *
 * Pool layout, per block and kv head: K transposed as [head_dim][block_size], V as
 * [block_size][head_dim]. The transposed K turns a block's scores into head_dim vector FMAs over
 * block_size lanes (no horizontal sums); V rows are added as vectors too.
 *
 * A quantized pool (--kv-cache-dtype int8/fp8, kv_cache.py) holds one byte per value and a float32
 * scale per (token, kv head) beside it. A tile's bytes are converted to float32 as they are (int8 by a
 * cast, fp8 through a 256-entry table: no fp8 arithmetic on the CPU), and the scales are applied per
 * token where that is cheapest: a K scale multiplies the token's score, a V scale its softmax weight.
 * Each query still depends on its own context alone.
 *
 * A sliding window (Gemma, Mistral, Phi-3) narrows a query's context to its last `window` tokens: the
 * blocks before the window are skipped and the softmax runs over the window alone; a logit softcap
 * (Gemma 2) maps each score to cap * tanh(score / cap) before it; an attention sink (gpt-oss) is one
 * learned logit per head added to the softmax's denominator alone. All are per layer and, like the
 * rest, a function of the query's own context only.
 *
 * Built at first use with the system's C compiler (kernels.py), with -ffast-math for vectorized expf.
 * Reductions whose vector split could depend on a buffer's address (the softmax sum) run over rows
 * that are 64-byte aligned and padded to 16 floats, so the compiler's code takes the same path for
 * every query with the same context.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "kv_quant.h"
#include "simd.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK_SIZE 64
#define Q_TILE 8           /* queries of one sequence that share each K/V tile */
#define PREFETCH_BLOCKS 6
#define CHAINS 4           /* head_dim must be a multiple (kernels.py checks) */
#define SCORE_ALIGN 16     /* floats: score rows start on 64 bytes and are padded to this */
#define MASKED -1e30f      /* score of a padded slot (its weight is set to 0) */
#define EXP_FLOOR -87.f    /* e^-87 is a normal float; the vector expf handles it in its fast path */

/* 2^f for f in [-0.5, 0.5]: a degree-6 polynomial, highest power first (the Taylor series of e^(f ln 2);
 * error below 2e-7), evaluated by Horner's rule in the AVX2 flash task's exp and the AMX path's. */
static const float EXP2_POLY[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 0.24022651f, 0.69314718f, 1.f};

/* A tile of K or V converted to float32. Written through `u` for bf16 (a shift per element, which
 * vectorizes), read through `f`: C11 allows reading a union through another member. */
typedef union { float f[MAX_HEAD_DIM * MAX_BLOCK_SIZE]; uint32_t u[MAX_HEAD_DIM * MAX_BLOCK_SIZE]; } tile_t;

static inline void bf16_tile(const uint16_t *src, tile_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst->u[i] = (uint32_t)src[i] << 16;
}

static inline void f32_tile(const float *src, tile_t *dst, int64_t n) {
    memcpy(dst->f, src, sizeof(float) * n);
}

static inline void int8_tile(const int8_t *src, tile_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst->f[i] = (float)src[i];
}

static float e4m3_table[256], e5m2_table[256];  /* each fp8 byte's value, filled when the library loads */

__attribute__((constructor)) static void fill_fp8_tables(void) {
    for (int x = 0; x < 256; x++) {
        e4m3_table[x] = fp8_decode((uint8_t)x, E4M3);
        e5m2_table[x] = fp8_decode((uint8_t)x, E5M2);
    }
}

static inline void e4m3_tile(const uint8_t *src, tile_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst->f[i] = e4m3_table[src[i]];
}

static inline void e5m2_tile(const uint8_t *src, tile_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst->f[i] = e5m2_table[src[i]];
}

/* Blocks are scattered in the pool and the hardware prefetcher cannot guess the jumps: the score
 * pass asks for the K tile PREFETCH_BLOCKS ahead and for this block's V tile, which the value pass
 * will want next. With locality 1 (prefetcht2 on x86, which AMD fills into L2; PLDL3KEEP on Arm), not
 * into L1: prefetches into L1 held the L1 miss buffers that the tile conversion's own loads wait for.
 * On a 2-core Zen 4 a decode step's attention (64 sequences of 400 tokens, SmolLM2's shapes, `bench
 * kernels`) took 49-51 ms this way against 63-71 ms with L1 prefetches 2 blocks ahead (BENCHMARKS.md,
 * issue 30's sixth sitting). */
static inline void prefetch_tile(const void *tile, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)tile + i, 0, 1);
}

/* A tile's first two lines, ahead of its reads: enough for the L2's stream prefetcher to fetch the rest of
 * it, without holding one of the core's few line-fill buffers per line as prefetch_tile does. Where
 * decode attention reads from DRAM (12 streams at 4,000 tokens), 0.97x the step time of prefetch_tile's. */
static inline void start_stream(const void *tile) {
    __builtin_prefetch(tile, 0, 1);
    __builtin_prefetch((const char *)tile + 64, 0, 1);
}

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* The common shapes, head_dim 64 (SmolLM2, Qwen2.5-0.5B) or 128 (Llama 3, Qwen2.5-1.5B) and blocks of 16
 * tokens, in 16-float vectors (GCC's vector extension: zmm registers on AVX-512), up to HEADS_AT_ONCE
 * query heads of a kv group at a time. Each K or V row is loaded once for those heads: with a row
 * reloaded per head, as the general loops do, the loads (a vector row and a broadcast per FMA) bound the
 * passes, not the FMAs. The value pass takes a V row 64 floats at a time, so that four heads' sums and
 * the row fit the registers at head_dim 128 too. A head's arithmetic is the same in every call (its
 * chunk of heads depends on the group size alone), so every query still depends on its own context. */
#define HEADS_AT_ONCE 4
typedef float vf16 __attribute__((vector_size(64)));

/* Only where a 16-float vector is one register (AVX-512): elsewhere GCC lowers these 64-byte vectors
 * through memory, and the AVX2 build's attention ran 6-10x as long as on the general loops, which
 * those targets (AVX2, NEON) keep. */
static inline int vector_shape(int64_t head_dim, int64_t block_size) {
#ifdef __AVX512F__
    return block_size == 16 && (head_dim == 64 || head_dim == 128);
#else
    (void)head_dim, (void)block_size;
    return 0;
#endif
}

static inline vf16 load16(const float *p) { vf16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, vf16 v) { memcpy(p, &v, sizeof v); }

/* A row that several heads' FMAs use, held in a register: GCC would otherwise fold its load into each
 * FMA, which made a prefill's attention 1.3x as long on Zen 4 (a 512-bit load and a broadcast per FMA). */
static inline vf16 in_register(vf16 v) {
#ifdef __AVX512F__
    __asm__("" : "+v"(v));
#endif
    return v;
}

/* Scores of one block for HB heads: out[g][t] = sum_d q[g][d] K[d][t], in CHAINS chains (d mod CHAINS)
 * summed at the end, as the general loop sums them. */
#define DEFINE_SCORES16(HD, HB)                                                                         \
static inline __attribute__((always_inline)) void scores##HD##_##HB(                                    \
        const float *restrict k, const float (*restrict q)[MAX_HEAD_DIM], float (*restrict out)[MAX_BLOCK_SIZE]) { \
    vf16 s[HB][CHAINS];                                                                                 \
    for (int g = 0; g < HB; g++)                                                                        \
        for (int c = 0; c < CHAINS; c++) s[g][c] = (vf16){0};                                           \
    for (int d = 0; d < HD; d += CHAINS)                                                                \
        for (int c = 0; c < CHAINS; c++) {                                                              \
            const vf16 row = in_register(load16(k + (d + c) * 16));                                     \
            for (int g = 0; g < HB; g++) s[g][c] += q[g][d + c] * row;                                  \
        }                                                                                               \
    for (int g = 0; g < HB; g++) store16(out[g], s[g][0] + s[g][1] + s[g][2] + s[g][3]);               \
}

/* acc[g][d0 + d] += sum over the block's first n tokens of p[g][t] V[t][d0 + d] for d < 64 (V rows
 * `stride` floats apart), for HB heads, token by token. */
#define DEFINE_VALUES16(HB)                                                                             \
static inline __attribute__((always_inline)) void values16_##HB(                                        \
        const float *restrict v, int64_t stride, int64_t d0, const float *const *p, int64_t n,          \
        float (*restrict acc)[MAX_HEAD_DIM]) {                                                          \
    vf16 a[HB][4];                                                                                      \
    for (int g = 0; g < HB; g++)                                                                        \
        for (int i = 0; i < 4; i++) a[g][i] = load16(acc[g] + d0 + 16 * i);                             \
    for (int64_t t = 0; t < n; t++) {                                                                   \
        vf16 row[4];                                                                                    \
        for (int i = 0; i < 4; i++) row[i] = in_register(load16(v + t * stride + d0 + 16 * i));         \
        for (int g = 0; g < HB; g++) {                                                                  \
            const float w = p[g][t];                                                                    \
            for (int i = 0; i < 4; i++) a[g][i] += w * row[i];                                          \
        }                                                                                               \
    }                                                                                                   \
    for (int g = 0; g < HB; g++)                                                                        \
        for (int i = 0; i < 4; i++) store16(acc[g] + d0 + 16 * i, a[g][i]);                             \
}

DEFINE_SCORES16(64, 1) DEFINE_SCORES16(64, 2) DEFINE_SCORES16(64, 3) DEFINE_SCORES16(64, 4)
DEFINE_SCORES16(128, 1) DEFINE_SCORES16(128, 2) DEFINE_SCORES16(128, 3) DEFINE_SCORES16(128, 4)
DEFINE_VALUES16(1) DEFINE_VALUES16(2) DEFINE_VALUES16(3) DEFINE_VALUES16(4)

/* The next chunk of a group's heads, `left` of them still to go: at most HEADS_AT_ONCE. head_dim is a
 * literal where the task is inlined, so its switch folds away. */
static inline __attribute__((always_inline)) void scores16(int64_t head_dim, int64_t left, const float *k,
                                                           const float (*q)[MAX_HEAD_DIM], float (*out)[MAX_BLOCK_SIZE]) {
    if (head_dim == 64) {
        switch (left) {
            case 1: scores64_1(k, q, out); break;
            case 2: scores64_2(k, q, out); break;
            case 3: scores64_3(k, q, out); break;
            default: scores64_4(k, q, out); break;
        }
    } else {
        switch (left) {
            case 1: scores128_1(k, q, out); break;
            case 2: scores128_2(k, q, out); break;
            case 3: scores128_3(k, q, out); break;
            default: scores128_4(k, q, out); break;
        }
    }
}

/* A V row in pieces of 64 floats (one at head_dim 64, two at 128), each with the chunk's heads. */
static inline __attribute__((always_inline)) void values16(int64_t head_dim, int64_t left, const float *v,
                                                           const float *const *p, int64_t n, float (*acc)[MAX_HEAD_DIM]) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64)
        switch (left) {
            case 1: values16_1(v, head_dim, d0, p, n, acc); break;
            case 2: values16_2(v, head_dim, d0, p, n, acc); break;
            case 3: values16_3(v, head_dim, d0, p, n, acc); break;
            default: values16_4(v, head_dim, d0, p, n, acc); break;
        }
}

/* AVX2: tiles of (query, head) rows, for the flash task below. With 8-float vectors the general loops
 * load a K or V row per FMA and ran at about 45 % of the FMA units' peak (perf, a 6k prefill). Here
 * several rows of a task (any of its queries and heads that see the block) share each row load: a score
 * is one chain of FMAs over d, a value sum one chain over the block's tokens per dimension, the same
 * whatever rows share the call, so each query still depends on its own context alone. */
#if defined(SIMD_AVX2)
#define SCORE_ROWS 6  /* 2 accumulators a row, 2 loaded K rows and a broadcast: 15 of the 16 registers */

static inline int row_tiles(int64_t head_dim, int64_t block_size) { return block_size == 2 * LANES && head_dim % (4 * LANES) == 0; }

/* out[r][t] = sum_d q[r][d] K[d][t] for R rows, over one block (K transposed: [head_dim][2 * LANES]). */
#define DEFINE_SCORE_ROWS(R)                                                                            \
static inline __attribute__((always_inline)) void score_rows_##R(const float *restrict k, int64_t head_dim, \
                                                                const float *const *q, float *const *out) { \
    vec s[R][2];                                                                                        \
    for (int r = 0; r < R; r++) s[r][0] = s[r][1] = vec_zero();                                         \
    for (int64_t d = 0; d < head_dim; d++) {                                                            \
        const vec k0 = vec_load(k + d * 2 * LANES), k1 = vec_load(k + d * 2 * LANES + LANES);           \
        for (int r = 0; r < R; r++) {                                                                   \
            const vec qd = vec_set1(q[r][d]);                                                           \
            s[r][0] = vec_fmadd(qd, k0, s[r][0]);                                                       \
            s[r][1] = vec_fmadd(qd, k1, s[r][1]);                                                       \
        }                                                                                               \
    }                                                                                                   \
    for (int r = 0; r < R; r++) vec_store(out[r], s[r][0]), vec_store(out[r] + LANES, s[r][1]);        \
}

/* acc[r][d] += sum over t < n of p[r][t] V[t][d] for R rows, W * LANES dimensions at a time, token by
 * token (V: [tokens][head_dim]). A dimension's sum is the same chain whatever R and W: prefill's many
 * rows take 6 at a time, 2 vectors wide (one V row load per 6 rows); a decode's few take 4 vectors, so
 * that 12 independent sums hide the FMA's latency. */
#define DEFINE_VALUE_ROWS(R, W)                                                                         \
static inline __attribute__((always_inline)) void value_rows_##R##_##W(const float *restrict v, int64_t head_dim, \
                                                                      const float *const *p, int64_t n, float *const *acc) { \
    for (int64_t d0 = 0; d0 < head_dim; d0 += W * LANES) {                                              \
        vec a[R][W];                                                                                    \
        for (int r = 0; r < R; r++)                                                                     \
            for (int i = 0; i < W; i++) a[r][i] = vec_load(acc[r] + d0 + i * LANES);                    \
        for (int64_t t = 0; t < n; t++) {                                                               \
            vec row[W];                                                                                 \
            for (int i = 0; i < W; i++) row[i] = vec_load(v + t * head_dim + d0 + i * LANES);           \
            for (int r = 0; r < R; r++) {                                                               \
                const vec w = vec_set1(p[r][t]);                                                        \
                for (int i = 0; i < W; i++) a[r][i] = vec_fmadd(w, row[i], a[r][i]);                    \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < R; r++)                                                                     \
            for (int i = 0; i < W; i++) vec_store(acc[r] + d0 + i * LANES, a[r][i]);                    \
    }                                                                                                   \
}

DEFINE_SCORE_ROWS(1) DEFINE_SCORE_ROWS(2) DEFINE_SCORE_ROWS(3) DEFINE_SCORE_ROWS(4) DEFINE_SCORE_ROWS(5) DEFINE_SCORE_ROWS(6)
DEFINE_VALUE_ROWS(6, 2) DEFINE_VALUE_ROWS(3, 4) DEFINE_VALUE_ROWS(2, 4) DEFINE_VALUE_ROWS(1, 4)

/* Scores of `count` rows, SCORE_ROWS at a time. */
static inline void score_rows(const float *k, int64_t head_dim, const float *const *q, float *const *out, int64_t count) {
    for (int64_t i = 0; i < count; i += SCORE_ROWS) {
        switch (count - i) {
            case 1: score_rows_1(k, head_dim, q + i, out + i); break;
            case 2: score_rows_2(k, head_dim, q + i, out + i); break;
            case 3: score_rows_3(k, head_dim, q + i, out + i); break;
            case 4: score_rows_4(k, head_dim, q + i, out + i); break;
            case 5: score_rows_5(k, head_dim, q + i, out + i); break;
            default: score_rows_6(k, head_dim, q + i, out + i); break;
        }
    }
}

/* Value sums of `count` rows that all take the block's first n tokens. */
static inline void value_rows(const float *v, int64_t head_dim, const float *const *p, int64_t n, float *const *acc,
                              int64_t count) {
    int64_t i = 0;
    for (; i + 6 <= count; i += 6) value_rows_6_2(v, head_dim, p + i, n, acc + i);
    for (; i < count; i += 3) {
        switch (count - i) {
            case 1: value_rows_1_4(v, head_dim, p + i, n, acc + i); break;
            case 2: value_rows_2_4(v, head_dim, p + i, n, acc + i); break;
            default: value_rows_3_4(v, head_dim, p + i, n, acc + i); break;
        }
    }
}
#else  /* the flash task is built everywhere and called where row_tiles() says so */
static inline int row_tiles(int64_t head_dim, int64_t block_size) { (void)head_dim, (void)block_size; return 0; }
static inline void score_rows(const float *k, int64_t head_dim, const float *const *q, float *const *out, int64_t count) {
    (void)k, (void)head_dim, (void)q, (void)out, (void)count;
}
static inline void value_rows(const float *v, int64_t head_dim, const float *const *p, int64_t n, float *const *acc,
                              int64_t count) {
    (void)v, (void)head_dim, (void)p, (void)n, (void)acc, (void)count;
}
#endif

/* The first token a query with `ctx` tokens of context sees: ctx - window under a sliding window (the
 * query itself and the window - 1 before it, as transformers masks), else 0. window 0: none. */
static inline int64_t first_visible(int64_t ctx, int64_t window) { return window && ctx > window ? ctx - window : 0; }

/* Whether a query that sees tokens lo .. ctx - 1 sees any token of block b. */
static inline int block_seen(int64_t b, int64_t block_size, int64_t lo, int64_t ctx) {
    return b * block_size < ctx && (b + 1) * block_size > lo;
}

/* The softmax of one query head's scores over its tokens lo .. ctx - 1, in place. The row is MASKED
 * before lo (a sliding window's start; the scores there may never have been computed) and from ctx to
 * `padded` (a multiple of SCORE_ALIGN, set by ctx alone); it is 64-byte aligned. `sink`, if not NULL,
 * is the head's attention sink (gpt-oss): a logit that joins the denominator and attends to nothing. */
static inline void softmax_row(float *restrict sc, int64_t lo, int64_t ctx, int64_t padded, const float *sink) {
    float m = sc[lo], sum = 0.f;
    for (int64_t t = lo + 1; t < ctx; t++) m = sc[t] > m ? sc[t] : m;
    for (int64_t t = 0; t < lo; t++) sc[t] = MASKED;
    for (int64_t t = ctx; t < padded; t++) sc[t] = MASKED;
    sc = __builtin_assume_aligned(sc, 64);
    /* The vector expf computes an argument below its range (a masked slot's) lane by lane with a
     * scalar call, which cost about a tenth of a prefill's attention: arguments are clamped to
     * EXP_FLOOR and masked slots set to 0 by their index. */
    _Pragma("omp simd reduction(+:sum) aligned(sc:64)")
    for (int64_t t = 0; t < padded; t++) {
        const float x = sc[t] - m, e = expf(x > EXP_FLOOR ? x : EXP_FLOOR);
        sc[t] = t >= lo && t < ctx ? e : 0.f;
        sum += sc[t];
    }
    if (sink) sum += expf(fminf(*sink - m, 80.f));  /* past e^80 the row's weights are 0 in float anyway */
    const float inv = 1.f / sum;
    _Pragma("omp simd aligned(sc:64)")
    for (int64_t t = 0; t < padded; t++) sc[t] *= inv;
}

/* One task: queries [0, nq) of a span (query j sees ctx0 + j tokens), one kv head and its `group`
 * query heads. q rows are q_stride apart; out rows out_stride apart. `scores` holds nq * group rows
 * of `row` floats (64-byte aligned). `tile` is the distance between consecutive blocks' tiles. The pool
 * holds values of type C; SCALED (a quantized pool): k_scale/v_scale point at this kv head's scales in
 * block 0, and `scale_tile` is the distance between consecutive blocks' scales. */
#define DEFINE_TASK(NAME, T, C, LOAD, STORE, TILE, SCALED)                                                     \
static inline __attribute__((always_inline)) void NAME(                                                   \
        const T *q, int64_t q_stride, const C *k_cache, const C *v_cache, const float *k_scale,             \
        const float *v_scale, int64_t scale_tile, const int64_t *table, int64_t ctx0,                       \
        int64_t nq, int64_t group, int64_t head_dim, int64_t block_size, int64_t tile, float scale,         \
        T *out, int64_t out_stride, float *scores, int64_t row, int64_t window, float softcap,             \
        const float *sinks) {                                                                              \
    float qf[Q_TILE][MAX_GROUP][MAX_HEAD_DIM], acc[Q_TILE][MAX_GROUP][MAX_HEAD_DIM];                              \
    tile_t tile_buf;                                                                                       \
    const float *kv = tile_buf.f;                                                                          \
    const int64_t ctx_max = ctx0 + nq - 1, num_blocks = (ctx_max + block_size - 1) / block_size;          \
    /* With a sliding window, query j sees tokens first(j) .. ctx0 + j - 1: blocks before the tile's     \
     * first visible token are never read. */                                                          \
    const int64_t b0 = first_visible(ctx0, window) / block_size;                                           \
    for (int64_t j = 0; j < nq; j++)                                                                       \
        for (int64_t g = 0; g < group; g++)                                                                \
            for (int64_t d = 0; d < head_dim; d++) qf[j][g][d] = LOAD(q[j * q_stride + g * head_dim + d]) * scale; \
    for (int64_t b = b0; b < b0 + PREFETCH_BLOCKS && b < num_blocks; b++)                                  \
        prefetch_tile(k_cache + table[b] * tile, head_dim * block_size * sizeof(C));                       \
    for (int64_t b = b0; b < num_blocks; b++) {  /* scores: s[t] += q[d] * K[d][t] */                    \
        const C *k = k_cache + table[b] * tile;                                                            \
        const float *ks = SCALED ? k_scale + table[b] * scale_tile : NULL;                                 \
        if (b + PREFETCH_BLOCKS < num_blocks) {                                                            \
            prefetch_tile(k_cache + table[b + PREFETCH_BLOCKS] * tile, head_dim * block_size * sizeof(C)); \
            if (SCALED) prefetch_tile(k_scale + table[b + PREFETCH_BLOCKS] * scale_tile, block_size * sizeof(float)); \
        }                                                                                                  \
        prefetch_tile(v_cache + table[b] * tile, head_dim * block_size * sizeof(C));                       \
        if (SCALED) prefetch_tile(v_scale + table[b] * scale_tile, block_size * sizeof(float));            \
        TILE(k, &tile_buf, head_dim * block_size);                                                         \
        for (int64_t j = 0; j < nq; j++) {                                                                 \
            if (b * block_size >= ctx0 + j) continue;  /* this query's context ends before the block */   \
            if ((b + 1) * block_size <= first_visible(ctx0 + j, window)) continue;  /* or its window starts after */ \
            float sums[MAX_GROUP][MAX_BLOCK_SIZE];                                                         \
            if (vector_shape(head_dim, block_size)) {                                                      \
                for (int64_t g = 0; g < group; g += HEADS_AT_ONCE)                                         \
                    scores16(head_dim, group - g, kv, (const float (*)[MAX_HEAD_DIM])qf[j][g], sums + g);  \
            } else {                                                                                       \
                for (int64_t g = 0; g < group; g++) {                                                      \
                    /* CHAINS partial sums (d mod CHAINS) keep that many FMAs in flight. */                \
                    float s[CHAINS][MAX_BLOCK_SIZE] = {{0}};                                               \
                    for (int64_t d = 0; d < head_dim; d += CHAINS)                                         \
                        for (int64_t c = 0; c < CHAINS; c++) {                                             \
                            _Pragma("omp simd")                                                            \
                            for (int64_t t = 0; t < block_size; t++)                                       \
                                s[c][t] += qf[j][g][d + c] * kv[(d + c) * block_size + t];                 \
                        }                                                                                  \
                    _Pragma("omp simd")                                                                    \
                    for (int64_t t = 0; t < block_size; t++) sums[g][t] = s[0][t] + s[1][t] + s[2][t] + s[3][t]; \
                }                                                                                          \
            }                                                                                              \
            for (int64_t g = 0; g < group; g++) {                                                          \
                float *dst = scores + (j * group + g) * row + b * block_size;                              \
                _Pragma("omp simd")                                                                        \
                for (int64_t t = 0; t < block_size; t++) {                                                 \
                    const float score = SCALED ? sums[g][t] * ks[t] : sums[g][t];  /* the token's K scale */ \
                    dst[t] = softcap > 0.f ? softcap * tanhf(score / softcap) : score;                     \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t j = 0; j < nq; j++)                                                                       \
        for (int64_t g = 0; g < group; g++)                                                                \
            softmax_row(scores + (j * group + g) * row, first_visible(ctx0 + j, window), ctx0 + j,         \
                        round_up(ctx0 + j, SCORE_ALIGN), sinks ? sinks + g : NULL);                        \
    for (int64_t j = 0; j < nq; j++)                                                                       \
        for (int64_t g = 0; g < group; g++)                                                                \
            for (int64_t d = 0; d < head_dim; d++) acc[j][g][d] = 0.f;                                     \
    for (int64_t b = b0; b < num_blocks; b++) {  /* acc[d] += p[t] * V[t][d] */                          \
        const C *v = v_cache + table[b] * tile;                                                            \
        const float *vs = SCALED ? v_scale + table[b] * scale_tile : NULL;                                 \
        const int64_t rows = ctx_max - b * block_size < block_size ? ctx_max - b * block_size : block_size; \
        TILE(v, &tile_buf, rows * head_dim);                                                               \
        for (int64_t j = 0; j < nq; j++) {                                                                 \
            const int64_t ctx = ctx0 + j;                                                                  \
            if (b * block_size >= ctx || (b + 1) * block_size <= first_visible(ctx, window)) continue;     \
            const int64_t n = ctx - b * block_size < block_size ? ctx - b * block_size : block_size;       \
            const float *ps[MAX_GROUP];  /* each head's weights of the block's tokens */                 \
            float pv[MAX_GROUP][MAX_BLOCK_SIZE];  /* the weights times the tokens' V scales */            \
            for (int64_t g = 0; g < group; g++) {                                                          \
                ps[g] = scores + (j * group + g) * row + b * block_size;                                   \
                if (SCALED) {                                                                              \
                    for (int64_t t = 0; t < n; t++) pv[g][t] = ps[g][t] * vs[t];                           \
                    ps[g] = pv[g];                                                                         \
                }                                                                                          \
            }                                                                                              \
            if (vector_shape(head_dim, block_size)) {                                                      \
                for (int64_t g = 0; g < group; g += HEADS_AT_ONCE)                                         \
                    values16(head_dim, group - g, kv, ps + g, n, acc[j] + g);                              \
                continue;                                                                                  \
            }                                                                                              \
            for (int64_t g = 0; g < group; g++) {                                                          \
                const float *p = ps[g];                                                                    \
                float *a = acc[j][g];                                                                      \
                int64_t t = 0;                                                                             \
                for (; t + 4 <= n; t += 4) {  /* four rows per pass: a quarter of the acc loads and stores */ \
                    const float *r = kv + t * head_dim;                                                    \
                    _Pragma("omp simd")                                                                    \
                    for (int64_t d = 0; d < head_dim; d++)                                                 \
                        a[d] += p[t] * r[d] + p[t + 1] * r[head_dim + d] + p[t + 2] * r[2 * head_dim + d]  \
                                + p[t + 3] * r[3 * head_dim + d];                                          \
                }                                                                                          \
                for (; t < n; t++) {                                                                       \
                    _Pragma("omp simd")                                                                    \
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p[t] * kv[t * head_dim + d];            \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t j = 0; j < nq; j++)                                                                       \
        for (int64_t g = 0; g < group; g++)                                                                \
            for (int64_t d = 0; d < head_dim; d++) out[j * out_stride + g * head_dim + d] = STORE(acc[j][g][d]); \
}

/* -- Row tiles with an online softmax (AVX2) -----------------------------------------------------------
 *
 * The vector task above keeps a score row as long as each query's context (8 queries times the group's
 * heads times 6,000 tokens: 576 KB at SmolLM2's shapes, more than Zen 3's L2), and its AVX2 loops load a
 * K or V row per FMA. This task is flash attention's order: it walks the context STEP_BLOCKS blocks at
 * a time, aligned to absolute positions; per step the scores of every row that sees the step (row tiles
 * sharing each K row), then per row the step's max m, p = e^(s - m) and the running sum l (SUM_LANES
 * partial sums, added up at the end), the row's sums rescaled by e^(m_old - m) where the max rose, then
 * p . V (row tiles sharing each V row). The output is the sums over l. A float32 pool is read where it
 * lies (a block's K rows serve every row tile from L1). On Zen 3 a 6,000-token prefill's attention took
 * 0.80 times the vector task's time (SmolLM2's and Qwen2.5-0.5B's shapes, one layer, alternated).
 * A row's arithmetic depends on its own context alone: the steps it sees, in order, each summed over
 * all its STEP_BLOCKS * block_size positions (0 where it sees none), so its bits are the same in a
 * prefill, a chunk or a decode, whatever else runs. */
#define STEP_BLOCKS 8
#define FLASH_ROWS 128  /* (query, head) rows of a task: a long context is read once for up to 128 / group queries */
#define STEP_KEYS (STEP_BLOCKS * 16)  /* row_tiles() takes blocks of 16 tokens */
#define SUM_LANES 8  /* a row's running sum l, in this many partial sums (added up at the end) */

/* e^x for EXP_FLOOR <= x <= 0, to float32 precision: 2^(x log2 e) as an integer power of two times
 * 2^f, f in [-0.5, 0.5], by EXP2_POLY. Plain C that vectorizes in the loop below: the vector library's
 * expf cost about as much as a score's FMAs. */
static inline float exp_nonpositive(float x) {
    const float t = x * 1.44269504f, n = __builtin_floorf(t + 0.5f), f = t - n;
    float p = EXP2_POLY[0];
    for (int i = 1; i < 7; i++) p = p * f + EXP2_POLY[i];
    union { uint32_t u; float f; } scale = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* One row's softmax step over its scores s at positions pos0 .. pos0 + n - 1, of which it sees lo ..
 * ctx - 1: s becomes p = e^(s - m) (0 where unseen), with m the row's running max; its sums l and acc
 * are rescaled by e^(m_old - m) and l gets the step's p (n a multiple of SUM_LANES). One compiled body
 * for every caller (noinline), so -ffast-math contracts it the same way everywhere. */
__attribute__((noinline)) static void online_softmax_step(float *restrict s, int64_t n, int64_t pos0, int64_t lo,
                                                          int64_t ctx, float softcap, float *m, int *started,
                                                          float *restrict l, float *restrict acc, int64_t head_dim) {
    const int64_t t0 = lo > pos0 ? lo - pos0 : 0, t1 = ctx - pos0 < n ? ctx - pos0 : n;
    if (softcap > 0.f)
        for (int64_t t = t0; t < t1; t++) s[t] = softcap * tanhf(s[t] / softcap);
    float step_max = s[t0];
    for (int64_t t = t0 + 1; t < t1; t++) step_max = s[t] > step_max ? s[t] : step_max;
    const float top = *started && *m > step_max ? *m : step_max;
    const float alpha = *started ? expf(*m - top) : 0.f;  /* exactly 1 while the max holds */
    _Pragma("omp simd")
    for (int64_t t = 0; t < n; t++) {  /* unseen positions by index: their scores may be anything */
        const float x = s[t] - top, e = exp_nonpositive(x > EXP_FLOOR ? x : EXP_FLOOR);
        s[t] = t >= t0 && t < t1 ? e : 0.f;
    }
    float sum[SUM_LANES];
    for (int i = 0; i < SUM_LANES; i++) sum[i] = 0.f;
    for (int64_t t = 0; t < n; t += SUM_LANES)
        for (int i = 0; i < SUM_LANES; i++) sum[i] += s[t + i];
    for (int i = 0; i < SUM_LANES; i++) l[i] = l[i] * alpha + sum[i];
    if (alpha != 1.f)
        for (int64_t d = 0; d < head_dim; d++) acc[d] *= alpha;
    *m = top;
    *started = 1;
}

/* One task (same arguments as the vector task's, without its score rows). */
#define DEFINE_FLASH_TASK(NAME, T, C, LOAD, STORE, TILE, SCALED)                                               \
static void NAME(const T *q, int64_t q_stride, const C *k_cache, const C *v_cache, const float *k_scale,        \
                 const float *v_scale, int64_t scale_tile, const int64_t *table, int64_t ctx0, int64_t nq,       \
                 int64_t group, int64_t head_dim, int64_t block_size, int64_t tile, float scale, T *out,         \
                 int64_t out_stride, int64_t window, float softcap, const float *sinks) {                       \
    enum { ROWS = FLASH_ROWS };                                                                            \
    _Alignas(64) float qf[ROWS][MAX_HEAD_DIM], acc[ROWS][MAX_HEAD_DIM], p[ROWS][STEP_KEYS];                 \
    _Alignas(64) float l[ROWS][SUM_LANES];                                                                 \
    float m[ROWS];                                                                                         \
    int started[ROWS];                                                                                     \
    int64_t ctx[ROWS], lo[ROWS];  /* row r's context and the first token it sees */                      \
    tile_t tile_buf;                                                                                       \
    const float *kv = tile_buf.f;                                                                          \
    enum { IN_PLACE = sizeof(C) == sizeof(float) && !SCALED };  /* a float32 pool is read where it lies */ \
    const int64_t rows = nq * group, step_keys = STEP_BLOCKS * block_size;                                 \
    const int64_t ctx_max = ctx0 + nq - 1, num_blocks = (ctx_max + block_size - 1) / block_size;          \
    for (int64_t r = 0; r < rows; r++) {  /* row r: query r / group, head r % group */                   \
        for (int64_t d = 0; d < head_dim; d++)                                                             \
            qf[r][d] = LOAD(q[r / group * q_stride + r % group * head_dim + d]) * scale, acc[r][d] = 0.f;  \
        for (int i = 0; i < SUM_LANES; i++) l[r][i] = 0.f;                                                 \
        started[r] = 0, ctx[r] = ctx0 + r / group, lo[r] = first_visible(ctx[r], window);                   \
    }                                                                                                      \
    const int64_t b0 = first_visible(ctx0, window) / block_size / STEP_BLOCKS * STEP_BLOCKS;               \
    for (int64_t b = b0; b < b0 + PREFETCH_BLOCKS && b < num_blocks; b++)                                  \
        prefetch_tile(k_cache + table[b] * tile, head_dim * block_size * sizeof(C));                       \
    for (int64_t sb = b0; sb < num_blocks; sb += STEP_BLOCKS) {                                            \
        const int64_t nb = num_blocks - sb < STEP_BLOCKS ? num_blocks - sb : STEP_BLOCKS;                  \
        const int64_t pos0 = sb * block_size;                                                              \
        for (int64_t b = sb; b < sb + nb; b++) {  /* scores: p[r][t] = q . K[t] */                        \
            const C *k = k_cache + table[b] * tile;                                                        \
            if (b + PREFETCH_BLOCKS < num_blocks)                                                          \
                prefetch_tile(k_cache + table[b + PREFETCH_BLOCKS] * tile, head_dim * block_size * sizeof(C)); \
            prefetch_tile(v_cache + table[b] * tile, head_dim * block_size * sizeof(C));                   \
            if (IN_PLACE) kv = (const float *)k; else TILE(k, &tile_buf, head_dim * block_size);            \
            const float *qs[ROWS];                                                                         \
            float *outs[ROWS];                                                                             \
            int64_t count = 0;                                                                             \
            for (int64_t r = 0; r < rows; r++)                                                             \
                if (block_seen(b, block_size, lo[r], ctx[r]))                                               \
                    qs[count] = qf[r], outs[count++] = p[r] + (b - sb) * block_size;                       \
            score_rows(kv, head_dim, qs, outs, count);                                                     \
            if (SCALED) {  /* each token's K scale multiplies its score */                                \
                const float *ks = k_scale + table[b] * scale_tile;                                         \
                for (int64_t i = 0; i < count; i++)                                                        \
                    for (int64_t t = 0; t < block_size; t++) outs[i][t] *= ks[t];                          \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t r = 0; r < rows; r++) {  /* the online softmax step of each row that sees the step */ \
            if (pos0 >= ctx[r] || pos0 + step_keys <= lo[r]) continue;                                     \
            online_softmax_step(p[r], step_keys, pos0, lo[r], ctx[r], softcap, &m[r], &started[r], l[r], acc[r], head_dim); \
        }                                                                                                  \
        for (int64_t b = sb; b < sb + nb; b++) {  /* acc[r] += p[r] . V, rows that take the same n tokens at once */ \
            const C *v = v_cache + table[b] * tile;                                                        \
            const int64_t keys = ctx_max - b * block_size < block_size ? ctx_max - b * block_size : block_size; \
            if (IN_PLACE) kv = (const float *)v; else TILE(v, &tile_buf, keys * head_dim);                  \
            const float *vs = SCALED ? v_scale + table[b] * scale_tile : NULL;                             \
            const float *ps[ROWS];                                                                         \
            float *accs[ROWS];                                                                             \
            int64_t count = 0, run_n = 0;                                                                  \
            for (int64_t r = 0; r < rows; r++) {                                                           \
                if (!block_seen(b, block_size, lo[r], ctx[r])) continue;                                   \
                const int64_t n = ctx[r] - b * block_size < block_size ? ctx[r] - b * block_size : block_size; \
                float *pr = p[r] + (b - sb) * block_size;                                                  \
                if (SCALED)  /* each token's V scale multiplies its weight */                             \
                    for (int64_t t = 0; t < n; t++) pr[t] *= vs[t];                                        \
                if (count && n != run_n) value_rows(kv, head_dim, ps, run_n, accs, count), count = 0;     \
                run_n = n, ps[count] = pr, accs[count++] = acc[r];                                         \
            }                                                                                              \
            if (count) value_rows(kv, head_dim, ps, run_n, accs, count);                                   \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t r = 0; r < rows; r++) {                                                                   \
        float sum = 0.f;                                                                                   \
        for (int i = 0; i < SUM_LANES; i++) sum += l[r][i];                                                \
        if (sinks) sum += expf(fminf(sinks[r % group] - m[r], 80.f));  /* as softmax_row */                \
        const float inv = 1.f / sum;                                                                       \
        T *o = out + r / group * out_stride + r % group * head_dim;                                        \
        for (int64_t d = 0; d < head_dim; d++) o[d] = STORE(acc[r][d] * inv);                              \
    }                                                                                                      \
}

/* -- AMX: prefill and decode attention as tile matrix work (bf16 pool, CPUs with AMX-BF16) ----------
 *
 * On Sapphire Rapids and later the float32 vector passes above leave the matrix units idle: a 6k-token
 * prefill of SmolLM2 spent two thirds of its time here. This path is flash attention's tiling: a task is
 * (span, block of queries, kv head); its rows are (query, head of the group) pairs, AMX_ROWS to a tile,
 * and it walks the context AMX_KV keys at a time, aligned to absolute positions. Per step:
 *   scores = Q . K^T       tdpbf16ps, bf16 pairs summed into float32 (16 rows x 16 keys per tile)
 *   online softmax          per row, in AVX-512: the running max m (moved only when a score passes it by
 *                           LAZY_MAX), sum l, p = e^(s - m) rounded to bf16
 *   acc = acc * alpha + P.V tdpbf16ps into a fresh tile, then one float32 FMA per value
 * and the output is acc / l. A row's arithmetic depends on its own context alone: the steps it sees are
 * the aligned AMX_KV-key tiles that hold any of its visible keys, in order, and a step with none is not
 * applied to it at all. Each output element of a tile instruction is its own row's dot product, whatever
 * the other rows hold. So a query gives the same bits in a prefill, a chunk or a decode (where its rows
 * are just the group's heads), and whatever else shares the step. The softmax and the accumulation are
 * noinline functions: one compiled body for every caller, so -ffast-math cannot contract them
 * differently in different places.
 *
 * The pool keeps its layout: each step repacks its keys and values into the pairs layout tdpbf16ps reads
 * (K: pairs of dimensions per key; V: pairs of keys per dimension), once for all the task's rows.
 * MINIVLLM_NO_AMX=1 turns the path off (the vector kernel above then runs), to compare the two (amx.h). */
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define AMX_ROWS 16         /* tile rows: (query, head) pairs */
#define AMX_KV 32           /* keys per step: one tdpbf16ps's depth for P.V */
#define AMX_TASK_ROWS 128   /* rows per task: its queries' state (acc, m, l) stays in L2 */
#define AMX_AHEAD 2         /* steps of keys prefetched ahead */
#define LAZY_MAX 8.f        /* how far (log2 units) a score may pass a row's max before the max moves */

/* Every tile 16 rows of 64 bytes: tmm0-1 scores, the others the products' operands. */
static inline void configure_attention_tiles(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    configure_tiles(rows, colsb);
}

/* Two rows of 16 bf16 into one row of pairs: a[0] b[0] a[1] b[1] ... */
static inline __m512i interleave16(const uint16_t *a, const uint16_t *b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const void *)a)),
                                            _mm256_loadu_si256((const void *)b), 1);
    return _mm512_permutexvar_epi16(idx, both);
}

/* 2^t for t <= 0, to float32 precision: an integer and a fraction in [-0.5, 0.5], whose power of two
 * is EXP2_POLY. Scores come here already
 * times log2(e) (with the softmax scale, one multiply), so the softmax is e^(score - max). */
static inline __m512 exp2_512(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
    return _mm512_scalef_ps(p, n);
}

/* A row's running state: m (max), l (the sum of e^(s - m), kept as 16 lanes and added up at the end: no
 * horizontal sum per step), and whether a step has been applied yet. */
typedef struct { float l[16], m, alpha; int32_t started, applied; } RowState;  /* m: in log2 units */

/* The softmax step of one tile of rows over keys pos0 .. pos0 + AMX_KV - 1: scores s [AMX_ROWS][AMX_KV]
 * (unscaled) -> p as bf16 [AMX_ROWS][AMX_KV] and each row's state. Row r sees keys lo[r] .. ctx[r] - 1;
 * a row with none of them in the step is not applied (applied = 0, p = 0). */
__attribute__((noinline)) static void softmax_step(const float *restrict s, uint16_t *restrict p, int rows,
                                                   const int64_t *ctx, const int64_t *lo, int64_t pos0,
                                                   float scale, float softcap, RowState *st) {
    const __m512i pos_a = _mm512_add_epi32(_mm512_set1_epi32((int)pos0),
                                           _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512i pos_b = _mm512_add_epi32(pos_a, _mm512_set1_epi32(16));
    /* With a softcap the scale comes first and log2(e) after the cap; else both in one multiply. */
    const float to_log2 = 1.44269504f;
    const __m512 scale_v = _mm512_set1_ps(softcap > 0.f ? scale : scale * to_log2), low = _mm512_set1_ps(MASKED);
    for (int r = 0; r < AMX_ROWS; r++) {
        uint16_t *pr = p + r * AMX_KV;
        st[r].applied = 0;
        if (r >= rows || pos0 >= ctx[r] || pos0 + AMX_KV <= lo[r]) {
            memset(pr, 0, AMX_KV * sizeof(uint16_t));
            continue;
        }
        __mmask16 va = 0xFFFF, vb = 0xFFFF;
        if (pos0 < lo[r] || pos0 + AMX_KV > ctx[r]) {  /* the step holds an end of the row's keys */
            const __m512i c = _mm512_set1_epi32((int)ctx[r]), l0 = _mm512_set1_epi32((int)lo[r]);
            va = _mm512_cmplt_epi32_mask(pos_a, c) & _mm512_cmpge_epi32_mask(pos_a, l0);
            vb = _mm512_cmplt_epi32_mask(pos_b, c) & _mm512_cmpge_epi32_mask(pos_b, l0);
        }
        __m512 sa = _mm512_mul_ps(_mm512_loadu_ps(s + r * AMX_KV), scale_v);
        __m512 sb = _mm512_mul_ps(_mm512_loadu_ps(s + r * AMX_KV + 16), scale_v);
        if (softcap > 0.f) {
            float t[AMX_KV];
            _mm512_storeu_ps(t, sa);
            _mm512_storeu_ps(t + 16, sb);
            for (int i = 0; i < AMX_KV; i++) t[i] = softcap * tanhf(t[i] / softcap) * to_log2;
            sa = _mm512_loadu_ps(t);
            sb = _mm512_loadu_ps(t + 16);
        }
        /* The row's max moves only when a score passes it by more than LAZY_MAX (log2 units): below that
         * p stays under 2^LAZY_MAX, exact enough in float32 and bf16, and the step skips the horizontal max
         * and the rescale (flash attention 4's lazy rescaling). The choice depends on the row's scores alone. */
        float m = st[r].m;
        const __m512 bound = _mm512_set1_ps(m + LAZY_MAX);
        if (!st[r].started || _mm512_mask_cmp_ps_mask(va, sa, bound, _CMP_GT_OQ) |
                                  _mm512_mask_cmp_ps_mask(vb, sb, bound, _CMP_GT_OQ))
            m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_blend_ps(va, low, sa),  /* above m when started */
                                                   _mm512_mask_blend_ps(vb, low, sb)));
        const __m512 mv = _mm512_set1_ps(m);
        const __m512 ea = _mm512_maskz_mov_ps(va, exp2_512(_mm512_sub_ps(sa, mv)));
        const __m512 eb = _mm512_maskz_mov_ps(vb, exp2_512(_mm512_sub_ps(sb, mv)));
        /* alpha rescales what the row has summed so far: 0 before its first step, exactly 1 while its
         * max holds. */
        const float alpha = !st[r].started ? 0.f : m > st[r].m ? exp2f(st[r].m - m) : 1.f;
        _mm512_storeu_ps(st[r].l, _mm512_fmadd_ps(_mm512_loadu_ps(st[r].l), _mm512_set1_ps(alpha), _mm512_add_ps(ea, eb)));
        st[r].m = m;
        st[r].alpha = alpha;
        st[r].started = st[r].applied = 1;
        _mm512_storeu_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(eb, ea));
    }
}

/* A row's sum l, its 16 lanes added in one fixed order. */
__attribute__((noinline)) static float row_sum(const RowState *st) { return _mm512_reduce_add_ps(_mm512_loadu_ps(st->l)); }

/* acc[r][d0 .. d0 + 15] = acc * alpha + pv[r] for the applied rows of a tile. */
__attribute__((noinline)) static void accumulate_step(float *restrict acc, int64_t acc_stride, const float *restrict pv,
                                                      const RowState *st) {
    for (int r = 0; r < AMX_ROWS; r++) {
        if (!st[r].applied) continue;
        float *a = acc + r * acc_stride;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(st[r].alpha), _mm512_loadu_ps(pv + 16 * r)));
    }
}

/* Keys pos0 .. pos0 + AMX_KV - 1 of one kv head into tdpbf16ps's B layouts. kp[(h * steps + s) * 512]: the
 * 16 keys of half h, dimensions s*32 .. s*32 + 31, a row per pair of dimensions; vp[n * 512]: dimensions
 * n*16 .. n*16 + 15, a row per pair of keys. Keys at or past `ctx_max` (never written, or written by
 * nobody this task reads) are zeros, so that a zero weight never meets a stale NaN. */
static void repack_step(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table, int64_t tile,
                        int64_t block_size, int64_t head_dim, int64_t pos0, int64_t ctx_max, uint16_t *kp,
                        uint16_t *vp) {
    const int64_t steps = head_dim / 32;
    static const uint16_t zeros[16];
    for (int h = 0; h < 2; h++) {
        const int64_t pos = pos0 + 16 * h;
        const uint16_t *kt = pos < ctx_max ? k_cache + table[pos / block_size] * tile + pos % block_size : NULL;
        for (int64_t s = 0; s < steps; s++)
            for (int i = 0; i < 16; i++) {
                const int64_t d = s * 32 + 2 * i;
                const __m512i row = kt ? interleave16(kt + d * block_size, kt + (d + 1) * block_size) : _mm512_setzero_si512();
                _mm512_storeu_si512(kp + ((h * steps + s) * 16 + i) * 32, row);
            }
    }
    for (int i = 0; i < 16; i++) {
        const uint16_t *rows[2];
        for (int e = 0; e < 2; e++) {
            const int64_t pos = pos0 + 2 * i + e;
            rows[e] = pos < ctx_max ? v_cache + table[pos / block_size] * tile + (pos % block_size) * head_dim : NULL;
        }
        for (int64_t n = 0; n < head_dim / 16; n++)
            _mm512_storeu_si512(vp + (n * 16 + i) * 32, interleave16(rows[0] ? rows[0] + n * 16 : zeros,
                                                                     rows[1] ? rows[1] + n * 16 : zeros));
    }
}

/* The scores of a tile of Q rows (q_stride elements apart) against the step's keys (kp: per half, per 32
 * dimensions), into tmm0 (keys 0-15) and tmm1 (16-31); qk_store writes them out as s [AMX_ROWS][AMX_KV].
 * Each k step loads its operands into registers of its own, so that the products overlap. */
static inline void qk_issue(const uint16_t *q, int64_t q_stride, const uint16_t *kp, int64_t steps) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < steps; k += 2) {
        _tile_loadd(2, q + k * 32, q_stride * sizeof(uint16_t));
        _tile_loadd(3, kp + k * 512, 64);
        _tile_loadd(4, kp + (steps + k) * 512, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        if (k + 1 < steps) {
            _tile_loadd(5, q + (k + 1) * 32, q_stride * sizeof(uint16_t));
            _tile_loadd(6, kp + (k + 1) * 512, 64);
            _tile_loadd(7, kp + (steps + k + 1) * 512, 64);
            _tile_dpbf16ps(0, 5, 6);
            _tile_dpbf16ps(1, 5, 7);
        }
    }
}

static inline void qk_store(float *s) {
    _tile_stored(0, s, AMX_KV * sizeof(float));
    _tile_stored(1, s + 16, AMX_KV * sizeof(float));
}

/* p (AMX_ROWS x AMX_KV bf16) . four 16-dimension tiles of the values (vp) into tmm4-7, each from a fresh
 * zero, their V operands in registers of their own; pv_store writes them out as pv[i] [AMX_ROWS][16]. */
static inline void pv_issue(const uint16_t *p, const uint16_t *vp) {
    _tile_loadd(2, p, AMX_KV * sizeof(uint16_t));
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(0, vp, 64);
    _tile_loadd(1, vp + 512, 64);
    _tile_loadd(3, vp + 1024, 64);
    _tile_dpbf16ps(4, 2, 0);
    _tile_dpbf16ps(5, 2, 1);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(0, vp + 1536, 64);
    _tile_dpbf16ps(7, 2, 0);
}

static inline void pv_store(float *pv) {
    _tile_stored(4, pv, 64);
    _tile_stored(5, pv + 256, 64);
    _tile_stored(6, pv + 512, 64);
    _tile_stored(7, pv + 768, 64);
}

/* Four 16-dimension tiles of products pv into the rows' sums at acc (rows head_dim apart). */
static inline void accumulate4(float *acc, int64_t head_dim, const float *pv, const RowState *st) {
    for (int64_t i = 0; i < 4; i++) accumulate_step(acc + i * 16, head_dim, pv + i * AMX_ROWS * 16, st);
}

/* One task: queries [0, nq) of a span (query j sees ctx0 + j tokens), one kv head and its `group` heads,
 * rows r = j * group + g. Same arguments as the vector task. */
static void amx_task(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                     const int64_t *table, int64_t ctx0, int64_t nq, int64_t group, int64_t head_dim,
                     int64_t block_size, int64_t tile, float scale, uint16_t *out, int64_t out_stride,
                     int64_t window, float softcap, const float *sinks) {
    const int64_t rows = nq * group, tiles = (rows + AMX_ROWS - 1) / AMX_ROWS, padded = tiles * AMX_ROWS;
    const int64_t steps = head_dim / 32, ctx_max = ctx0 + nq - 1;
    uint16_t *qb = aligned_alloc(64, sizeof(uint16_t) * padded * head_dim);
    float *acc = aligned_alloc(64, sizeof(float) * padded * head_dim);
    int64_t *ctx = malloc(sizeof(int64_t) * 2 * padded), *lo = ctx + padded;
    RowState *st = calloc(padded, sizeof(RowState));
    int64_t *active = malloc(sizeof(int64_t) * tiles);
    uint16_t *kp = aligned_alloc(64, sizeof(uint16_t) * 2 * steps * 512), *vp = aligned_alloc(64, sizeof(uint16_t) * head_dim * 32);
    _Alignas(64) float s[2][AMX_ROWS * AMX_KV], pv[2][4 * AMX_ROWS * 16];  /* two of each: the pipeline */
    _Alignas(64) uint16_t p[AMX_ROWS * AMX_KV];
    memset(qb, 0, sizeof(uint16_t) * padded * head_dim);
    memset(acc, 0, sizeof(float) * padded * head_dim);
    for (int64_t r = 0; r < padded; r++) {
        const int64_t j = r / group, g = r % group;
        ctx[r] = r < rows ? ctx0 + j : 0;
        lo[r] = r < rows ? first_visible(ctx0 + j, window) : 0;
        if (r < rows) memcpy(qb + r * head_dim, q + j * q_stride + g * head_dim, sizeof(uint16_t) * head_dim);
    }
    configure_attention_tiles();
    for (int64_t pos0 = first_visible(ctx0, window) / AMX_KV * AMX_KV; pos0 < ctx_max; pos0 += AMX_KV) {
        /* The K and V tiles AMX_AHEAD steps on: a decode's few rows leave the step too little work to hide
         * a block's misses, and the blocks' jumps defeat the hardware prefetcher until it sees a block's
         * first lines (start_stream). */
        for (int64_t pos = pos0 + AMX_AHEAD * AMX_KV; pos < pos0 + (AMX_AHEAD + 1) * AMX_KV && pos < ctx_max; pos += block_size) {
            start_stream(k_cache + table[pos / block_size] * tile);
            start_stream(v_cache + table[pos / block_size] * tile);
        }
        repack_step(k_cache, v_cache, table, tile, block_size, head_dim, pos0, ctx_max, kp, vp);
        int64_t count = 0;  /* the tiles with a row that sees a key of the step */
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r0 = t * AMX_ROWS, n = rows - r0 < AMX_ROWS ? rows - r0 : AMX_ROWS;
            if (pos0 < ctx[r0 + n - 1] && pos0 + AMX_KV > lo[r0]) active[count++] = t;
        }
        /* A pipeline over the tiles: the unit computes the next tile's scores while the vector pipes run
         * this one's softmax, and a tile's P.V products while they add the last ones into the sums. */
        if (count) {
            qk_issue(qb + active[0] * AMX_ROWS * head_dim, head_dim, kp, steps);
            qk_store(s[0]);
        }
        float *pending = NULL, *pending_acc = NULL;  /* products stored, not yet added */
        const RowState *pending_st = NULL;
        int64_t stored = 0;
        for (int64_t i = 0; i < count; i++) {
            const int64_t r0 = active[i] * AMX_ROWS, n = rows - r0 < AMX_ROWS ? rows - r0 : AMX_ROWS;
            if (i + 1 < count) qk_issue(qb + active[i + 1] * AMX_ROWS * head_dim, head_dim, kp, steps);
            softmax_step(s[i & 1], p, (int)n, ctx + r0, lo + r0, pos0, scale, softcap, st + r0);
            if (i + 1 < count) qk_store(s[(i + 1) & 1]);
            for (int64_t d = 0; d < head_dim / 16; d += 4) {
                pv_issue(p, vp + d * 512);
                if (pending) accumulate4(pending_acc, head_dim, pending, pending_st);
                pending = pv[stored++ & 1];
                pending_acc = acc + r0 * head_dim + d * 16;
                pending_st = st + r0;
                pv_store(pending);
            }
        }
        if (pending) accumulate4(pending_acc, head_dim, pending, pending_st);  /* before the next softmax */
    }
    _tile_release();
    for (int64_t r = 0; r < rows; r++) {
        const int64_t j = r / group, g = r % group;
        float sum = row_sum(st + r);
        if (sinks) sum += exp2f(fminf(sinks[g] * 1.44269504f - st[r].m, 126.f));  /* m is in log2 units */
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < head_dim; d++) out[j * out_stride + g * head_dim + d] = float_to_bf16(acc[r * head_dim + d] * inv);
    }
    free(qb), free(acc), free(ctx), free(st), free(active), free(kp), free(vp);
}

/* paged_attention_bf16 on the tiles, or 0 where this path does not apply (the caller runs the vector
 * kernel): head_dim a multiple of 64, blocks a multiple of 16 tokens. */
static int paged_attention_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int64_t *block_tables, int64_t max_blocks, const int64_t *span_start,
                               const int64_t *span_len, const int64_t *span_ctx0, int64_t num_spans, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                               float softcap, const float *sinks, uint16_t *out) {
    if (!amx_tiles_ready() || head_dim % 64 || block_size % 16) return 0;
    const int64_t group = num_heads / num_kv_heads, head_tile = head_dim * block_size;
    const int64_t tile = num_kv_heads * head_tile, out_stride = num_heads * head_dim;
    const int64_t per_task = AMX_TASK_ROWS / group > 0 ? AMX_TASK_ROWS / group : 1;  /* queries */
    int64_t num_tasks = 0;
    for (int64_t s = 0; s < num_spans; s++) num_tasks += (span_len[s] + per_task - 1) / per_task;
    int64_t (*tasks)[2] = malloc(sizeof(int64_t[2]) * num_tasks);
    for (int64_t s = 0, n = 0; s < num_spans; s++)  /* the longest contexts first, for load balance */
        for (int64_t i = (span_len[s] - 1) / per_task * per_task; i >= 0; i -= per_task) { tasks[n][0] = s; tasks[n++][1] = i; }
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")
    for (int64_t n = 0; n < num_tasks; n++)
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {
            const int64_t s = tasks[n][0], i = tasks[n][1], start = span_start[s] + i;
            const int64_t nq = span_len[s] - i < per_task ? span_len[s] - i : per_task;
            amx_task(q + start * q_stride + kh * group * head_dim, q_stride, k_cache + kh * head_tile,
                     v_cache + kh * head_tile, block_tables + s * max_blocks, span_ctx0[s] + i, nq, group, head_dim,
                     block_size, tile, scale, out + start * out_stride + kh * group * head_dim, out_stride, window,
                     softcap, sinks ? sinks + kh * group : NULL);
        }
    free(tasks);
    return 1;
}
#endif

/* q: [tokens] rows q_stride apart, each [num_heads][head_dim]; out: [tokens][num_heads * head_dim]
 * contiguous. Span s covers query rows span_start[s] .. + span_len[s], sees span_ctx0[s] + i tokens at
 * its i-th query, and reads blocks block_tables[s * max_blocks ...]. Rows outside every span (padding)
 * are left alone. */
#define DEFINE_KERNEL(NAME, T, C, LOAD, STORE, TILE, SCALED)                                                   \
DEFINE_TASK(NAME##_task, T, C, LOAD, STORE, TILE, SCALED)                                                        \
DEFINE_FLASH_TASK(NAME##_flash, T, C, LOAD, STORE, TILE, SCALED)                                                 \
void NAME(const T *q, int64_t q_stride, const C *k_cache, const C *v_cache, const float *k_scale,          \
          const float *v_scale, const int64_t *block_tables,                                                \
          int64_t max_blocks, const int64_t *span_start, const int64_t *span_len, const int64_t *span_ctx0, \
          int64_t num_spans, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, \
          float scale, int64_t window, float softcap, const float *sinks, T *out) {                        \
    const int64_t group = num_heads / num_kv_heads, head_tile = head_dim * block_size;                     \
    const int64_t tile = num_kv_heads * head_tile, out_stride = num_heads * head_dim;                      \
    const int64_t scale_tile = num_kv_heads * block_size;                                                  \
    /* Tasks (span, query tile), the most expensive (longest context) first, for load balance. The flash \
     * task takes as many queries as its FLASH_ROWS rows hold: each reads its context once for them all. */ \
    const int flash = row_tiles(head_dim, block_size);                                                     \
    const int64_t per_task = flash ? FLASH_ROWS / group : Q_TILE;                                          \
    int64_t num_tiles = 0;                                                                                 \
    for (int64_t s = 0; s < num_spans; s++) num_tiles += (span_len[s] + per_task - 1) / per_task;          \
    int64_t (*tasks)[2] = malloc(sizeof(int64_t[2]) * num_tiles);                                          \
    for (int64_t s = 0, n = 0; s < num_spans; s++)                                                         \
        for (int64_t i = (span_len[s] - 1) / per_task * per_task; i >= 0; i -= per_task) { tasks[n][0] = s; tasks[n++][1] = i; } \
    /* A sequence's heads go to one thread, one after the other, when there are enough tiles to share   \
     * out: its blocks then stream through one core's cache. */                                          \
    const int64_t chunk = num_tiles >= 8 ? num_kv_heads : 1;                                               \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, chunk)")                                       \
    for (int64_t n = 0; n < num_tiles; n++)                                                                \
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {                                                    \
            const int64_t s = tasks[n][0], i = tasks[n][1], start = span_start[s] + i;                     \
            const int64_t nq = span_len[s] - i < per_task ? span_len[s] - i : per_task, ctx0 = span_ctx0[s] + i; \
            const int64_t row = round_up(round_up(ctx0 + nq - 1, block_size), SCORE_ALIGN);                \
            float *scores = flash ? NULL : aligned_alloc(64, sizeof(float) * nq * group * row);              \
            const T *qh = q + start * q_stride + kh * group * head_dim;                                    \
            T *oh = out + start * out_stride + kh * group * head_dim;                                      \
            const C *k = k_cache + kh * head_tile, *v = v_cache + kh * head_tile;                          \
            const float *ks = SCALED ? k_scale + kh * block_size : NULL;                                   \
            const float *vs = SCALED ? v_scale + kh * block_size : NULL;                                   \
            const int64_t *table = block_tables + s * max_blocks;                                          \
            const float *sk = sinks ? sinks + kh * group : NULL;                                           \
            /* Literal sizes for the common shapes let the compiler unroll and keep tiles in registers. */ \
            if (flash)                                                                                     \
                NAME##_flash(qh, q_stride, k, v, ks, vs, scale_tile, table, ctx0, nq, group, head_dim, block_size, tile, scale, oh, \
                             out_stride, window, softcap, sk);                                             \
            else if (head_dim == 64 && block_size == 16)                                                   \
                NAME##_task(qh, q_stride, k, v, ks, vs, scale_tile, table, ctx0, nq, group, 64, 16, tile, scale, oh, out_stride, scores, row, window, softcap, sk); \
            else if (head_dim == 128 && block_size == 16)                                                  \
                NAME##_task(qh, q_stride, k, v, ks, vs, scale_tile, table, ctx0, nq, group, 128, 16, tile, scale, oh, out_stride, scores, row, window, softcap, sk); \
            else                                                                                           \
                NAME##_task(qh, q_stride, k, v, ks, vs, scale_tile, table, ctx0, nq, group, head_dim, block_size, tile, scale, oh, \
                            out_stride, scores, row, window, softcap, sk);                                                  \
            free(scores);                                                                                  \
        }                                                                                                  \
    free(tasks);                                                                                           \
}

DEFINE_KERNEL(paged_attention_bf16_vector, uint16_t, uint16_t, bf16_to_float, float_to_bf16, bf16_tile, 0)
DEFINE_KERNEL(paged_attention_f32, float, float, f32_load, f32_store, f32_tile, 0)
DEFINE_KERNEL(paged_attention_bf16_int8, uint16_t, int8_t, bf16_to_float, float_to_bf16, int8_tile, 1)
DEFINE_KERNEL(paged_attention_bf16_fp8_e4m3, uint16_t, uint8_t, bf16_to_float, float_to_bf16, e4m3_tile, 1)
DEFINE_KERNEL(paged_attention_bf16_fp8_e5m2, uint16_t, uint8_t, bf16_to_float, float_to_bf16, e5m2_tile, 1)
DEFINE_KERNEL(paged_attention_f32_int8, float, int8_t, f32_load, f32_store, int8_tile, 1)
DEFINE_KERNEL(paged_attention_f32_fp8_e4m3, float, uint8_t, f32_load, f32_store, e4m3_tile, 1)
DEFINE_KERNEL(paged_attention_f32_fp8_e5m2, float, uint8_t, f32_load, f32_store, e5m2_tile, 1)

/* The bf16 pool: on the tiles where the CPU has them, else the vector kernel. */
void paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const float *k_scale, const float *v_scale, const int64_t *block_tables, int64_t max_blocks,
                          const int64_t *span_start, const int64_t *span_len, const int64_t *span_ctx0, int64_t num_spans,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          int64_t window, float softcap, const float *sinks, uint16_t *out) {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (paged_attention_amx(q, q_stride, k_cache, v_cache, block_tables, max_blocks, span_start, span_len, span_ctx0,
                            num_spans, num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, sinks, out))
        return;
#endif
    paged_attention_bf16_vector(q, q_stride, k_cache, v_cache, k_scale, v_scale, block_tables, max_blocks, span_start,
                                span_len, span_ctx0, num_spans, num_heads, num_kv_heads, head_dim, block_size, scale,
                                window, softcap, sinks, out);
}
