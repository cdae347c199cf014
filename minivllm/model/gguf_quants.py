"""GGUF block formats: one table of type traits, and each block split into integers and scales.

As llama.cpp's ggml keeps them, each format is a row of one table (elements and bytes per block, how
a block splits into integers and scales, the shape of those integers); the loader, the packer and the
kernels ask the table and never branch on a format name. Every format splits into the same form,
`Ints`, so that one decoder (here), one packer and one kernel family (quant.py, csrc/quant_gemm.c)
serve them all:

    w = d * sc * (v - offset) - dmin * mn    the K-quants and IQ4_XS (sc, mn per sub-block of 16 or 32)
    w = d * (v - offset) + dmin              the 32-element formats (dmin is Q4_1's and Q5_1's m)

with v the stored integer u, or for the IQ4 formats and MXFP4 their table's value at index u, shifted
to be unsigned (`IQ4_VALUES` or `MXFP4_VALUES`, + 128). The float decoder computes it with the gguf package's float32
operations in its order, so that its results are bit-identical to `gguf.quants.dequantize`; it runs
in chunks on threads, written straight into the output, so that no full float32 copy of a
tensor exists when the model wants another dtype.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

QK_K = 256  # elements per super-block of the K-quants and IQ4_XS
# Elements decoded per task. About torch's parallel grain (32768), so that an op runs on the thread
# that calls it: the chunks are spread over a pool of threads instead (torch releases the GIL). Ops
# split over OpenMP threads would each end at a barrier, which stalls whenever another process holds
# one of the cores (20x slower on a busy 2-core machine).
CHUNK_ELEMENTS = 1 << 15
# With one thread no op can split, and small chunks only pay Python's cost per op: 2.4x as fast with
# these (the 0.5B file's Q5_0 tensors at OMP_NUM_THREADS=1, as the suite runs).
CHUNK_ELEMENTS_ONE_THREAD = 1 << 19
# IQ4_NL's and IQ4_XS's 16 non-uniform levels (ggml's kvalues_iq4nl), int8.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4's (gpt-oss) 16 levels: E2M1's values doubled (ggml's kvalues_mxfp4), the scale halved to match.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass
class Ints:
    """Blocks split: the integers in element order and the scales that make them weights (see above)."""
    u: torch.Tensor  # uint8 [n, block_size]: the stored integers (IQ4, MXFP4: indices into the format's table)
    d: torch.Tensor  # float32 [n, 1], float16 values (MXFP4: powers of 2): the block's or super-block's scale
    dmin: torch.Tensor | None = None  # float32 [n, 1], float16 values: the super-block's min scale, or m
    sc: torch.Tensor | None = None  # int16 [n, groups]: sub-block scales (signed where the format's are)
    mn: torch.Tensor | None = None  # int16 [n, groups]: sub-block mins


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block
    split: Callable[[torch.Tensor], Ints]  # [n, type_size] uint8 -> Ints
    bits: int  # of the integers u: 2, 3, 4, 5, 6 or 8
    group: int  # elements per scale: the block (32) or a K-quant's sub-block (16 or 32)
    offset: int = 0  # subtracted from v: what makes unsigned integers signed weights
    lut: tuple[int, ...] | None = None  # v = lut[u] + 128: IQ4_VALUES or MXFP4_VALUES
    has_min: bool = False  # a float16 dmin: Q4_1's and Q5_1's m, or a K-quant's min scale
    sub_scales: str | None = None  # K-quants: "u8" (6-bit scale and min), "i8" (signed scale),
    # "nibbles" (Q2_K: a 4-bit scale and min in one byte)
    e8m0: bool = False  # MXFP4: d is a power of 2 stored as its exponent byte e, d = 2^(e - 128)


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


def _bit_planes(qs: torch.Tensor, planes: int, width: int) -> torch.Tensor:
    """[n, b] bytes -> [n, planes * b] uint8: the `width`-bit field at bit `width * p` of every byte,
    plane p after plane p - 1 (ggml's order for Q2_K/Q3_K/Q6_K's crumbs and the K-quants' high bits)."""
    shifts = torch.arange(0, planes * width, width, dtype=torch.uint8).view(1, planes, 1)
    return ((qs.unsqueeze(1) >> shifts) & ((1 << width) - 1)).view(qs.shape[0], -1)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[n, 64] bytes -> [n, 256]: Q2_K's and Q3_K's 2-bit values; each half of 32 bytes holds 128."""
    n = qs.shape[0]
    return _bit_planes(qs.reshape(n * 2, 32), 4, 2).view(n, QK_K)


def _high_bits(qh: torch.Tensor, planes: int) -> torch.Tensor:
    """[n, 32] bytes -> [n, 32 * planes]: bit p of byte l is element p * 32 + l."""
    return _bit_planes(qh, planes, 1)


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's and Q5_1's 32 fifth bits, a little-endian uint32: bit j is element j's."""
    return _bit_planes(qh, 8, 1).view(-1, 8, 4).transpose(1, 2).reshape(-1, 32)


# -- the splits, one per format --------------------------------------------------------------------
def _q4_0(b: torch.Tensor) -> Ints:
    return Ints(_nibbles(b[:, 2:]), _f16(b, 0))


def _q4_1(b: torch.Tensor) -> Ints:
    return Ints(_nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2))


