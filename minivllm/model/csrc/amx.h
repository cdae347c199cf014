/* Intel AMX (Sapphire Rapids and later): eight tile registers of up to 16 rows x 64 bytes and the unit
 * that multiplies them (tdpbf16ps: bf16 pairs into float32; tdpbssd/tdpbsud: int8 quadruples into int32).
 * Linux lends the tiles' state to a process that asks (target.c asks once, as the library loads); a
 * kernel configures each tile's shape on its thread before it uses them. */
#ifndef MINIVLLM_AMX_H
#define MINIVLLM_AMX_H

#include <stdint.h>
#include <string.h>

/* Whether this process may use the tiles: the library was built for a CPU with AMX, Linux granted them,
 * and MINIVLLM_NO_AMX is unset (it turns the tile paths off, to compare them with the vector ones). */
int amx_tiles_ready(void);
int use_amx_tiles(int on);

#if defined(__AMX_TILE__)
#include <immintrin.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tile t: rows[t] rows of colsb[t] bytes, on this thread. */
static inline void configure_tiles(const uint8_t rows[8], const uint16_t colsb[8]) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = rows[t];
        c.colsb[t] = colsb[t];
    }
    _tile_loadconfig(&c);
}
#endif

#endif
