/* Decode attention read straight from the paged KV pool, for the CPU.
 *
 * One query token per sequence. Each (sequence, kv head) task walks the sequence's block table,
 * scores its tokens for the query heads that share this kv head (grouped-query attention), takes
 * the softmax in float32 and accumulates the values. Nothing is gathered or copied: K and V are
 * read once, where they lie. Built at first use with the system's C compiler (see kernels.py);
 * OpenMP resolves to the runtime that torch has already loaded, so the two share threads.
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

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#define DEFINE_KERNEL(NAME, T, LOAD, STORE)                                                              \
void NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,                    \
          int64_t max_blocks, const int64_t *context_lens, int64_t num_seqs, int64_t num_heads,            \
          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, T *out) {               \
    const int64_t group = num_heads / num_kv_heads;                                                        \
    const int64_t token_stride = num_kv_heads * head_dim;                                                  \
    _Pragma("omp parallel for collapse(2) schedule(dynamic)")                                              \
    for (int64_t s = 0; s < num_seqs; s++) {                                                               \
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {                                                    \
            const int64_t ctx = context_lens[s];                                                           \
            const int64_t *table = block_tables + s * max_blocks;                                          \
            float *qf = malloc(sizeof(float) * group * head_dim);                                          \
            float *acc = calloc(group * head_dim, sizeof(float));                                          \
            float *scores = malloc(sizeof(float) * group * ctx);                                           \
            for (int64_t g = 0; g < group; g++)                                                            \
                for (int64_t d = 0; d < head_dim; d++)                                                     \
                    qf[g * head_dim + d] = LOAD(q[(s * num_heads + kh * group + g) * head_dim + d]) * scale; \
            for (int64_t t = 0; t < ctx; t++) {                                                            \
                const T *k = k_cache + (table[t / block_size] * block_size + t % block_size) * token_stride \
                             + kh * head_dim;                                                              \
                for (int64_t g = 0; g < group; g++) {                                                      \
                    const float *qg = qf + g * head_dim;                                                   \
                    float dot = 0.f;                                                                       \
                    _Pragma("omp simd reduction(+:dot)")                                                   \
                    for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * LOAD(k[d]);                      \
                    scores[g * ctx + t] = dot;                                                             \
                }                                                                                          \
            }                                                                                              \
            for (int64_t g = 0; g < group; g++) {                                                          \
                float *sc = scores + g * ctx, m = -INFINITY, sum = 0.f;                                    \
                for (int64_t t = 0; t < ctx; t++) m = sc[t] > m ? sc[t] : m;                               \
                for (int64_t t = 0; t < ctx; t++) { sc[t] = expf(sc[t] - m); sum += sc[t]; }               \
                for (int64_t t = 0; t < ctx; t++) sc[t] /= sum;                                            \
            }                                                                                              \
            for (int64_t t = 0; t < ctx; t++) {                                                            \
                const T *v = v_cache + (table[t / block_size] * block_size + t % block_size) * token_stride \
                             + kh * head_dim;                                                              \
                for (int64_t g = 0; g < group; g++) {                                                      \
                    const float p = scores[g * ctx + t];                                                   \
                    float *ag = acc + g * head_dim;                                                        \
                    _Pragma("omp simd")                                                                    \
                    for (int64_t d = 0; d < head_dim; d++) ag[d] += p * LOAD(v[d]);                        \
                }                                                                                          \
            }                                                                                              \
            for (int64_t g = 0; g < group; g++)                                                            \
                for (int64_t d = 0; d < head_dim; d++)                                                     \
                    out[(s * num_heads + kh * group + g) * head_dim + d] = STORE(acc[g * head_dim + d]);   \
            free(qf);                                                                                      \
            free(acc);                                                                                     \
            free(scores);                                                                                  \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_KERNEL(paged_decode_attention_f32, float, f32_load, f32_store)
