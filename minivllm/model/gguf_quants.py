"""GGUF block formats, decoded in torch straight from the file's mapped bytes.

One table of type traits (block size, bytes per block, how a batch of blocks becomes floats), as
llama.cpp's ggml keeps them; the loader asks the table and never branches on a format name. Each
decoder repeats the gguf package's numpy arithmetic operation for operation (the same float32
products and sums, in the same order), so its results are bit-identical to `gguf.quants.dequantize`;
it is only vectorized in torch, in chunks decoded in parallel by a pool of threads and written
straight into the output, so that no full float32 copy of a tensor exists when the model wants
another dtype. Formats not in the table fall back to the gguf package.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

QK_K = 256  # elements per super-block of the K-quants
# Elements decoded per task. About torch's parallel grain (32768), so that an op runs on the thread
# that calls it: the chunks are spread over a pool of threads instead (torch releases the GIL). Ops
# split over OpenMP threads would each end at a barrier, which stalls whenever another process holds
# one of the cores (20x slower on a busy 2-core machine).
CHUNK_ELEMENTS = 1 << 15


@dataclass(frozen=True)
class BlockFormat:
    block_size: int  # elements per block
    type_size: int  # bytes per block
    # [n, type_size] uint8 -> [n, block_size] float32
    decode: Callable[[torch.Tensor], torch.Tensor]
    # [n, type_size] uint8 -> Ints: the block as unsigned integers with a scale and offset per group, the
    # form the quantized kernels compute with (quant.py); None where a format has no such split.
    split: Callable[[torch.Tensor], "Ints"] | None = None


@dataclass
class Ints:
    """Blocks as w = d * u + m per group of `block_size / d.shape[1]` elements."""
    u: torch.Tensor  # uint8 [n, block_size]
    d: torch.Tensor  # float32 [n, groups]
    m: torch.Tensor  # float32 [n, groups]
    bits: int  # 4 when every u fits a nibble, else 8


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [n, 1] (exact)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k] uint8: the k low nibbles, then the k high ones (ggml's order).
    Written into one buffer: no concatenation pass."""
    out = torch.empty((*qs.shape[:-1], 2, qs.shape[-1]), dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[..., 0, :])
    torch.bitwise_right_shift(qs, 4, out=out[..., 1, :])
    return out.view(*qs.shape[:-1], 2 * qs.shape[-1])


