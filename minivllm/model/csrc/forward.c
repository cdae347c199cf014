/* The decoder's layer loop in C: the same native kernels the Python model calls, in the same order,
 * without the per-layer Python between them.
 *
 * A decode step of one sequence does ~0.3 ms of arithmetic per layer on a small model but pays ~0.1 ms
 * of Python per layer to launch its dozen kernels (ctypes calls, torch views and allocations); over 30
 * layers the launches cost as much as the work. Here one call runs every layer: norms, the fused QKV
 * projection, rotary, the KV write, paged attention, the output projection, the MLP (a sparse layer's
 * mixture of experts: moe.c). Each step calls
 * exactly the functions of decoder.py's native path with the same arguments, so the result is the same
 * bits (tests/test_native_forward.py checks it); the Python loop stays as the readable reference.
 * The KV pool's format (--kv-cache-dtype) picks the attention kernel and, for a quantized pool, the
 * KV write: the model description carries both, as kernels.py chose them.
 *
 * The family switches (model_config.py) that a layer reads are in its description: q/k norms (per head,
 * or over the whole projection as OLMoE's), which rotary table (or none), its sliding window, Gemma's
 * norms after attention and after the MLP; the model's: partial rotary, the activation, the attention
 * softcap, Granite's residual multiplier.
 * A step serving LoRA adapters passes its segments (runs of rows of one adapter, as lora/layers.py's
 * LoRAContext makes them): each linear adds them with lora.c's kernel right after its GEMM, as
 * decoder.Linear's lora hook does in the Python loop.
 * native_forward.py mirrors these structs and layer_desc.h's field for field (tests/test_native_forward.py
 * compares them).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "layer_desc.h"
#include "lora.h"
#include "simd.h"

typedef struct {
    LinearDesc qkv, o, gate_up, down;  /* gate_up and down: a dense MLP's (unused where moe is set) */
    const MoEDesc *moe;  /* a sparse layer's mixture of experts (moe.c), or NULL: the dense MLP */
    const void *input_norm, *post_norm;  /* post_norm: the MLP's input norm */
    const void *q_norm, *k_norm;  /* per head or over the whole projection (norm_projection), or NULL */
    const void *attn_out_norm, *mlp_out_norm;  /* Gemma's norms of the attention and MLP outputs, or NULL */
    const float *sinks;  /* gpt-oss's attention sink per head, float32, or NULL */
    int64_t rope;  /* the rotary table (StepDesc.cos/sin index), or -1: none */
    int64_t window;  /* sliding window, or 0 */
    int64_t norm_projection;  /* OLMoE: q_norm and k_norm span all heads, one norm a row */
} LayerDesc;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, block_size, rot_dim;
    int64_t act;  /* model_config.ACTIVATIONS: 0 silu, 1 gelu_tanh, 2 swiglu_oai */
    float eps, scale, softcap, residual_scale;  /* softcap 0: none */
    const LayerDesc *layers;
    const void *final_norm;
    const void *attention;       /* paged_attention_* for the pool's format */
    const void *write_kv_quant;  /* write_kv_*_<format> for a quantized pool; NULL: write_kv_* */
    float kv_inv_qmax, kv_qmax;  /* the quantized format's 1 / QMAX and QMAX */
} ModelDesc;

#define NUM_ROPES 2  /* model_config.ROPE_GLOBAL and ROPE_LOCAL */

typedef struct {
    int64_t tokens, real_tokens, spans, max_blocks;
    const float *cos[NUM_ROPES], *sin[NUM_ROPES];
    const int64_t *slot_blocks, *slot_offsets, *block_tables, *span_starts, *span_lens, *span_ctx0;
    void *const *k_caches, *const *v_caches;  /* one per layer */
    void *const *k_scales, *const *v_scales;  /* one per layer for a quantized pool, else NULL */
    int64_t lora_segments;  /* the step's runs of rows of one adapter, or 0: no adapters */
    const int64_t *lora_starts, *lora_lens;  /* per segment: its first row and its rows */
    /* lora.c's 4 words per segment (AT, BT, bands, padded rank) of each target, [target][segment][4];
     * target = layer * LORA_TARGETS + (0 qkv, 1 o, 2 gate_up, 3 down), lora/manager.py's model_targets order */
    const int64_t *lora_weights;
} StepDesc;

#define LORA_TARGETS 4  /* the adaptable linears of a layer */

