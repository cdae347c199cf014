/* A mixture-of-experts MLP in one call: the router, each token's top-k experts, the weighted sum, and
 * Qwen2-MoE's shared expert (model/moe.py is its torch twin, decoder.SparseMoE its caller).
 *
 * A step's (token, slot) pairs are grouped by expert with a stable counting sort; each chosen expert
 * gathers its rows and runs once over all of them, so its weights are read once per step however many
 * tokens chose it (llama.cpp's mul_mat_id). Batch-invariant like every kernel here: the GEMMs compute a
 * row the same whatever the row count, the routing is per token, and a token's k outputs are summed in
 * its own top-k order, rounded to the dtype after each product and sum exactly where moe.py's torch
 * code rounds, never in an order that depends on the other tokens of the step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "layer_desc.h"
#include "quant_gemm.h"
#include "simd.h"

/* The router's choice for one token: the k best experts (ties: the lower id first) and their weights,
 * best first, as moe.route computes them. */
static void route_token(const float *logits, int64_t E, int64_t K, int64_t routing, int64_t norm_topk_prob,
                        float *weights, int64_t *ids) {
    float scores[E];
    if (routing == 0) {  /* softmax over every expert, then the top k of the probabilities */
        float max = logits[0], sum = 0.f;
        for (int64_t e = 1; e < E; e++) max = logits[e] > max ? logits[e] : max;
        for (int64_t e = 0; e < E; e++) sum += scores[e] = expf(logits[e] - max);
        for (int64_t e = 0; e < E; e++) scores[e] /= sum;
    } else {
        memcpy(scores, logits, sizeof(float) * E);
    }
    for (int64_t j = 0; j < K; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
        }
        ids[j] = best;
        weights[j] = scores[best];
    }
    if (routing == 1) {  /* softmax over the k chosen logits (the first is their maximum) */
        const float top = weights[0];
        float sum = 0.f;
        for (int64_t j = 0; j < K; j++) sum += weights[j] = expf(weights[j] - top);
        for (int64_t j = 0; j < K; j++) weights[j] /= sum;
    } else if (norm_topk_prob) {
        float sum = 0.f;
        for (int64_t j = 0; j < K; j++) sum += weights[j];
        for (int64_t j = 0; j < K; j++) weights[j] /= sum;
    }
}

/* A call's buffers, carved from one block that the calling thread keeps across calls up to
 * SCRATCH_KEPT bytes (a decode step's): a dozen fresh allocations per layer, some of a few hundred KB, cost
 * heap trims and page faults in every step. A prefill's larger block is its own, freed after. */
#define SCRATCH_KEPT (8 << 20)
static _Thread_local uint8_t *kept_block;

static uint8_t *scratch_take(size_t bytes) {
    if (bytes > SCRATCH_KEPT) return aligned_alloc(64, bytes);
    if (!kept_block) kept_block = aligned_alloc(64, SCRATCH_KEPT);
    return kept_block;
}

static void scratch_give(uint8_t *block) {
    if (block != kept_block) free(block);
}

/* The next `bytes` of a scratch block, 64-byte aligned. */
static void *carve(uint8_t **at, size_t bytes) {
    void *p = *at;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

/* moe_'s buffers: X(type, name, elements). */
#define MOE_BUFFERS(X, T)                                                                                \
    X(T, logits, M * E) X(T, expert_out, P * hidden) X(float, weights, P) X(int64_t, ids, P)             \
    X(int64_t, order, P) X(int64_t, starts, E + 1) X(int64_t, next, E) X(T, rows, cap * hidden)          \
    X(T, results, cap * hidden) X(T, gate_up, cap * 2 * width) X(T, act, cap * width) X(float, sums, M * hidden)
#define BUFFER_BYTES(type, name, n) + (sizeof(type) * (size_t)(n) + 63) / 64 * 64
#define CARVE_BUFFER(type, name, n) type *name = carve(&at, sizeof(type) * (size_t)(n));

#define MOE_BATCH_ROWS 256  /* a batch of experts takes up to max(M, this) rows: a decode step's all at once */

#define DEFINE_MOE(S, T, W, LOAD, STORE)                                                                   \
void gemm_##S(const T *x, int64_t ldx, const W *w, const float *bias, T *out, int64_t ldo,              \
              int64_t M, int64_t N, int64_t K);                                                          \
void qgemm_calls_##S(const QGemmCall *calls, int64_t count);                                             \
void act_and_mul_##S(int64_t act, const T *gate_up, T *out, int64_t tokens, int64_t inter);           \
                                                                                                         \
