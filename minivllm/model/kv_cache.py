"""The paged KV pool's memory: one K and one V tensor per layer, zeros until written.

On the CPU each tensor lies in its own private anonymous memory map. The kernel hands out such
pages lazily: an untouched page reads as zeros without being allocated, and becomes resident only
when something is first written to it. So a pool sized at 1 GiB costs the memory of the blocks a
job actually fills, while its size stays the limit the block manager plans with, and slots never
written read as zeros (the torch attention path multiplies masked-out slots by zero weights: garbage
there could be NaN, and NaN * 0 is NaN). Elsewhere (CUDA), the pool is allocated up front.
"""
from __future__ import annotations

import math
import mmap

import torch


def zeros_on_write(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros whose CPU memory is only committed page by page, as it is written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    pages = mmap.mmap(-1, max(1, numel * dtype.itemsize), flags=mmap.MAP_PRIVATE)  # private: reads map the zero page
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


def allocate_kv_caches(num_layers: int, k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(zeros_on_write(k_shape, dtype, device), zeros_on_write(v_shape, dtype, device))
            for _ in range(num_layers)]