#define DECLARE_KERNELS(S, T)                                                                            \
    void apply_linear_##S(const LinearDesc *l, const T *x, T *out, int64_t M);                           \
    void moe_##S(const MoEDesc *d, const T *x, T *out, int64_t M, int64_t hidden);                       \
    void add_rms_norm_##S(const T *delta, T *residual, const T *weight, T *out, int64_t tokens,          \
                          int64_t hidden, float eps);                                                    \
    void rotary_##S(T *q, int64_t q_stride, T *k, int64_t k_stride, const float *cos, const float *sin, \
                    int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rot_dim); \
    void head_rms_norm_##S(T *x, int64_t stride, int64_t tokens, int64_t heads, int64_t head_dim,        \
                           const T *weight, float eps);                                                  \
    void act_and_mul_##S(int64_t act, const T *gate_up, T *out, int64_t tokens, int64_t inter);        \
    void write_kv_##S(const T *k, int64_t k_stride, const T *v, int64_t v_stride, const int64_t *blocks, \
                      const int64_t *offsets, int64_t tokens, int64_t kv_heads, int64_t head_dim,        \
                      int64_t block_size, T *k_cache, T *v_cache);                                       \
    /* The pool-format kernels, through ModelDesc (their pool pointers are the format's element type). */ \
    typedef void (*attention_##S##_fn)(const T *q, int64_t q_stride, const void *k_cache, const void *v_cache, \
                                       const float *k_scale, const float *v_scale, const int64_t *block_tables, \
                                       int64_t max_blocks, const int64_t *span_starts, const int64_t *span_lens, \
                                       const int64_t *span_ctx0, int64_t spans, int64_t heads, int64_t kv_heads, \
                                       int64_t head_dim, int64_t block_size, float scale, int64_t window, \
                                       float softcap, const float *sinks, T *out);                       \
    typedef void (*write_kv_quant_##S##_fn)(const T *k, int64_t k_stride, const T *v, int64_t v_stride,   \
                                            const int64_t *blocks, const int64_t *offsets, int64_t tokens, \
                                            int64_t kv_heads, int64_t head_dim, int64_t block_size,      \
                                            void *k_cache, void *v_cache, float *k_scale, float *v_scale, \
                                            float inv_qmax, float qmax);                                 \
    void lora_##S(const T *x, int64_t x_stride, T *out, int64_t out_stride, int64_t k, int64_t n,        \
                  int64_t n_pad, int64_t num_segments, const int64_t *starts, const int64_t *lens,       \
                  const int64_t *weights);

#define DEFINE_FORWARD(S, T)                                                                             \
DECLARE_KERNELS(S, T)                                                                                    \
                                                                                                         \
/* out = x W^T (+ bias), then the step's adapters on their rows; `target` indexes StepDesc.lora_weights. */ \
static void linear_##S(const LinearDesc *l, const T *x, T *out, int64_t M, const StepDesc *s, int64_t target) { \
    apply_linear_##S(l, x, out, M);                                                                      \
    if (s->lora_segments)                                                                                \
        lora_##S(x, l->k, out, l->n, l->k, l->n, (l->n + LORA_CHUNK - 1) / LORA_CHUNK * LORA_CHUNK,      \
                 s->lora_segments, s->lora_starts, s->lora_lens, s->lora_weights + target * s->lora_segments * 4); \
}                                                                                                        \
                                                                                                         \
/* x *= scale, rounded to T: Granite's residual multiplier, as torch multiplies a tensor by a float. */     \
static void scale_##S(T *x, int64_t n, float scale) {                                                    \
    for (int64_t i = 0; i < n; i++) x[i] = STORE_##S(LOAD_##S(x[i]) * scale);                             \
}                                                                                                        \
                                                                                                         \
/* A block's output as it joins the residual stream: normed first where the layer has Gemma's norm       \
 * after it (into `buffer`), times the residual multiplier where it is not 1. */                        \
static T *sandwich_##S(const void *norm, T *x, T *buffer, const ModelDesc *m, int64_t M) {               \
    if (norm) {                                                                                          \
        add_rms_norm_##S(NULL, x, (const T *)norm, buffer, M, m->hidden, m->eps);                        \
        x = buffer;                                                                                      \
    }                                                                                                    \
    if (m->residual_scale != 1.f) scale_##S(x, M * m->hidden, m->residual_scale);                         \
    return x;                                                                                            \
}                                                                                                        \
                                                                                                         \
/* residual [tokens, hidden]: the embeddings in, the residual stream after the last layer out;           \
 * out [tokens, hidden]: the final norm's output (what decoder.py's forward returns). */                 \
