/* Which section of simd.h this library was built with, for kernels.py's report: "none" where the
 * target has no GEMM section (the GEMMs and the layer loop are then torch's). */
#include "simd.h"

#ifndef SIMD_NAME
#define SIMD_NAME "none"
#endif

const char *simd_target(void) { return SIMD_NAME; }
