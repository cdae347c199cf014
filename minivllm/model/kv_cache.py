"""The paged KV pool: its storage formats (--kv-cache-dtype), its memory, and the torch twin of the
native kernels' quantization.

Formats. `auto` stores K and V in the model's dtype. The quantized formats store one byte per value
plus one float32 scale per (token, kv head), computed from that token's own values alone:
    scale = amax(|x|) * (1 / QMAX),  q = encode(clamp(x * (1 / scale), -QMAX, QMAX)),  x ~ decode(q) * scale
with QMAX the format's largest finite value: 127 for int8 (round to nearest even), 448 for fp8 e4m3 and
57344 for fp8 e5m2 (both rounded to nearest even by the fp8 encoding). A scale per block would change
as the block fills, so a token's stored bits would depend on its neighbours; a scale per token keeps
them a function of that token only (batch invariance, issue 12). An all-zero token gets scale 0.

Layout, per layer: K [blocks, kv_heads, head_dim, block_size] and V [blocks, kv_heads, block_size,
head_dim] (attention.kv_cache_shapes), and for the quantized formats their scales K_scale, V_scale
[blocks, kv_heads, block_size] float32 beside them. fp8 is held as uint8 bytes (indexing float8
tensors is not implemented everywhere) and viewed as torch's float8 dtype to convert.

Memory. On the CPU each tensor lies in its own private anonymous memory map. The kernel hands out such
pages lazily: an untouched page reads as zeros without being allocated, and becomes resident only
when something is first written to it. So a pool sized at 1 GiB costs the memory of the blocks a
job actually fills, while its size stays the limit the block manager plans with, and slots never
written read as zeros (the torch attention path multiplies masked-out slots by zero weights: garbage
there could be NaN, and NaN * 0 is NaN). Elsewhere (CUDA), the pool is allocated up front.
"""
from __future__ import annotations

import contextlib
import math
import mmap
from dataclasses import dataclass

import torch

from minivllm.config import KV_CACHE_DTYPES


@dataclass(frozen=True)
class KVFormat:
    """How K/V values are stored: `name` as the kernels call it, the storage dtype, and for the
    quantized formats the largest finite value and the torch dtype the bytes mean."""
    name: str
    storage: torch.dtype | None  # None: the model's dtype
    qmax: float = 0.0
    float8: torch.dtype | None = None

    @property
    def quantized(self) -> bool:
        return self.storage is not None

    @property
    def inv_qmax(self) -> float:
        """A token's scale is amax * inv_qmax, in float32, in the kernels and the twin alike."""
        return 1.0 / self.qmax

    def value_bytes(self, model_dtype: torch.dtype) -> int:
        return (self.storage or model_dtype).itemsize


_FORMATS = {
    "auto": KVFormat("auto", None),
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.uint8, 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.uint8, 57344.0, torch.float8_e5m2),
}


def kv_format(kv_cache_dtype: str) -> KVFormat:
    """The format of a --kv-cache-dtype value (vLLM's names: `fp8` is `fp8_e4m3`)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    return _FORMATS["fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                       fmt: KVFormat) -> int:
    """Pool bytes one token takes over all layers: K and V values, plus their two float32 scales per
    kv head when quantized."""
    per_head = 2 * head_dim * fmt.value_bytes(model_dtype) + (2 * 4 if fmt.quantized else 0)
    return num_layers * num_kv_heads * per_head


@dataclass
class KVCache:
    """One layer's pool: K and V as attention.kv_cache_shapes, and their per-(block, kv head, slot)
    float32 scales when the format is quantized (else None)."""
    k: torch.Tensor
    v: torch.Tensor
    fmt: KVFormat
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]


def zeros_on_write(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros whose CPU memory is only committed page by page, as it is written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    pages = mmap.mmap(-1, max(1, numel * dtype.itemsize), flags=mmap.MAP_PRIVATE)  # private: reads map the zero page
    # Huge pages where Linux grants them (THP "madvise" or "always"): decode attention jumps from block to
    # block across the pool, and on 4 KB pages nearly every block is a TLB miss (12 streams at 4,000
    # tokens of context: 0.94x the step time).
    with contextlib.suppress(OSError):  # a kernel without them: 4 KB pages
        pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


def allocate_kv_caches(num_layers: int, k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device, fmt: KVFormat = _FORMATS["auto"]) -> list[KVCache]:
    """k_shape, v_shape: attention.kv_cache_shapes; dtype: the model's (what `auto` stores)."""
    scale_shape = (k_shape[0], k_shape[1], k_shape[3])  # [blocks, kv_heads, block_size]
    caches = []
    for _ in range(num_layers):
        cache = KVCache(zeros_on_write(k_shape, fmt.storage or dtype, device),
                        zeros_on_write(v_shape, fmt.storage or dtype, device), fmt)
        if fmt.quantized:
            cache.k_scale = zeros_on_write(scale_shape, torch.float32, device)
            cache.v_scale = zeros_on_write(scale_shape, torch.float32, device)
        caches.append(cache)
    return caches


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, kv_heads, head_dim] -> (values in fmt.storage, same shape; scales [tokens, kv_heads]
    float32), one scale per token and head, exactly as csrc/layer_ops.c write_kv computes them."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) * torch.tensor(fmt.inv_qmax, dtype=torch.float32)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = (xf * inv[..., None]).clamp(-fmt.qmax, fmt.qmax)
    q = y.round().to(torch.int8) if fmt.float8 is None else y.to(fmt.float8).view(torch.uint8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """Stored values (any shape) times scales broadcast against them, in `dtype`."""
    values = q.float() if fmt.float8 is None else q.view(fmt.float8).float()
    return (values * scale).to(dtype)


def round_trip(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """What the pool gives back for x [tokens, kv_heads, head_dim]: x itself unless quantized."""
    if not fmt.quantized:
        return x
    q, scale = quantize(x, fmt)
    return dequantize(q, scale[..., None], fmt, x.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, cache: KVCache) -> None:
    """The torch twin of csrc/layer_ops.c write_kv: token i's K/V ([T, kv_heads, head_dim]) into slot
    (blocks[i], offsets[i]), quantized with its own scales when the format says so."""
    if cache.fmt.quantized:
        (k, k_scale), (v, v_scale) = quantize(k, cache.fmt), quantize(v, cache.fmt)
        cache.k_scale[blocks, :, offsets] = k_scale
        cache.v_scale[blocks, :, offsets] = v_scale
    cache.k[blocks, :, :, offsets] = k
    cache.v[blocks, :, offsets] = v