void forward_layers_##S(const ModelDesc *m, const StepDesc *s, T *residual, T *out) {                    \
    const int64_t M = s->tokens, q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;   \
    const int64_t qkv_width = q_size + 2 * kv_size, H = M * m->hidden;                                   \
    T *normed = malloc(sizeof(T) * H), *delta = malloc(sizeof(T) * H), *sandwiched = malloc(sizeof(T) * H); \
    T *qkv = malloc(sizeof(T) * M * qkv_width), *attn = malloc(sizeof(T) * M * q_size);                 \
    T *gate_up = malloc(sizeof(T) * M * 2 * m->inter), *act = malloc(sizeof(T) * M * m->inter);          \
    T *pending = NULL;  /* the last block's output, not yet added to the residual stream */             \
    for (int64_t i = 0; i < m->num_layers; i++) {                                                        \
        const LayerDesc *L = &m->layers[i];                                                              \
        void *kc = s->k_caches[i], *vc = s->v_caches[i];                                                 \
        float *ks = s->k_scales ? (float *)s->k_scales[i] : NULL;                                        \
        float *vs = s->v_scales ? (float *)s->v_scales[i] : NULL;                                        \
        add_rms_norm_##S(pending, residual, (const T *)L->input_norm, normed, M, m->hidden, m->eps);     \
        linear_##S(&L->qkv, normed, qkv, M, s, i * LORA_TARGETS);                                        \
        if (L->q_norm) {  /* a projection's norm is a norm of one head as wide as the projection */     \
            const int64_t q_heads = L->norm_projection ? 1 : m->heads;                                   \
            const int64_t kv_heads = L->norm_projection ? 1 : m->kv_heads;                               \
            head_rms_norm_##S(qkv, qkv_width, M, q_heads, q_size / q_heads, (const T *)L->q_norm, m->eps); \
            head_rms_norm_##S(qkv + q_size, qkv_width, M, kv_heads, kv_size / kv_heads, (const T *)L->k_norm, \
                              m->eps);                                                                   \
        }                                                                                                \
        if (L->rope >= 0)                                                                                \
            rotary_##S(qkv, qkv_width, qkv + q_size, qkv_width, s->cos[L->rope], s->sin[L->rope], M,     \
                       m->heads, m->kv_heads, m->head_dim, m->rot_dim);                                  \
        if (m->write_kv_quant)                                                                           \
            ((write_kv_quant_##S##_fn)m->write_kv_quant)(qkv + q_size, qkv_width, qkv + q_size + kv_size, \
                qkv_width, s->slot_blocks, s->slot_offsets, s->real_tokens, m->kv_heads, m->head_dim,    \
                m->block_size, kc, vc, ks, vs, m->kv_inv_qmax, m->kv_qmax);                              \
        else                                                                                             \
            write_kv_##S(qkv + q_size, qkv_width, qkv + q_size + kv_size, qkv_width, s->slot_blocks,    \
                         s->slot_offsets, s->real_tokens, m->kv_heads, m->head_dim, m->block_size,      \
                         (T *)kc, (T *)vc);                                                              \
        if (s->real_tokens < M) memset(attn, 0, sizeof(T) * M * q_size); /* padding attends to nothing */ \
        ((attention_##S##_fn)m->attention)(qkv, qkv_width, kc, vc, ks, vs, s->block_tables, s->max_blocks, \
                            s->span_starts, s->span_lens, s->span_ctx0, s->spans, m->heads, m->kv_heads, \
                            m->head_dim, m->block_size, m->scale, L->window, m->softcap, L->sinks, attn); \
        linear_##S(&L->o, attn, delta, M, s, i * LORA_TARGETS + 1);                                      \
        pending = sandwich_##S(L->attn_out_norm, delta, sandwiched, m, M);                               \
        add_rms_norm_##S(pending, residual, (const T *)L->post_norm, normed, M, m->hidden, m->eps);      \
        if (L->moe) {  /* no adapters here: lora/manager.py refuses MoE models */              \
            moe_##S(L->moe, normed, delta, M, m->hidden);                                                \
        } else {                                                                                         \
            linear_##S(&L->gate_up, normed, gate_up, M, s, i * LORA_TARGETS + 2);                        \
            act_and_mul_##S(m->act, gate_up, act, M, m->inter);                                          \
            linear_##S(&L->down, act, delta, M, s, i * LORA_TARGETS + 3);                                \
        }                                                                                                \
        pending = sandwich_##S(L->mlp_out_norm, delta, sandwiched, m, M);                                \
    }                                                                                                    \
    add_rms_norm_##S(pending, residual, (const T *)m->final_norm, out, M, m->hidden, m->eps);            \
    free(normed); free(delta); free(sandwiched); free(qkv); free(attn); free(gate_up); free(act);        \
}

#if defined(SIMD)  /* the GEMMs it calls exist for the target */
#define LOAD_f32 f32_load
#define STORE_f32 f32_store
#define LOAD_bf16 bf16_to_float
#define STORE_bf16 float_to_bf16
DEFINE_FORWARD(f32, float)
DEFINE_FORWARD(bf16, uint16_t)
#endif
