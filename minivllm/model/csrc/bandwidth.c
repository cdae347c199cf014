/* A streaming read of a buffer by every thread, as a batch-1 decode step reads the weights: vector loads,
 * each byte once, the threads splitting the buffer. `bench roofline` times it over a buffer far larger
 * than the caches: the read bandwidth that bounds a decode step. */
#include <stdint.h>

uint64_t read_stream(const uint64_t *p, int64_t n) {
    uint64_t acc = 0;
    #pragma omp parallel for reduction(^ : acc) schedule(static)
    for (int64_t i = 0; i < n; i++) acc ^= p[i];  /* vectorized: one xor per loaded vector */
    return acc;
}
