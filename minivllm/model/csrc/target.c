/* Which section of simd.h this library was built with, for kernels.py's report: "none" where the
 * target has no GEMM section (the GEMMs and the layer loop are then torch's); and whether the AMX tiles
 * are ready (amx.h). */
#define _GNU_SOURCE  /* syscall() */
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "simd.h"

#ifndef SIMD_NAME
#define SIMD_NAME "none"
#endif

const char *simd_target(void) { return SIMD_NAME; }

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int tiles_granted, tiles_ready;

__attribute__((constructor)) static void request_tiles(void) {
#if defined(__AMX_TILE__)
    const char *off = getenv("MINIVLLM_NO_AMX");
    tiles_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    tiles_ready = tiles_granted && !(off && *off && *off != '0');
#endif
}

int amx_tiles_ready(void) { return tiles_ready; }

/* Turns the tile paths on or off where they can run (tests check both paths in one process); returns the
 * state now. */
int use_amx_tiles(int on) { return tiles_ready = on && tiles_granted; }