/* outs[i][Ms[i], n] = xs[i][Ms[i], k] W_i^T (+ bias) for n linears: every quantized segment of them in   \
 * one batch of GEMMs (one parallel region: quant_gemm.c), a float linear by its own GEMM. */             \
static void apply_linears_##S(const LinearDesc *const *ls, const T *const *xs, T *const *outs,           \
                              const int64_t *Ms, int64_t n) {                                            \
    QGemmCall calls[n * MAX_SEGMENTS];                                                                   \
    int64_t count = 0;                                                                                   \
    for (int64_t i = 0; i < n; i++) {                                                                    \
        const LinearDesc *l = ls[i];                                                                     \
        if (!l->num_segments)                                                                            \
            gemm_##S(xs[i], l->k, (const W *)l->weight, l->bias, outs[i], l->n, Ms[i], l->n, l->k);      \
        for (int64_t j = 0, offset = 0; j < l->num_segments; offset += l->segments[j++].n) {             \
            const SegmentDesc *seg = &l->segments[j];                                                    \
            calls[count++] = (QGemmCall){xs[i], l->k, seg->weight, seg->qtype, l->bias ? l->bias + offset : NULL, \
                                         outs[i] + offset, l->n, Ms[i], seg->n, l->k};                   \
        }                                                                                                \
    }                                                                                                    \
    if (count) qgemm_calls_##S(calls, count);                                                            \
}                                                                                                        \
                                                                                                         \
/* out[M, n] = x[M, k] W^T (+ bias): the float GEMM, or the quantized one over every segment. */          \
void apply_linear_##S(const LinearDesc *l, const T *x, T *out, int64_t M) {                              \
    apply_linears_##S(&l, &x, &out, &M, 1);                                                              \
}                                                                                                        \
                                                                                                         \
/* decoder.MLP of n experts at once, expert i on Ms[i] rows: out = down(act(gate) * up) of x [rows, hidden], \
 * the experts' rows one after another in x, out, and the scratch gate_up [rows, 2 inter] and mid         \
 * [rows, inter]. */                                                                                     \
static void experts_##S(const ExpertDesc *const *es, const int64_t *Ms, int64_t n, int64_t inter,         \
                        int64_t act, int64_t hidden, const T *x, T *out, T *gate_up, T *mid) {             \
    const LinearDesc *ups[n], *downs[n];                                                                 \
    const T *xs[n], *hs[n];                                                                              \
    T *gus[n], *outs[n];                                                                                 \
    int64_t rows = 0;                                                                                    \
    for (int64_t i = 0; i < n; rows += Ms[i++]) {                                                        \
        ups[i] = &es[i]->gate_up, downs[i] = &es[i]->down;                                               \
        xs[i] = x + rows * hidden, outs[i] = out + rows * hidden;                                        \
        gus[i] = gate_up + rows * 2 * inter, hs[i] = mid + rows * inter;                                 \
    }                                                                                                    \
    apply_linears_##S(ups, xs, gus, Ms, n);                                                              \
    act_and_mul_##S(act, gate_up, mid, rows, inter);                                                     \
    apply_linears_##S(downs, hs, outs, Ms, n);                                                           \
}                                                                                                        \
                                                                                                         \