def _q5_0(b: torch.Tensor) -> Ints:
    return Ints(_nibbles(b[:, 6:]) | (_q5_high(b[:, 2:6]) << 4), _f16(b, 0))


def _q5_1(b: torch.Tensor) -> Ints:
    return Ints(_nibbles(b[:, 8:]) | (_q5_high(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2))


def _q8_0(b: torch.Tensor) -> Ints:  # signed bytes made unsigned: u = q + 128
    return Ints(b[:, 2:] ^ 0x80, _f16(b, 0))


def _iq4_nl(b: torch.Tensor) -> Ints:
    return Ints(_nibbles(b[:, 2:]), _f16(b, 0))


def e8m0_scale(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's exponent bytes as its scales, float32 2^(e - 128) (exact: 2^-128 is a float32 subnormal)."""
    return torch.ldexp(torch.ones(e.shape), e.to(torch.int32) - 128)


def _mxfp4(b: torch.Tensor) -> Ints:  # e (E8M0), qs[16]: d = 2^(e - 128), half the exponent's scale
    return Ints(_nibbles(b[:, 1:]), e8m0_scale(b[:, :1]))


def _q2_k(b: torch.Tensor) -> Ints:  # scales[16] (scale | min << 4), qs[64], d, dmin
    scales = b[:, :16].to(torch.int16)
    return Ints(_crumbs(b[:, 16:80]), _f16(b, 80), _f16(b, 82), scales & 0x0F, scales >> 4)


def _q3_k(b: torch.Tensor) -> Ints:  # hmask[32], qs[64], scales[12] (16 of 6 bits), d
    n = b.shape[0]
    low, high = b[:, 96:104], b[:, 104:108]
    lscales = _bit_planes(low, 2, 4)  # the 8 low nibbles, then the 8 high ones
    hscales = _bit_planes(high, 4, 2)
    sc = (lscales | (hscales << 4)).to(torch.int16) - 32
    u = _crumbs(b[:, 32:96]) | (_high_bits(b[:, :32], 8) << 2)  # a set bit: no -4, so u = q + 4
    return Ints(u.view(n, QK_K), _f16(b, 108), sc=sc)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's eight 6-bit scales and mins packed in 12 bytes (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.to(torch.int16), mn.to(torch.int16)


def _q4_k(b: torch.Tensor) -> Ints:  # d, dmin, scales[12], qs[128]: 4 chunks of 32 low then 32 high
    n = b.shape[0]
    return Ints(_nibbles(b[:, 16:].reshape(n, 4, 32)).view(n, QK_K), _f16(b, 0), _f16(b, 2), *_k_scales(b[:, 4:16]))


def _q5_k(b: torch.Tensor) -> Ints:  # as Q4_K, with qh[32] before qs: bit p of byte l is element p * 32 + l's
    n = b.shape[0]
    low = _nibbles(b[:, 48:].reshape(n, 4, 32)).view(n, QK_K)
    return Ints(low | (_high_bits(b[:, 16:48], 8) << 4), _f16(b, 0), _f16(b, 2), *_k_scales(b[:, 4:16]))


def _q6_k(b: torch.Tensor) -> Ints:  # ql[128], qh[64], scales[16] int8, d
    n = b.shape[0]
    low = _nibbles(b[:, :128].reshape(n, 2, 64)).view(n, QK_K)
    high = _bit_planes(b[:, 128:192].reshape(n * 2, 32), 4, 2).view(n, QK_K)
    return Ints(low | (high << 4), _f16(b, 208), sc=b[:, 192:208].view(torch.int8).to(torch.int16))


def _iq4_xs(b: torch.Tensor) -> Ints:  # d, scales_h (uint16), scales_l[4], qs[128]
    n = b.shape[0]
    low = _bit_planes(b[:, 4:8], 2, 4).view(n, 2, 4).transpose(1, 2).reshape(n, 8)
    high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)
    high = (high >> torch.arange(0, 16, 2, dtype=torch.int32)) & 0x03
    sc = (low.to(torch.int16) | (high.to(torch.int16) << 4)) - 32
    return Ints(_nibbles(b[:, 8:].reshape(n, 8, 16)).view(n, QK_K), _f16(b, 0), sc=sc)


# ggml's type ids (GGMLQuantizationType) -> traits. Every format llama.cpp's quantizer writes into the
# common files, and gpt-oss's MXFP4; the others (IQ1-IQ3, TQ, ...) are refused at load (gguf_reader.py).
BLOCK_FORMATS = {
    2: BlockFormat("Q4_0", 32, 18, _q4_0, 4, 32, offset=8),
    3: BlockFormat("Q4_1", 32, 20, _q4_1, 4, 32, has_min=True),
    6: BlockFormat("Q5_0", 32, 22, _q5_0, 5, 32, offset=16),
    7: BlockFormat("Q5_1", 32, 24, _q5_1, 5, 32, has_min=True),
    8: BlockFormat("Q8_0", 32, 34, _q8_0, 8, 32, offset=128),
    10: BlockFormat("Q2_K", QK_K, 84, _q2_k, 2, 16, sub_scales="nibbles", has_min=True),
    11: BlockFormat("Q3_K", QK_K, 110, _q3_k, 3, 16, offset=4, sub_scales="i8"),
    12: BlockFormat("Q4_K", QK_K, 144, _q4_k, 4, 32, sub_scales="u8", has_min=True),
    13: BlockFormat("Q5_K", QK_K, 176, _q5_k, 5, 32, sub_scales="u8", has_min=True),
    14: BlockFormat("Q6_K", QK_K, 210, _q6_k, 6, 16, offset=32, sub_scales="i8"),
    20: BlockFormat("IQ4_NL", 32, 18, _iq4_nl, 4, 32, offset=128, lut=IQ4_VALUES),
    23: BlockFormat("IQ4_XS", QK_K, 136, _iq4_xs, 4, 32, offset=128, lut=IQ4_VALUES, sub_scales="i8"),
    39: BlockFormat("MXFP4", 32, 17, _mxfp4, 4, 32, offset=128, lut=MXFP4_VALUES, e8m0=True),
}
# Plain floats: the file's bytes are the tensor, read in place (converted only if the dtype differs).
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # F32, F16, BF16


def format_name(qtype: int) -> str:
    """A ggml type's name, for messages."""
    if qtype in BLOCK_FORMATS:
        return BLOCK_FORMATS[qtype].name
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def supported_types() -> str:
    return ", ".join([fmt.name for fmt in BLOCK_FORMATS.values()] + ["F32", "F16", "BF16"])


def type_size(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type; the gguf package knows the others."""
    if qtype in BLOCK_FORMATS:
        return BLOCK_FORMATS[qtype].block_size, BLOCK_FORMATS[qtype].type_size
    if qtype in FLOAT_TYPES:
        return 1, FLOAT_TYPES[qtype].itemsize
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def values(fmt: BlockFormat, u: torch.Tensor) -> torch.Tensor:
    """v: the integers the scales multiply, unsigned (the IQ4 formats' and MXFP4's table, shifted by 128)."""
    if fmt.lut is None:
        return u
    table = (torch.tensor(fmt.lut, dtype=torch.int16) + 128).to(torch.uint8).to(u.device)
    return table[u.long()]


def decode(fmt: BlockFormat, ints: Ints) -> torch.Tensor:
    """Ints -> float32 [n, block_size], with the gguf package's float32 operations in its order."""
    n = ints.u.shape[0]
    # Small integers are exact in float32, so converting first changes no bit of the products, and the
    # float ops run in place (an int16 tensor times a float one took 9x as long).
    q = values(fmt, ints.u).to(torch.float32)
    if fmt.offset:
        q.sub_(fmt.offset)
    if fmt.sub_scales is None:
        w = q.mul_(ints.d)
        return w if ints.dmin is None else w.add_(ints.dmin)
    groups = fmt.block_size // fmt.group
    scale = torch.mul(ints.sc, ints.d).view(n, groups, 1)
    w = q.view(n, groups, fmt.group).mul_(scale)
    if ints.mn is not None:
        w.sub_(torch.mul(ints.mn, ints.dmin).view(n, groups, 1))
    return w.view(n, fmt.block_size)


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A GGUF tensor's bytes (uint8, flat) as a `dtype` tensor of `shape`. Plain float types come
    back as views of `raw` where the dtype matches (no copy)."""
    if qtype in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[qtype]).view(shape).to(dtype)
    fmt = BLOCK_FORMATS[qtype]
    blocks = raw.view(-1, fmt.type_size)
    out = torch.empty((blocks.shape[0], fmt.block_size), dtype=dtype)

    def decode_chunk(start: int, end: int) -> None:
        out[start:end] = decode(fmt, fmt.split(blocks[start:end]))

    _in_chunks(blocks.shape[0], fmt.block_size, decode_chunk)
    return out.view(shape)


def _in_chunks(num_blocks: int, block_size: int, work) -> None:
    """work(start, end) over chunks of blocks, spread over threads."""
    step = max(1, (CHUNK_ELEMENTS if torch.get_num_threads() > 1 else CHUNK_ELEMENTS_ONE_THREAD) // block_size)
    in_parallel(lambda start: work(start, min(start + step, num_blocks)), range(0, num_blocks, step))


def in_parallel(work, items) -> None:
    """work(item) for every item on a pool of threads that ends with the call (re-raising an item's error).
    Not a pool kept for later: a thread that ran torch ops keeps an OpenMP team of its own, and idle teams
    beside the kernels' own slowed batch-1 GEMMs 2-7x on 2 cores."""
    with ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="minivllm-decode") as pool:
        for _ in pool.map(work, items):
            pass
