/* Decode attention read straight from the paged KV pool, for the CPU.
 *
 * One query token per sequence. Each (sequence, kv head) task walks the sequence's block table,
 * scores each cached token for the query heads that share this kv head (grouped-query attention),
 * takes the softmax in float32 and accumulates the values. Nothing is gathered or copied: K and V
 * are read once, where they lie. Built at first use with the system's C compiler (kernels.py):
 * OpenMP resolves to the runtime that torch has already loaded, so the two share their threads.
 * Compiled with -ffast-math for vectorized expf and reductions; scores are always finite.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                              \
static inline __attribute__((always_inline)) void NAME##_task(const T *q, const T *k_cache, const T *v_cache, const int64_t *table, int64_t ctx, \
                        int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride,          \
                        float scale, T *out, float *scores) {                                               \
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];                    \
    const T *k = k_cache, *v = v_cache;                                                                    \
    for (int64_t g = 0; g < group; g++)                                                                    \
        for (int64_t d = 0; d < head_dim; d++) { qf[g][d] = LOAD(q[g * head_dim + d]) * scale; acc[g][d] = 0.f; } \
    for (int64_t t = 0; t < ctx; t++) {                                                                    \
        if (t % block_size == 0) k = k_cache + table[t / block_size] * block_size * token_stride;          \
        else k += token_stride;                                                                            \
        for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(k[d]);                                        \
        for (int64_t g = 0; g < group; g++) {                                                              \
            float dot = 0.f;                                                                               \
            _Pragma("omp simd reduction(+:dot)")                                                           \
            for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * row[d];                               \
            scores[g * ctx + t] = dot;                                                                     \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t g = 0; g < group; g++) {                                                                  \
        float *sc = scores + g * ctx, m = sc[0], sum = 0.f;                                                \
        for (int64_t t = 1; t < ctx; t++) m = sc[t] > m ? sc[t] : m;                                       \
        _Pragma("omp simd reduction(+:sum)")                                                               \
        for (int64_t t = 0; t < ctx; t++) { sc[t] = expf(sc[t] - m); sum += sc[t]; }                       \
        const float inv = 1.f / sum;                                                                       \
        for (int64_t t = 0; t < ctx; t++) sc[t] *= inv;                                                    \
    }                                                                                                      \
    for (int64_t t = 0; t < ctx; t++) {                                                                    \
        if (t % block_size == 0) v = v_cache + table[t / block_size] * block_size * token_stride;          \
        else v += token_stride;                                                                            \
        for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(v[d]);                                        \
        for (int64_t g = 0; g < group; g++) {                                                              \
            const float p = scores[g * ctx + t];                                                           \
            _Pragma("omp simd")                                                                            \
            for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * row[d];                                \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t g = 0; g < group; g++)                                                                    \
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = STORE(acc[g][d]);                   \
}                                                                                                          \
void NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables, int64_t max_blocks,  \
          const int64_t *context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,          \
          int64_t head_dim, int64_t block_size, float scale, T *out) {                                     \
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;                \
    _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                              \
    for (int64_t s = 0; s < num_seqs; s++)                                                                 \
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {                                                    \
            float *scores = malloc(sizeof(float) * group * context_lens[s]);                               \
            const int64_t head0 = (s * num_heads + kh * group) * head_dim;                                 \
            /* Literal head sizes let the compiler unroll the inner loops completely. */                 \
            if (head_dim == 64)                                                                            \
                NAME##_task(q + head0, k_cache + kh * head_dim, v_cache + kh * head_dim,                   \
                            block_tables + s * max_blocks, context_lens[s], group, 64, block_size,          \
                            token_stride, scale, out + head0, scores);                                     \
            else if (head_dim == 128)                                                                      \
                NAME##_task(q + head0, k_cache + kh * head_dim, v_cache + kh * head_dim,                   \
                            block_tables + s * max_blocks, context_lens[s], group, 128, block_size,         \
                            token_stride, scale, out + head0, scores);                                     \
            else                                                                                           \
                NAME##_task(q + head0, k_cache + kh * head_dim, v_cache + kh * head_dim,                   \
                            block_tables + s * max_blocks, context_lens[s], group, head_dim, block_size,    \
                            token_stride, scale, out + head0, scores);                                     \
            free(scores);                                                                                  \
        }                                                                                                  \
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_KERNEL(paged_decode_attention_f32, float, f32_load, f32_store)
