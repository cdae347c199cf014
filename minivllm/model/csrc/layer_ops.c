/* The small per-layer ops of the decoder, fused: one pass each instead of a chain of torch ops.
 *
 * At a few tokens per step each torch op costs more in dispatch than in arithmetic, and a decoder
 * layer has dozens of them. Each kernel here does one layer's worth in one call:
 *   add_rms_norm   residual += delta (if any); out = RMSNorm(residual) * weight
 *   head_rms_norm  RMSNorm of each head of q or k in place (Qwen3's and Gemma 3's q/k norms)
 *   rotary         rotate q and k in place (NeoX halves of the first rot_dim of each head: partial
 *                  rotary where rot_dim < head_dim), from float32 cos/sin tables
 *   write_kv       copy the new tokens' K and V into their pool slots (layout: attention.py), or
 *                  quantize them into a quantized pool with one scale per token and kv head (kv_cache.py)
 *   silu_and_mul   out = silu(gate) * up, from the fused gate_up output
 *   gelu_tanh_and_mul  the same with GELU's tanh approximation (Gemma's GeGLU)
 * Intermediate results are rounded to the model's dtype exactly where the torch code rounds them
 * (round_bf16), so that the native and torch paths give the same numbers up to the order of sums.
 * Rows are split across OpenMP threads only when there are enough of them to pay for the fork.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kv_quant.h"

#define PARALLEL_ROWS 16  /* fewer rows than this run on the calling thread */

/* The MLP's gate activations, in float32. silu: exp of at most 88 (expf(-x) past float range is inf,
 * which -ffast-math may turn to NaN). gelu_tanh: GELU's tanh approximation (gelu_pytorch_tanh). */
static inline float silu(float x) { return x / (1.f + expf(fminf(-x, 88.f))); }
static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* out = ACT(gate) * up from the fused gate_up output, the activation rounded to T as torch rounds it. */
#define ACT_AND_MUL(S, T, LOAD, STORE, ACT)                                                                \
void ACT##_and_mul_##S(const T *gate_up, T *out, int64_t tokens, int64_t inter) {                          \
    _Pragma("omp parallel for if(tokens >= PARALLEL_ROWS)")                                                \
    for (int64_t t = 0; t < tokens; t++) {                                                                 \
        const T *g = gate_up + t * 2 * inter, *u = g + inter;                                              \
        T *o = out + t * inter;                                                                            \
        _Pragma("omp simd")                                                                                \
        for (int64_t i = 0; i < inter; i++) o[i] = STORE(round_##S(ACT(LOAD(g[i]))) * LOAD(u[i]));         \
    }                                                                                                      \
}

/* gpt-oss's clamped SwiGLU: out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit),
 * each product and sum rounded to T where torch rounds it (model_config.SWIGLU_OAI_*; activations.py is its twin). */
#define SWIGLU_OAI_ALPHA 1.702f
#define SWIGLU_OAI_LIMIT 7.f
#define SWIGLU_OAI_AND_MUL(S, T, LOAD, STORE)                                                              \
void swiglu_oai_and_mul_##S(const T *gate_up, T *out, int64_t tokens, int64_t inter) {                     \
    _Pragma("omp parallel for if(tokens >= PARALLEL_ROWS)")                                                \
    for (int64_t t = 0; t < tokens; t++) {                                                                 \
        const T *g = gate_up + t * 2 * inter, *u = g + inter;                                              \
        T *o = out + t * inter;                                                                            \
        for (int64_t i = 0; i < inter; i++) {                                                              \
            const float gate = fminf(LOAD(g[i]), SWIGLU_OAI_LIMIT);                                        \
            const float up = fminf(fmaxf(LOAD(u[i]), -SWIGLU_OAI_LIMIT), SWIGLU_OAI_LIMIT);                \
            const float scaled = round_##S(gate * SWIGLU_OAI_ALPHA);                                       \
            const float sig = round_##S(1.f / (1.f + expf(fminf(-scaled, 88.f))));                         \
            o[i] = STORE(round_##S(up + 1.f) * round_##S(gate * sig));                                     \
        }                                                                                                  \
    }                                                                                                      \
}

#define DEFINE_OPS(S, T, LOAD, STORE)                                                                      \
static inline float round_##S(float x) { return LOAD(STORE(x)); }                                          \
                                                                                                           \
