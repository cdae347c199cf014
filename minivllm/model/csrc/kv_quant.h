/* The quantized KV formats' bytes (kv_cache.py says when and why): int8, and the two fp8 formats of
 * the OCP spec as torch defines them, e4m3fn (3 mantissa bits, bias 7, no infinity) and e5m2
 * (2 mantissa bits, bias 15). The CPU has no fp8 instructions, so encoding and decoding are done on
 * the bits, rounding to nearest even as torch's conversions do. Callers clamp to the largest finite
 * value first, so neither NaN nor infinity is ever produced. */
#ifndef MINIVLLM_KV_QUANT_H
#define MINIVLLM_KV_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define E4M3 3, 7   /* mantissa bits, exponent bias */
#define E5M2 2, 15

static inline int8_t int8_encode(float x) { return (int8_t)nearbyintf(x); }

/* |x| at most the format's largest finite value. */
static inline uint8_t fp8_encode(float x, int mbits, int bias) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (bits >> 24) & 0x80;
    const float a = fabsf(x);
    if (a < ldexpf(1.f, 1 - bias))  /* below the smallest normal: a multiple of 2^(1 - bias - mbits) */
        return sign | (uint8_t)nearbyintf(a * ldexpf(1.f, bias - 1 + mbits));  /* 2^mbits is the smallest normal */
    const int drop = 23 - mbits;
    uint32_t m = bits & 0x7FFFFFFF;
    m += ((1u << (drop - 1)) - 1) + ((m >> drop) & 1);  /* round to nearest even at mbits (a carry bumps the exponent) */
    const int e = (int)(m >> 23) - 127 + bias;
    return sign | (uint8_t)(e << mbits) | (uint8_t)((m >> drop) & ((1u << mbits) - 1));
}

static inline float fp8_decode(uint8_t x, int mbits, int bias) {
    const int e = (x & 0x7F) >> mbits, m = x & ((1 << mbits) - 1);
    const float a = e ? ldexpf(1.f + (float)m / (float)(1 << mbits), e - bias) : ldexpf((float)m, 1 - bias - mbits);
    return x & 0x80 ? -a : a;
}

#endif
