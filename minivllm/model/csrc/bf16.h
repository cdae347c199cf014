/* bfloat16 <-> float32 for the kernels: bf16 is the top half of a float32. */
#ifndef MINIVLLM_BF16_H
#define MINIVLLM_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* The float32 kernels' load and store: the identity, so that one macro body serves both dtypes. */
static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#endif