void add_rms_norm_##S(const T *delta, T *residual, const T *weight, T *out, int64_t tokens, int64_t hidden, \
                      float eps) {                                                                         \
    _Pragma("omp parallel for if(tokens >= PARALLEL_ROWS)")                                                \
    for (int64_t t = 0; t < tokens; t++) {                                                                 \
        T *res = residual + t * hidden;                                                                    \
        float sum = 0.f;                                                                                   \
        if (delta) {                                                                                       \
            const T *dl = delta + t * hidden;                                                              \
            for (int64_t i = 0; i < hidden; i++) res[i] = STORE(LOAD(res[i]) + LOAD(dl[i]));               \
        }                                                                                                  \
        for (int64_t i = 0; i < hidden; i++) { const float v = LOAD(res[i]); sum += v * v; }               \
        const float inv = 1.f / sqrtf(sum / hidden + eps);                                                 \
        T *o = out + t * hidden;                                                                           \
        for (int64_t i = 0; i < hidden; i++) o[i] = STORE(round_##S(LOAD(res[i]) * inv) * LOAD(weight[i])); \
    }                                                                                                      \
}                                                                                                          \
                                                                                                           \
void head_rms_norm_##S(T *x, int64_t stride, int64_t tokens, int64_t heads, int64_t head_dim, const T *weight, \
                       float eps) {                                                                        \
    _Pragma("omp parallel for if(tokens >= PARALLEL_ROWS)")                                                \
    for (int64_t t = 0; t < tokens; t++)                                                                   \
        for (int64_t h = 0; h < heads; h++) {                                                              \
            T *r = x + t * stride + h * head_dim;                                                          \
            float sum = 0.f;                                                                               \
            for (int64_t i = 0; i < head_dim; i++) { const float v = LOAD(r[i]); sum += v * v; }           \
            const float inv = 1.f / sqrtf(sum / head_dim + eps);                                           \
            for (int64_t i = 0; i < head_dim; i++) r[i] = STORE(round_##S(LOAD(r[i]) * inv) * LOAD(weight[i])); \
        }                                                                                                  \
}                                                                                                          \
                                                                                                           \
void rotary_##S(T *q, int64_t q_stride, T *k, int64_t k_stride, const float *cos, const float *sin,       \
                int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t rot_dim) {     \
    const int64_t half = rot_dim / 2;                                                                      \
    _Pragma("omp parallel for if(tokens >= PARALLEL_ROWS)")                                                \
    for (int64_t t = 0; t < tokens; t++) {                                                                 \
        const float *c = cos + t * half, *s = sin + t * half;                                              \
        for (int64_t h = 0; h < q_heads + k_heads; h++) {                                                  \
            T *x = h < q_heads ? q + t * q_stride + h * head_dim : k + t * k_stride + (h - q_heads) * head_dim; \
            for (int64_t i = 0; i < half; i++) {                                                           \
                const float x1 = LOAD(x[i]), x2 = LOAD(x[i + half]);                                       \
                const float ci = round_##S(c[i]), si = round_##S(s[i]);                                    \
                x[i] = STORE(round_##S(x1 * ci) + round_##S(-x2 * si));                                    \
                x[i + half] = STORE(round_##S(x2 * ci) + round_##S(x1 * si));                              \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}                                                                                                          \
                                                                                                           \
void write_kv_##S(const T *k, int64_t k_stride, const T *v, int64_t v_stride, const int64_t *blocks,      \
                  const int64_t *offsets, int64_t tokens, int64_t kv_heads, int64_t head_dim,               \
                  int64_t block_size, T *k_cache, T *v_cache) {                                            \
    _Pragma("omp parallel for if(tokens >= PARALLEL_ROWS)")  /* every token has its own slot */          \
    for (int64_t t = 0; t < tokens; t++)                                                                   \
        for (int64_t h = 0; h < kv_heads; h++) {                                                           \
            const T *kt = k + t * k_stride + h * head_dim, *vt = v + t * v_stride + h * head_dim;          \
            T *kc = k_cache + ((blocks[t] * kv_heads + h) * head_dim) * block_size + offsets[t];           \
            for (int64_t d = 0; d < head_dim; d++) kc[d * block_size] = kt[d];  /* K: [head_dim][block] */ \
            memcpy(v_cache + ((blocks[t] * kv_heads + h) * block_size + offsets[t]) * head_dim, vt,        \
                   sizeof(T) * head_dim);                                                                  \
        }                                                                                                  \
}                                                                                                          \
                                                                                                           \
ACT_AND_MUL(S, T, LOAD, STORE, silu)                                                                       \
ACT_AND_MUL(S, T, LOAD, STORE, gelu_tanh)                                                                  \
SWIGLU_OAI_AND_MUL(S, T, LOAD, STORE)                                                                      \
                                                                                                           \
/* The MLP's activation by its index in model_config.ACTIVATIONS (forward.c's and moe.c's `act`). */      \
void act_and_mul_##S(int64_t act, const T *gate_up, T *out, int64_t tokens, int64_t inter) {               \
    (act == 0 ? silu_and_mul_##S : act == 1 ? gelu_tanh_and_mul_##S : swiglu_oai_and_mul_##S)(gate_up, out, tokens, inter); \
}

DEFINE_OPS(bf16, uint16_t, bf16_to_float, float_to_bf16)
DEFINE_OPS(f32, float, f32_load, f32_store)

/* One token's head of K or V into a quantized pool: its scale is amax * inv_qmax (returned, stored
 * beside the block), its values ENCODE(clamp(x / scale)) written dst_stride apart. The same
 * arithmetic as kv_cache.quantize, so the native and torch paths store the same bits. */
#define DEFINE_WRITE_KV_QUANT(S, T, LOAD, Q, C, ENCODE)                                                    \
static inline float quantize_head_##S##_##Q(const T *x, int64_t n, C *dst, int64_t dst_stride,             \
                                            float inv_qmax, float qmax) {                                  \
    float amax = 0.f;                                                                                      \
    for (int64_t d = 0; d < n; d++) amax = fmaxf(amax, fabsf(LOAD(x[d])));                                 \
    const float scale = amax * inv_qmax, inv = scale > 0.f ? 1.f / scale : 0.f;                            \
    for (int64_t d = 0; d < n; d++) dst[d * dst_stride] = ENCODE(fminf(fmaxf(LOAD(x[d]) * inv, -qmax), qmax)); \
    return scale;                                                                                          \
}                                                                                                          \
                                                                                                           \
void write_kv_##S##_##Q(const T *k, int64_t k_stride, const T *v, int64_t v_stride, const int64_t *blocks, \
                        const int64_t *offsets, int64_t tokens, int64_t kv_heads, int64_t head_dim,          \
                        int64_t block_size, C *k_cache, C *v_cache, float *k_scale, float *v_scale,          \
                        float inv_qmax, float qmax) {                                                      \
    _Pragma("omp parallel for if(tokens >= PARALLEL_ROWS)")                                                \
    for (int64_t t = 0; t < tokens; t++)                                                                   \
        for (int64_t h = 0; h < kv_heads; h++) {                                                           \
            const int64_t head = blocks[t] * kv_heads + h, slot = head * block_size + offsets[t];          \
            k_scale[slot] = quantize_head_##S##_##Q(k + t * k_stride + h * head_dim, head_dim,             \
                                                    k_cache + head * head_dim * block_size + offsets[t],   \
                                                    block_size, inv_qmax, qmax);  /* K: [head_dim][block] */ \
            v_scale[slot] = quantize_head_##S##_##Q(v + t * v_stride + h * head_dim, head_dim,             \
                                                    v_cache + slot * head_dim, 1, inv_qmax, qmax);         \
        }                                                                                                  \
}

static inline uint8_t e4m3_encode(float x) { return fp8_encode(x, E4M3); }
static inline uint8_t e5m2_encode(float x) { return fp8_encode(x, E5M2); }

DEFINE_WRITE_KV_QUANT(bf16, uint16_t, bf16_to_float, int8, int8_t, int8_encode)
DEFINE_WRITE_KV_QUANT(bf16, uint16_t, bf16_to_float, fp8_e4m3, uint8_t, e4m3_encode)
DEFINE_WRITE_KV_QUANT(bf16, uint16_t, bf16_to_float, fp8_e5m2, uint8_t, e5m2_encode)
DEFINE_WRITE_KV_QUANT(f32, float, f32_load, int8, int8_t, int8_encode)
DEFINE_WRITE_KV_QUANT(f32, float, f32_load, fp8_e4m3, uint8_t, e4m3_encode)
DEFINE_WRITE_KV_QUANT(f32, float, f32_load, fp8_e5m2, uint8_t, e5m2_encode)
