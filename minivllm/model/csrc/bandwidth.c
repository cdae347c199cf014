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

/* The AMX tiles' peak, for `bench roofline`: every thread runs `iters` rounds of four independent tile
 * products from registers (no memory), int8 (tdpbssd, 16 x 16 x 64 multiply-adds each) or bf16
 * (tdpbf16ps, 16 x 16 x 32). Returns the operations done (2 per multiply-add), or 0 where the tiles
 * are not ready (amx.h). */
#include "amx.h"

double amx_peak_ops(int bf16, int64_t iters) {
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
    if (!amx_tiles_ready()) return 0.0;
    int threads = 0;
    #pragma omp parallel reduction(+ : threads)
    {
        static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
        _Alignas(64) uint8_t zeros[1024] = {0};
        configure_tiles(rows, colsb);
        _tile_loadd(4, zeros, 64);  /* operands: zeros are as fast as any */
        _tile_loadd(5, zeros, 64);
        _tile_loadd(6, zeros, 64);
        _tile_loadd(7, zeros, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t i = 0; i < iters; i++) {
            if (bf16) {
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            } else {
                _tile_dpbssd(0, 4, 6);
                _tile_dpbssd(1, 4, 7);
                _tile_dpbssd(2, 5, 6);
                _tile_dpbssd(3, 5, 7);
            }
        }
        _tile_release();
        threads = 1;
    }
    return (double)threads * (double)iters * 4 * 16 * 16 * (bf16 ? 32 : 64) * 2;
#else
    (void)bf16, (void)iters;
    return 0.0;
#endif
}
