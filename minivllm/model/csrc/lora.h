/* csrc/lora.c's layout constants, shared with the layer loop (forward.c) that calls it; kernels.py
 * mirrors them (LORA_LANES, LORA_CHUNK, MAX_LORA_RANK). */
#ifndef LORA_H
#define LORA_H

#define LORA_LANES 16      /* rank padding: a multiple of every target's LANES */
#define LORA_CHUNK 64      /* expand: output columns per pass; BT's rows are n padded to whole chunks */
#define LORA_TILE 4        /* rows of one segment that share each weight load */
#define MAX_LORA_RANK 1536 /* a fused q/k/v's three ranks of at most 512 each, padded */

#endif