/* out[M, hidden] = the MoE MLP of x[M, hidden]. */                                                     \
void moe_##S(const MoEDesc *d, const T *x, T *out, int64_t M, int64_t hidden) {                          \
    const int64_t E = d->num_experts, K = d->top_k, P = M * K;  /* P (token, slot) pairs */             \
    const int64_t width = d->inter > d->shared_inter ? d->inter : d->shared_inter;                       \
    const int64_t cap = M > MOE_BATCH_ROWS ? M : MOE_BATCH_ROWS;                                         \
    uint8_t *const block = scratch_take(0 MOE_BUFFERS(BUFFER_BYTES, T)), *at = block;                     \
    MOE_BUFFERS(CARVE_BUFFER, T)                                                                         \
    memset(starts, 0, sizeof(int64_t) * (E + 1));  /* expert e's pairs: order[starts[e]:starts[e + 1]] */ \
    apply_linear_##S(&d->router, x, logits, M);                                                          \
    for (int64_t t = 0; t < M; t++) {                                                                    \
        float row[E];  /* the logits in the dtype, widened as moe.route's .float() */                   \
        for (int64_t e = 0; e < E; e++) row[e] = LOAD(logits[t * E + e]);                                \
        route_token(row, E, K, d->routing, d->norm_topk_prob, weights + t * K, ids + t * K);             \
    }                                                                                                    \
    for (int64_t p = 0; p < P; p++) starts[ids[p] + 1]++;  /* counting sort: pairs grouped by expert */ \
    for (int64_t e = 0; e < E; e++) starts[e + 1] += starts[e];                                          \
    memcpy(next, starts, sizeof(int64_t) * E);                                                           \
    for (int64_t p = 0; p < P; p++) order[next[ids[p]]++] = p;  /* stable: by token, then slot */        \
    /* The chosen experts in batches of up to `cap` rows (all of them at a decode step), each batch's     \
     * GEMMs in one parallel region: at one token, a top 8's two dozen GEMMs of a few hundred KB, one     \
     * after another, paid a fork and two barriers apiece (batched: Granite's decode 1.18x on Zen 3).    \
     * The scratch serves every batch and the shared expert (an expert takes at most M rows). */         \
    const ExpertDesc *batch[E];                                                                          \
    int64_t counts[E];                                                                                   \
    for (int64_t e = 0, n = 0, used = 0; e <= E; e++) {                                                  \
        const int64_t count = e < E ? starts[e + 1] - starts[e] : 0;                                     \
        if (n && (e == E || used + count > cap)) {  /* run the batch, each pair's output to its row */   \
            experts_##S(batch, counts, n, d->inter, d->act, hidden, rows, results, gate_up, act);        \
            for (int64_t i = 0; i < used; i++)                                                           \
                memcpy(expert_out + order[starts[e] - used + i] * hidden, results + i * hidden, sizeof(T) * hidden); \
            n = used = 0;                                                                                \
        }                                                                                                \
        if (!count) continue;                                                                            \
        d->load[e] += count;                                                                             \
        for (int64_t i = 0; i < count; i++)  /* its pairs' token rows, gathered */                      \
            memcpy(rows + (used + i) * hidden, x + order[starts[e] + i] / K * hidden, sizeof(T) * hidden); \
        batch[n] = &d->experts[e], counts[n++] = count, used += count;                                   \
    }                                                                                                    \
    /* Each token's k outputs in its own top-k order, each weight in the dtype (moe.run_experts); the     \
     * hidden dimension innermost, so that it vectorizes (element by element, one thread's serial work    \
     * was 2 % of Granite's decode step). */                                                             \
    _Pragma("omp parallel for if(M >= 16)")                                                              \
    for (int64_t t = 0; t < M; t++) {                                                                    \
        float *acc = sums + t * hidden;                                                                  \
        for (int64_t j = 0; j < K; j++) {                                                                \
            const float w = LOAD(STORE(weights[t * K + j]));                                             \
            const T *e = expert_out + (t * K + j) * hidden;                                              \
            for (int64_t h = 0; h < hidden; h++) {                                                       \
                const float term = LOAD(STORE(LOAD(e[h]) * w));                                          \
                acc[h] = j ? LOAD(STORE(acc[h] + term)) : term;                                          \
            }                                                                                            \
        }                                                                                                \
        for (int64_t h = 0; h < hidden; h++) out[t * hidden + h] = STORE(acc[h]);                        \
    }                                                                                                    \
    if (d->shared_inter) {  /* out += sigmoid(x . shared_gate) * shared_expert(x), rounded as torch */  \
        const ExpertDesc *shared = &d->shared;                                                           \
        experts_##S(&shared, &M, 1, d->shared_inter, d->act, hidden, x, results, gate_up, act);          \
        apply_linear_##S(&d->shared_gate, x, logits, M);                                                 \
        for (int64_t t = 0; t < M; t++) {                                                                \
            const float g = LOAD(STORE(1.f / (1.f + expf(-LOAD(logits[t])))));                           \
            for (int64_t h = 0; h < hidden; h++) {                                                       \
                const float term = LOAD(STORE(g * LOAD(results[t * hidden + h])));                      \
                out[t * hidden + h] = STORE(LOAD(out[t * hidden + h]) + term);                           \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    scratch_give(block);                                                                                 \
}

#if defined(SIMD)  /* the GEMMs it calls exist for the target */
DEFINE_MOE(f32, float, float, f32_load, f32_store)
DEFINE_MOE(bf16, uint16_t, uint32_t, bf16_to_float, float_to_bf16)
#endif
