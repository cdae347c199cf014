"""The CUDA entries of the kernel table: kernels.py's getters (gemm, layer_ops, attention_kernel, report)
answer from here when the device is CUDA, with the same interfaces as the CPU's native entries.

bfloat16 and float16 run the Triton kernels of triton_kernels.py, each batch-invariant (a row's bits never
depend on the rest of the batch; that file says how), so a request's greedy tokens are the same alone or
in any crowd, in a prefill, a chunk or a decode. float32 keeps the torch twins (cuBLAS, with TF32 off by
torch's default, and scaled_dot_product_attention over gathered blocks): that is what equals
transformers token for token. Without Triton (a CPU-only torch, or a broken install) every getter says
None and the torch twins run, as on a CPU without a compiler.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from minivllm.model import activations
from minivllm.model.kv_cache import KVCache, kv_format, write_kv

CUDA_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_GROUPS = ("GEMM", "layer ops", "paged attention")  # what the Triton kernels cover; the rest is torch


@functools.lru_cache(maxsize=None)
def _triton_kernels() -> ModuleType | None:
    try:
        from minivllm.model import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def available(dtype: torch.dtype) -> bool:
    """Whether the Triton kernels serve this dtype here."""
    return dtype in CUDA_DTYPES and _triton_kernels() is not None


class TritonGemm:
    """The batch-invariant linear (triton_kernels.gemm) behind decoder.Linear's `native` interface: the
    weight needs no packing, so `pack` only makes it contiguous."""

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return weight.detach().contiguous(), None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        shape = x.shape
        out = _triton_kernels().gemm(x.reshape(-1, shape[-1]), weight, bias)
        return out.view(*shape[:-1], n)


class TritonLayerOps:
    """kernels.LayerOps' interface on CUDA, each op one Triton launch (what a captured step costs is mostly
    its number of kernels)."""

    def add_rms_norm(self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return _triton_kernels().add_rms_norm(delta, residual, weight, eps)

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        _triton_kernels().head_rms_norm_(x, weight, eps)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        _triton_kernels().rotary_(q, k, cos, sin)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                 cache: KVCache) -> None:
        if cache.fmt.quantized:  # the scales' twin; the Triton attention reads the model's dtype only
            n = blocks.shape[0]
            write_kv(k[:n], v[:n], blocks, offsets, cache)
            return
        _triton_kernels().write_kv(k, v, blocks, offsets, cache.k, cache.v)

    def act_and_mul(self, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
        if act == "swiglu_oai":  # element by element in torch: batch-invariant as it is
            return activations.act_and_mul(gate_up, act)
        return _triton_kernels().act_and_mul(gate_up, act)


class TritonAttention:
    """The paged-attention entry: every query of a step in one launch, read through the block table."""

    def __call__(self, q: torch.Tensor, cache: KVCache, meta, scale: float, out: torch.Tensor,
                 window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        """meta: attention.AttentionMetadata (its spans, block tables and max_span_len)."""
        _triton_kernels().paged_attention(q, cache.k, cache.v, meta.block_tables, meta.span_starts, meta.span_lens,
                                          meta.span_ctx0, meta.max_span_len, scale, out, window, softcap, sinks)


def gemm(dtype: torch.dtype) -> TritonGemm | None:
    return TritonGemm() if available(dtype) else None


def layer_ops(dtype: torch.dtype) -> TritonLayerOps | None:
    return TritonLayerOps() if available(dtype) else None


def attention_kernel(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> TritonAttention | None:
    """The Triton paged attention for this dtype, or None (float32, a quantized pool: the torch path)."""
    return TritonAttention() if available(dtype) and not kv_format(kv_cache_dtype).quantized else None


def report(dtype: torch.dtype) -> str:
    native = KERNEL_GROUPS if available(dtype) else ()
    return (f"minivllm: kernels for cuda/{str(dtype).removeprefix('torch.')}: "
            f"{', '.join(native) or 'nothing'} (Triton, batch-invariant); torch for: "
            f"{', '.join(f for f in ('quantized GEMM', 'LoRA', *KERNEL_GROUPS) if f not in native)}")
