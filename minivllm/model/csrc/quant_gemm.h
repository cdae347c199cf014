/* One quantized GEMM of a batch that quant_gemm.c runs in a single parallel region (qgemm_calls_*):
 * out [M, N] (row stride ldo) = x [M, K] (row stride ldx) W^T (+ bias), W quant.py's packed panels of
 * ggml type qtype. x and out are the activation dtype (float or bf16), as the caller's kernel suffix says. */
#ifndef MINIVLLM_QUANT_GEMM_H
#define MINIVLLM_QUANT_GEMM_H

#include <stdint.h>

typedef struct {
    const void *x;
    int64_t ldx;
    const uint8_t *w;
    int64_t qtype;
    const float *bias;  /* float32 [N], or NULL */
    void *out;
    int64_t ldo, M, N, K;
} QGemmCall;

#endif
