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
 * (Gemma 2) maps each score to cap * tanh(score / cap) before it. Both are per layer and, like the
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

#include "bf16.h"
#include "kv_quant.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK_SIZE 64
#define Q_TILE 8           /* queries of one sequence that share each K/V tile */
#define PREFETCH_BLOCKS 6
#define CHAINS 4           /* head_dim must be a multiple (kernels.py checks) */
#define SCORE_ALIGN 16     /* floats: score rows start on 64 bytes and are padded to this */
#define MASKED -1e30f      /* score of a padded slot (its weight is set to 0) */
#define EXP_FLOOR -87.f    /* e^-87 is a normal float; the vector expf handles it in its fast path */

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

/* The first token a query with `ctx` tokens of context sees: ctx - window under a sliding window (the
 * query itself and the window - 1 before it, as transformers masks), else 0. window 0: none. */
static inline int64_t first_visible(int64_t ctx, int64_t window) { return window && ctx > window ? ctx - window : 0; }

/* The softmax of one query head's scores over its tokens lo .. ctx - 1, in place. The row is MASKED
 * before lo (a sliding window's start; the scores there may never have been computed) and from ctx to
 * `padded` (a multiple of SCORE_ALIGN, set by ctx alone); it is 64-byte aligned. */
static inline void softmax_row(float *restrict sc, int64_t lo, int64_t ctx, int64_t padded) {
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
        T *out, int64_t out_stride, float *scores, int64_t row, int64_t window, float softcap) {           \
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
                        round_up(ctx0 + j, SCORE_ALIGN));                                                  \
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

/* q: [tokens] rows q_stride apart, each [num_heads][head_dim]; out: [tokens][num_heads * head_dim]
 * contiguous. Span s covers query rows span_start[s] .. + span_len[s], sees span_ctx0[s] + i tokens at
 * its i-th query, and reads blocks block_tables[s * max_blocks ...]. Rows outside every span (padding)
 * are left alone. */
#define DEFINE_KERNEL(NAME, T, C, LOAD, STORE, TILE, SCALED)                                                   \
DEFINE_TASK(NAME##_task, T, C, LOAD, STORE, TILE, SCALED)                                                        \
void NAME(const T *q, int64_t q_stride, const C *k_cache, const C *v_cache, const float *k_scale,          \
          const float *v_scale, const int64_t *block_tables,                                                \
          int64_t max_blocks, const int64_t *span_start, const int64_t *span_len, const int64_t *span_ctx0, \
          int64_t num_spans, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, \
          float scale, int64_t window, float softcap, T *out) {                                            \
    const int64_t group = num_heads / num_kv_heads, head_tile = head_dim * block_size;                     \
    const int64_t tile = num_kv_heads * head_tile, out_stride = num_heads * head_dim;                      \
    const int64_t scale_tile = num_kv_heads * block_size;                                                  \
    /* Tasks (span, query tile), the most expensive (longest context) first, for load balance. */        \
    int64_t num_tiles = 0;                                                                                 \
    for (int64_t s = 0; s < num_spans; s++) num_tiles += (span_len[s] + Q_TILE - 1) / Q_TILE;              \
    int64_t (*tasks)[2] = malloc(sizeof(int64_t[2]) * num_tiles);                                          \
    for (int64_t s = 0, n = 0; s < num_spans; s++)                                                         \
        for (int64_t i = (span_len[s] - 1) / Q_TILE * Q_TILE; i >= 0; i -= Q_TILE) { tasks[n][0] = s; tasks[n++][1] = i; } \
    /* A sequence's heads go to one thread, one after the other, when there are enough tiles to share   \
     * out: its blocks then stream through one core's cache. */                                          \
    const int64_t chunk = num_tiles >= 8 ? num_kv_heads : 1;                                               \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, chunk)")                                       \
    for (int64_t n = 0; n < num_tiles; n++)                                                                \
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {                                                    \
            const int64_t s = tasks[n][0], i = tasks[n][1], start = span_start[s] + i;                     \
            const int64_t nq = span_len[s] - i < Q_TILE ? span_len[s] - i : Q_TILE, ctx0 = span_ctx0[s] + i; \
            const int64_t row = round_up(round_up(ctx0 + nq - 1, block_size), SCORE_ALIGN);                \
            float *scores = aligned_alloc(64, sizeof(float) * nq * group * row);                           \
            const T *qh = q + start * q_stride + kh * group * head_dim;                                    \
            T *oh = out + start * out_stride + kh * group * head_dim;                                      \
            const C *k = k_cache + kh * head_tile, *v = v_cache + kh * head_tile;                          \
            const float *ks = SCALED ? k_scale + kh * block_size : NULL;                                   \
            const float *vs = SCALED ? v_scale + kh * block_size : NULL;                                   \
            const int64_t *table = block_tables + s * max_blocks;                                          \
            /* Literal sizes for the common shapes let the compiler unroll and keep tiles in registers. */ \
            if (head_dim == 64 && block_size == 16)                                                        \
                NAME##_task(qh, q_stride, k, v, ks, vs, scale_tile, table, ctx0, nq, group, 64, 16, tile, scale, oh, out_stride, scores, row, window, softcap); \
            else if (head_dim == 128 && block_size == 16)                                                  \
                NAME##_task(qh, q_stride, k, v, ks, vs, scale_tile, table, ctx0, nq, group, 128, 16, tile, scale, oh, out_stride, scores, row, window, softcap); \
            else                                                                                           \
                NAME##_task(qh, q_stride, k, v, ks, vs, scale_tile, table, ctx0, nq, group, head_dim, block_size, tile, scale, oh, \
                            out_stride, scores, row, window, softcap);                                                      \
            free(scores);                                                                                  \
        }                                                                                                  \
    free(tasks);                                                                                           \
}

DEFINE_KERNEL(paged_attention_bf16, uint16_t, uint16_t, bf16_to_float, float_to_bf16, bf16_tile, 0)
DEFINE_KERNEL(paged_attention_f32, float, float, f32_load, f32_store, f32_tile, 0)
DEFINE_KERNEL(paged_attention_bf16_int8, uint16_t, int8_t, bf16_to_float, float_to_bf16, int8_tile, 1)
DEFINE_KERNEL(paged_attention_bf16_fp8_e4m3, uint16_t, uint8_t, bf16_to_float, float_to_bf16, e4m3_tile, 1)
DEFINE_KERNEL(paged_attention_bf16_fp8_e5m2, uint16_t, uint8_t, bf16_to_float, float_to_bf16, e5m2_tile, 1)
DEFINE_KERNEL(paged_attention_f32_int8, float, int8_t, f32_load, f32_store, int8_tile, 1)
DEFINE_KERNEL(paged_attention_f32_fp8_e4m3, float, uint8_t, f32_load, f32_store, e4m3_tile, 1)
DEFINE_KERNEL(paged_attention_f32_fp8_e5m2, float, uint8_t, f32_load, f32_store, e5m2_tile, 1)
