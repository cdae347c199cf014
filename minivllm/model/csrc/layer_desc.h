/* What forward.c and moe.c know of a layer's linears and of a mixture-of-experts MLP: plain structs
 * that native_forward.py fills field for field (tests/test_native_forward.py compares both sides). */
#ifndef MINIVLLM_LAYER_DESC_H
#define MINIVLLM_LAYER_DESC_H

#include <stdint.h>

#define MAX_SEGMENTS 3  /* a fused q/k/v in three formats */

typedef struct {
    const void *weight;  /* quant_gemm.c's packed panels of one block format */
    int64_t n;           /* output columns */
    int64_t qtype;       /* ggml's type id */
} SegmentDesc;

typedef struct {
    const void *weight;  /* gemm.c's float panels (num_segments == 0) */
    const float *bias;   /* float32 (the float GEMM's padded to whole panels), or NULL */
    int64_t n, k;
    int64_t num_segments;  /* 0: float (gemm_*); else quantized (qgemm_*), one call per segment */
    SegmentDesc segments[MAX_SEGMENTS];
} LinearDesc;

typedef struct {
    LinearDesc gate_up, down;  /* decoder.MLP's: the fused gate/up projection and the down projection */
} ExpertDesc;

typedef struct {
    LinearDesc router;           /* [num_experts, hidden]: decoder.SparseMoE's `gate` */
    const ExpertDesc *experts;   /* num_experts of them */
    ExpertDesc shared;           /* Qwen2-MoE's shared expert, when shared_inter > 0 */
    LinearDesc shared_gate;      /* its [1, hidden] sigmoid gate */
    int64_t num_experts, top_k, inter, shared_inter;
    int64_t routing;             /* model_config.ROUTINGS: 0 softmax over all then top-k, 1 top-k then softmax */
    int64_t norm_topk_prob;      /* softmax routing: renormalize the k weights to sum to 1 */
    int64_t act;                 /* model_config.ACTIVATIONS */
    int64_t *load;               /* [num_experts]: tokens each expert took (decoder.SparseMoE.expert_load) */
} MoEDesc;

#endif