# Each decoder is the gguf package's formula with the same float32 operations in the same order.
# An integer tensor times a float32 one is computed in float32 from the exact conversion, as numpy's
# `astype(np.float32)` then multiply is.
def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # d * q
    return torch.mul(blocks[:, 2:].view(torch.int8), _f16(blocks, 0))


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # d * (q - 8)
    return torch.mul(_nibbles(blocks[:, 2:]).view(torch.int8).sub_(8), _f16(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # d * q + m
    return torch.mul(_nibbles(blocks[:, 4:]), _f16(blocks, 0)).add_(_f16(blocks, 2))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:  # (d * scale) * q - (dmin * min), q of 5 bits
    n = blocks.shape[0]
    sc, mn = _q4_k_scales(blocks[:, 4:16])
    scale = torch.mul(sc, _f16(blocks, 0)).view(n, 8, 1)
    offset = torch.mul(mn, _f16(blocks, 2)).view(n, 8, 1)
    return torch.mul(_q5_k_values(blocks), scale).sub_(offset).view(n, QK_K)


def _q5_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 8, 32] uint8: four chunks of 32 bytes hold the low nibbles of sub-blocks 2j and 2j + 1; bits
    2j and 2j + 1 of the 32 qh bytes are their fifth bits."""
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).view(n, 8, 32)
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    return low | (((qh >> shifts) & 1) << 4)


def _q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in 12 bytes (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # (d * scale) * q - (dmin * min), per sub-block of 32
    n = blocks.shape[0]
    sc, mn = _q4_k_scales(blocks[:, 4:16])
    scale = torch.mul(sc, _f16(blocks, 0)).view(n, 8, 1)
    offset = torch.mul(mn, _f16(blocks, 2)).view(n, 8, 1)
    # 4 groups of 32 bytes; each holds 32 low nibbles then 32 high ones.
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).view(n, 8, 32)
    return torch.mul(q, scale).sub_(offset).view(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # (d * scale) * (q - 32), per sub-block of 16
    n = blocks.shape[0]
    scale = torch.mul(blocks[:, 192:208].view(torch.int8), _f16(blocks, 208)).view(n, 16, 1)
    q = _q6_k_values(blocks).view(torch.int8).sub_(32).view(n, 16, 16)
    return torch.mul(q, scale).view(n, QK_K)


def _q6_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 256] uint8, 0..63: four low bits from the 128 ql bytes, two high ones from the 64 qh bytes."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    low = _nibbles(ql.reshape(n, 2, 64)).view(n, 8, 32)
    high = torch.stack([(qh.reshape(n, 2, 32) >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).view(n, 8, 32)
    return (low | (high << 4)).view(n, QK_K)


# The integer splits: exact for the formats with float16 scales; the K-quants' scale products
# (d * 6-bit scale) are exact in float32 here and rounded to float16 only when packed (quant.py).
def _q8_0_ints(blocks: torch.Tensor) -> Ints:  # u = q + 128, m = -128 d
    d = _f16(blocks, 0)
    u = blocks[:, 2:].view(torch.int8).to(torch.int16).add_(128).to(torch.uint8)
    return Ints(u, d, d * -128, 8)


def _q4_0_ints(blocks: torch.Tensor) -> Ints:  # m = -8 d
    d = _f16(blocks, 0)
    return Ints(_nibbles(blocks[:, 2:]), d, d * -8, 4)


def _q4_1_ints(blocks: torch.Tensor) -> Ints:
    return Ints(_nibbles(blocks[:, 4:]), _f16(blocks, 0), _f16(blocks, 2), 4)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's per-sub-block scale and offset: d * scale and -(dmin * min), float32 [n, 8]."""
    sc, mn = _q4_k_scales(blocks[:, 4:16])
    return torch.mul(sc, _f16(blocks, 0)), torch.mul(mn, _f16(blocks, 2)).neg_()


def _q4_k_ints(blocks: torch.Tensor) -> Ints:
    n = blocks.shape[0]
    return Ints(_nibbles(blocks[:, 16:].reshape(n, 4, 32)).view(n, QK_K), *_k_scales(blocks), 4)


def _q5_k_ints(blocks: torch.Tensor) -> Ints:
    return Ints(_q5_k_values(blocks).view(blocks.shape[0], QK_K), *_k_scales(blocks), 8)


def _q6_k_ints(blocks: torch.Tensor) -> Ints:  # u = q, m = -32 d per sub-block of 16
    d = torch.mul(blocks[:, 192:208].view(torch.int8), _f16(blocks, 208))
    return Ints(_q6_k_values(blocks), d, d * -32, 8)


# ggml's type ids (GGMLQuantizationType) of the formats decoded here.
BLOCK_FORMATS = {
    8: BlockFormat(32, 34, _q8_0, _q8_0_ints),  # Q8_0: float16 scale, 32 int8
    2: BlockFormat(32, 18, _q4_0, _q4_0_ints),  # Q4_0: float16 scale, 32 nibbles offset by 8
    3: BlockFormat(32, 20, _q4_1, _q4_1_ints),  # Q4_1: float16 scale and min, 32 nibbles
    12: BlockFormat(QK_K, 144, _q4_k, _q4_k_ints),  # Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins
    13: BlockFormat(QK_K, 176, _q5_k, _q5_k_ints),  # Q5_K: as Q4_K with a fifth bit per element
    14: BlockFormat(QK_K, 210, _q6_k, _q6_k_ints),  # Q6_K: 16 sub-blocks of 16 with int8 scales
}
# Plain floats: the file's bytes are the tensor, read in place (converted only if the dtype differs).
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # F32, F16, BF16


def type_size(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type; the gguf package knows the others."""
    if qtype in BLOCK_FORMATS:
        return BLOCK_FORMATS[qtype].block_size, BLOCK_FORMATS[qtype].type_size
    if qtype in FLOAT_TYPES:
        return 1, FLOAT_TYPES[qtype].itemsize
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A GGUF tensor's bytes (uint8, flat) as a `dtype` tensor of `shape`. Plain float types come
    back as views of `raw` where the dtype matches (no copy)."""
    if qtype in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[qtype]).view(shape).to(dtype)
    fmt = BLOCK_FORMATS.get(qtype)
    if fmt is None:  # a format without a torch decoder here: the gguf package's numpy code
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as np_dequantize

        return torch.from_numpy(np_dequantize(raw.numpy(), GGMLQuantizationType(qtype)).reshape(shape)).to(dtype)
    blocks = raw.view(-1, fmt.type_size)
    out = torch.empty((blocks.shape[0], fmt.block_size), dtype=dtype)

    def decode_chunk(start: int, end: int) -> None:
        out[start:end] = fmt.decode(blocks[start:end])

    _in_chunks(blocks.shape[0], fmt.block_size, decode_chunk)
    return out.view(shape)


def split(raw: torch.Tensor, qtype: int) -> Ints:
    """A GGUF tensor's blocks (uint8, flat) split into integers and scales (`BlockFormat.split`)."""
    fmt = BLOCK_FORMATS[qtype]
    blocks = raw.view(-1, fmt.type_size)
    parts: dict[int, Ints] = {}

    def split_chunk(start: int, end: int) -> None:
        parts[start] = fmt.split(blocks[start:end])

    _in_chunks(blocks.shape[0], fmt.block_size, split_chunk)
    chunks = [parts[k] for k in sorted(parts)]
    return Ints(*(torch.cat([getattr(c, f) for c in chunks]) for f in ("u", "d", "m")), chunks[0].bits)


def _in_chunks(num_blocks: int, block_size: int, work) -> None:
    """work(start, end) over chunks of blocks, spread over the pool of threads."""
    step = max(1, CHUNK_ELEMENTS // block_size)
    starts = range(0, num_blocks, step)
    for _ in _pool().map(lambda start: work(start, min(start + step, num_blocks)), starts):
        pass  # (re-raises a chunk's error)


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="minivllm-dequantize")
