"""Quantized weights: a GGUF file's blocks, held at the file's size and never dequantized on the CPU.

A `QuantizedTensor` is a matrix as the file stores it: each row's blocks in one of the block formats
of gguf_quants.py (or a float checkpoint quantized at load: `--quantization int8` makes Q8_0 blocks,
`int4` Q4_1). For the kernels it is packed once, per format, into column panels (`pack`), a
rearrangement that keeps each format's bits: the weights held stay within 1.05x of the file's bytes,
which is what a decode step streams. The native kernel (csrc/quant_gemm.c) reads that layout; its torch
twin here (`linear_twin`) unpacks it in chunks and does the same arithmetic in torch (the CUDA path,
machines without a compiler, MINIVLLM_NO_KERNELS=1, and the reference its tests check it against).

The packed layout, per panel of 16 output columns (rows of the weight), per super-block of the format
(256 k for the K-quants and IQ4_XS, 32 for the others):
  per 32-k block, the integers u in bit planes, arranged for vpdpbusd (8 groups of 4 k; in a group
  column c's 4 k at bytes c * 4 .. c * 4 + 3):
    8 bits   512 bytes: byte g * 64 + c * 4 + j is group g's
    4 bits   256 bytes: byte t * 64 + c * 4 + j holds group t (low nibble) and t + 4 (high nibble)
    2 bits   128 bytes: byte t * 64 + c * 4 + j holds groups t, t + 2, t + 4, t + 6 (bits 0, 2, 4, 6)
  then the bits above those (5-bit formats and Q3_K: 64 bytes, bit g of byte c * 4 + j is group g's;
  Q6_K: 128 bytes of 2-bit fields as above);
  then the scales: 16 float16 d (MXFP4: 16 exponent bytes, as the file has them), 16 float16 dmin (formats
  with a min), and per sub-block 16 bytes of integer scales (K-quants, IQ4_XS), then 16 of integer mins
  (Q4_K, Q5_K; Q2_K keeps scale | min << 4).
Each format's rule (gguf_quants.py) makes a weight of these: w = d * v + m per group of 16 or 32 k,
with d = d * sc and m = -(dmin * mn), m = dmin, or m = -offset * d (exact: every offset is a power of 2).

The activations are quantized per row and per 32 k (dx = amax / 127, x8 = round(x / dx)), so that each
group is an exact integer dot product; a row's result depends on that row alone (issue 12).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minivllm.model.gguf_quants import BLOCK_FORMATS, BlockFormat, Ints, dequantize, e8m0_scale, in_parallel, values

GROUP = 32  # k per activation block (and per 32-k block of every layout)
PANEL = 16  # csrc/quant_gemm.c: output columns per packed panel
PACK_ROWS = 1024  # rows packed per task (a multiple of PANEL)
Q8_0, Q4_1 = 8, 3  # `--quantization int8` and `int4`: the ggml formats a float weight is quantized into
MXFP4 = 39  # gpt-oss's experts, from a GGUF file or the checkpoint's _blocks and _scales (hf_reader.py)
_PLANE_BITS = {2: (2, 0), 3: (2, 1), 4: (4, 0), 5: (4, 1), 6: (4, 2), 8: (8, 0)}  # bits -> (low, high) planes


@dataclass
class QuantizedTensor:
    """A matrix [n, k] as a GGUF file stores it: row by row, in blocks of format `qtype`."""
    blocks: torch.Tensor  # uint8 [n, bytes per row]
    qtype: int  # ggml's type id, a key of gguf_quants.BLOCK_FORMATS

    @property
    def fmt(self) -> BlockFormat:
        return BLOCK_FORMATS[self.qtype]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] // self.fmt.type_size * self.fmt.block_size))

    def ints(self) -> Ints:
        """The blocks split (gguf_quants.Ints), one row of Ints per block."""
        return self.fmt.split(self.blocks.reshape(-1, self.fmt.type_size))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.blocks.reshape(-1), self.qtype, tuple(self.shape), dtype)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedTensor":
        """Rows (dim 0) or whole blocks of columns (dim 1): what tensor parallelism shards."""
        if dim == 0:
            return QuantizedTensor(self.blocks.narrow(0, start, length), self.qtype)
        block, size = self.fmt.block_size, self.fmt.type_size
        if start % block or length % block:
            raise ValueError(f"a {self.fmt.name} weight splits along k at multiples of {block}, not {start}+{length}")
        return QuantizedTensor(self.blocks.narrow(1, start // block * size, length // block * size), self.qtype)


def fuse_rows(parts: list) -> "torch.Tensor | list[QuantizedTensor]":
    """Fuse weights along the output dimension (q/k/v, gate/up): float tensors into one; quantized ones
    into runs of one format each (a Q5_0 q and k beside a Q8_0 v make two), computed as separate GEMMs
    into one output. A float part among quantized ones makes the whole float (no bit is lost)."""
    if not all(isinstance(p, QuantizedTensor) for p in parts):
        return torch.cat([p.dequantize() if isinstance(p, QuantizedTensor) else p for p in parts])
    runs: list[QuantizedTensor] = []
    for p in parts:
        if runs and runs[-1].qtype == p.qtype:
            runs[-1] = QuantizedTensor(torch.cat([runs[-1].blocks, p.blocks]), p.qtype)
        else:
            runs.append(p)
    return runs


# -- quantizing a float weight at load (`--quantization int8|int4`) ----------------------------------
def quantize(w: torch.Tensor, scheme: str) -> QuantizedTensor:
    """A float weight [n, k] in ggml's blocks: `int8` as Q8_0 (d = amax / 127 per 32), `int4` as Q4_1
    (d = (max - min) / 15 and m = min per 32). Each block rounds to nearest with its float16 scales."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"--quantization {scheme} needs in_features divisible by {GROUP}, not {k}")
    x = w.float().view(n, k // GROUP, GROUP)
    if scheme == "int8":
        d = (x.abs().amax(dim=2, keepdim=True) / 127).half()
        q = torch.where(d > 0, x / d.float(), 0).round().clamp(-127, 127).to(torch.int8)
        blocks = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=2)
        return QuantizedTensor(blocks.view(n, -1), Q8_0)
    lo, hi = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    d, m = ((hi - lo) / 15).half(), lo.half()
    q = torch.where(d > 0, (x - m.float()) / d.float(), 0).round().clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat([d.view(torch.uint8), m.view(torch.uint8), nibbles], dim=2)
    return QuantizedTensor(blocks.view(n, -1), Q4_1)


# -- the packed layout (module docstring; csrc/quant_gemm.c reads it) ------------------------------------
@functools.lru_cache(maxsize=1)
def layout_key() -> str:
    """A hash of this file, which defines the packed layout (`pack`) for every CPU target the kernels are
    built for (csrc/simd.h's sections all read it): what the weight cache's entries are keyed by."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def superblock(fmt: BlockFormat) -> int:
    """k per packed super-block: the format's block."""
    return fmt.block_size


def plane_bytes(fmt: BlockFormat) -> int:
    """Bytes of one 32-k block's integer planes in a panel."""
    return PANEL * GROUP * fmt.bits // 8


def scale_bytes(fmt: BlockFormat) -> int:
    """Bytes of one super-block's scales in a panel."""
    groups = superblock(fmt) // fmt.group if fmt.sub_scales else 0
    mins = fmt.sub_scales == "u8"
    return PANEL * (1 if fmt.e8m0 else 2) + 2 * PANEL * fmt.has_min + groups * PANEL * (1 + mins)


def superblock_bytes(fmt: BlockFormat) -> int:
    return superblock(fmt) // GROUP * plane_bytes(fmt) + scale_bytes(fmt)


def pack(t: QuantizedTensor) -> torch.Tensor:
    """uint8 [panels, k / super-block * super-block bytes]: the layout above; columns past n are zero.
    In torch, chunks of rows on threads: it runs once per model (weight_cache.py keeps it)."""
    n, k = t.shape
    fmt = t.fmt
    out = torch.empty(-(-n // PANEL), k // superblock(fmt) * superblock_bytes(fmt), dtype=torch.uint8)

    def pack_rows(start: int, end: int) -> None:
        rows = t.blocks[start:end]
        if rows.shape[0] % PANEL:  # zero blocks: every format's zero bytes decode to finite weights
            rows = torch.cat([rows, rows.new_zeros(PANEL - rows.shape[0] % PANEL, rows.shape[1])])
        out[start // PANEL:-(-end // PANEL)] = _pack_panels(fmt, QuantizedTensor(rows, t.qtype))

    in_parallel(lambda start: pack_rows(start, min(start + PACK_ROWS, n)), range(0, n, PACK_ROWS))
    return out


def _pack_panels(fmt: BlockFormat, t: QuantizedTensor) -> torch.Tensor:
    """Whole panels of rows -> [panels, super-blocks * super-block bytes]."""
    n, k = t.shape
    panels, sbs, blocks = n // PANEL, k // superblock(fmt), superblock(fmt) // GROUP
    ints = t.ints()
    u = ints.u.reshape(panels, PANEL, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)  # [P, B, g, c, j]
    low_bits, high_bits = _PLANE_BITS[fmt.bits]
    planes = [_planes(u & ((1 << low_bits) - 1), low_bits)]
    if high_bits:
        planes.append(_planes(u >> low_bits, high_bits))
    planes = torch.cat([p.reshape(panels, k // GROUP, -1) for p in planes], dim=2)
    parts = [planes.reshape(panels, sbs, blocks * plane_bytes(fmt))]

    def per_column(x: torch.Tensor) -> torch.Tensor:  # [n * sbs, width] -> [P, sbs, width * 16] bytes
        x = x.reshape(panels, PANEL, sbs, -1).permute(0, 2, 3, 1).contiguous()
        return x.view(torch.uint8).reshape(panels, sbs, -1)

    # MXFP4's exponent byte back from its power of 2 (frexp: 2^(e - 128) = 0.5 * 2^(e - 127))
    parts.append(per_column((torch.frexp(ints.d).exponent + 127).to(torch.uint8) if fmt.e8m0 else ints.d.half()))
    if fmt.has_min:
        parts.append(per_column(ints.dmin.half()))
    if fmt.sub_scales == "nibbles":
        parts.append(per_column((ints.sc | (ints.mn << 4)).to(torch.uint8)))
    elif fmt.sub_scales:
        parts.append(per_column(ints.sc.to(torch.int8)))
        if ints.mn is not None:
            parts.append(per_column(ints.mn.to(torch.uint8)))
    return torch.cat(parts, dim=2).reshape(panels, -1)


def _planes(x: torch.Tensor, bits: int) -> torch.Tensor:
    """[P, B, 8 groups, 16, 4] fields of `bits` bits -> the bytes of their plane, [P, B, ...]."""
    if bits == 8:
        return x
    if bits == 4:
        return x[:, :, :4] | (x[:, :, 4:] << 4)
    if bits == 2:
        return x[:, :, 0:2] | (x[:, :, 2:4] << 2) | (x[:, :, 4:6] << 4) | (x[:, :, 6:8] << 6)
    shifted = x & 1  # bits == 1: bit g of each byte is group g's
    out = shifted[:, :, 0].clone()
    for g in range(1, 8):
        out |= shifted[:, :, g] << g
    return out


def unpack(packed: torch.Tensor, fmt: BlockFormat, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack`, as the kernel reads it: (v uint8 [n, k], d and m float32 [n, k / group]),
    w = d * v + m per group of `fmt.group` k (v: the IQ4 table's value where the format has one)."""
    panels = packed.shape[0]
    sbs, blocks = k // superblock(fmt), superblock(fmt) // GROUP
    sb = packed.view(panels, sbs, superblock_bytes(fmt))
    planes = sb[:, :, :blocks * plane_bytes(fmt)].reshape(panels, sbs * blocks, plane_bytes(fmt))
    low_bits, high_bits = _PLANE_BITS[fmt.bits]
    low_size = PANEL * GROUP * low_bits // 8
    u = _fields(planes[:, :, :low_size], low_bits)
    if high_bits:
        u = u | (_fields(planes[:, :, low_size:], high_bits) << low_bits)
    u = u.permute(0, 3, 1, 2, 4).reshape(panels * PANEL, k)[:n]  # [P, B, g, c, j] -> rows
    v = values(fmt, u)
    scales = sb[:, :, blocks * plane_bytes(fmt):]

    def per_column(start: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        size = width * PANEL * dtype.itemsize
        x = scales[:, :, start:start + size].contiguous().view(dtype).view(panels, sbs, width, PANEL)
        return x.permute(0, 3, 1, 2).reshape(panels * PANEL, sbs * width)[:n].float(), start + size

    d, at = per_column(0, 1, torch.uint8 if fmt.e8m0 else torch.float16)
    if fmt.e8m0:
        d = e8m0_scale(d)
    dmin, at = per_column(at, 1, torch.float16) if fmt.has_min else (None, at)
    groups = superblock(fmt) // fmt.group
    if not fmt.sub_scales:
        return v, d, dmin if dmin is not None else d * -fmt.offset
    if fmt.sub_scales == "nibbles":
        both, at = per_column(at, groups, torch.uint8)
        sc, mn = both.int() & 0x0F, both.int() >> 4
    else:
        sc, at = per_column(at, groups, torch.int8 if fmt.sub_scales == "i8" else torch.uint8)
        mn, at = per_column(at, groups, torch.uint8) if fmt.has_min else (None, at)
    d = torch.mul(sc.float(), d.repeat_interleave(groups, dim=1))
    m = -(mn.float() * dmin.repeat_interleave(groups, dim=1)) if fmt.has_min else d * -fmt.offset
    return v, d, m


def _fields(plane: torch.Tensor, bits: int) -> torch.Tensor:
    """A plane's bytes [P, B, size] -> its fields [P, B, 8 groups, 16, 4]."""
    p, b = plane.shape[:2]
    if bits == 8:
        return plane.reshape(p, b, 8, PANEL, 4)
    if bits == 4:
        x = plane.reshape(p, b, 4, PANEL, 4)
        return torch.cat([x & 0x0F, x >> 4], dim=2)
    if bits == 2:
        x = plane.reshape(p, b, 2, PANEL, 4)
        return torch.cat([(x >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2)
    x = plane.reshape(p, b, 1, PANEL, 4)  # bits == 1
    return torch.cat([(x >> g) & 1 for g in range(8)], dim=2)


def _weights(fmt: BlockFormat, v: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`unpack`'s parts as float32 weights [rows, k]: w = d * v + m per group."""
    rows = v.shape[0]
    return (v.view(rows, -1, fmt.group).float() * d[..., None] + m[..., None]).view(rows, -1)


# -- the torch twin -------------------------------------------------------------------------------
def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] -> (x8 as float32 [rows, k / 32, 32], dx float32 [rows, k / 32, 1]), per row and block."""
    blocks = x.float().view(x.shape[0], -1, GROUP)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    # Divisions of two tensors, rounded once as the kernel's are (`127 / amax` would be 127 * (1 / amax)).
    q = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, q / amax, 0)
    return (blocks * inv).round(), amax / q


def linear_twin(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, n: int,
                bias: torch.Tensor | None = None, chunk_panels: int = 256) -> torch.Tensor:
    """The quantized linear in torch: each group's dot product of x8 and v (exact integers in float32),
    scaled by d * dx, plus m * dx * sum(x8) where the format has a min (else the zero point is in the
    integer sums, as the kernel has it). Sums are ordered differently from the kernel's, so results
    agree to float32 rounding, not bit for bit."""
    k = x.shape[1]
    x8, dx = quantize_activations(x)
    group = fmt.group
    x8 = x8.view(x.shape[0], -1, group)  # [rows, groups, group]
    dx = dx.repeat_interleave(GROUP // group, dim=1)  # [rows, groups, 1]
    sx = x8.sum(dim=2) * dx[..., 0] if fmt.has_min else None  # [rows, groups]
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for p0 in range(0, packed.shape[0], chunk_panels):  # bounded memory for a large LM head
        n0 = p0 * PANEL
        rows = min(chunk_panels * PANEL, n - n0)
        v, d, m = unpack(packed[p0:p0 + chunk_panels], fmt, rows, k)
        if fmt.has_min:
            isum = torch.einsum("rgk,ngk->rng", x8, v.view(rows, -1, group).float())
            out[:, n0:n0 + rows] = (isum * (d[None] * dx[:, None, :, 0])).sum(-1) + sx @ m.T
        else:  # m = -offset * d: the zero point inside the integer sums, as the kernel folds it (exact)
            signed = (v.to(torch.int16) - fmt.offset).view(rows, -1, group).float()
            isum = torch.einsum("rgk,ngk->rng", x8, signed)
            out[:, n0:n0 + rows] = (isum * (d[None] * dx[:, None, :, 0])).sum(-1)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


# -- a layer's weight ---------------------------------------------------------------------------------
@dataclass
class Segment:
    """Output rows in one format, packed (`pack`)."""
    qtype: int
    n: int
    packed: torch.Tensor

    @property
    def fmt(self) -> BlockFormat:
        return BLOCK_FORMATS[self.qtype]


@dataclass(eq=False)  # compared by identity: a tied embedding and LM head share one object
class QuantizedWeight:
    """A linear layer's quantized weight: its output rows in segments, one per format (one, unless the
    file mixes formats in a fused q/k/v or gate/up), each packed. Computed by the native kernel
    (kernels.QuantGemm) where there is one, else by the torch twin from the same bytes. An embedding
    tied to the LM head shares the object and reads its rows from it."""
    k: int
    segments: list[Segment]
    kernel: Any = None  # kernels.QuantGemm, or None: the twin
    dtype: torch.dtype = torch.float32  # of the activations, and of the rows an embedding reads
    offsets: list[int] = field(init=False)  # each segment's first output row
    n: int = field(init=False)  # output rows, all segments': read by the kernel at every call

    def __post_init__(self) -> None:
        self.offsets = [sum(s.n for s in self.segments[:i]) for i in range(len(self.segments))]
        self.n = sum(s.n for s in self.segments)

    @classmethod
    def of(cls, tensors: "QuantizedTensor | list[QuantizedTensor]") -> "QuantizedWeight":
        tensors = tensors if isinstance(tensors, list) else [tensors]
        return cls(tensors[0].shape[1], [Segment(t.qtype, t.shape[0], pack(t)) for t in tensors])

    def use_kernel(self, kernel, dtype: torch.dtype) -> None:
        self.kernel, self.dtype = kernel, dtype

    def to(self, device: torch.device) -> None:
        """Where the twin computes (CUDA dequantizes by default; this is the explicit --quantization path)."""
        for s in self.segments:
            s.packed = s.packed.to(device)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias: float32 for the kernel)."""
        if self.kernel is not None:
            return self.kernel.forward(x, self, bias)
        return torch.cat([linear_twin(x, s.packed, s.fmt, s.n, None if bias is None else bias[o:o + s.n])
                          for s, o in zip(self.segments, self.offsets)], dim=1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized: an embedding lookup (a one-segment weight)."""
        s = self.segments[0]
        flat = ids.flatten()
        if self.kernel is not None:
            return self.kernel.rows(s, self.k, flat).view(*ids.shape, self.k)
        panels = torch.div(flat, PANEL, rounding_mode="floor")
        v, d, m = unpack(s.packed[panels], s.fmt, len(flat) * PANEL, self.k)
        pick = torch.arange(len(flat), device=flat.device) * PANEL + flat % PANEL
        return _weights(s.fmt, v[pick], d[pick], m[pick]).view(*ids.shape, self.k).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        """float32 [n, k] (tests and checks)."""
        return torch.cat([_weights(s.fmt, *unpack(s.packed, s.fmt, s.n, self.k)) for s in self.segments])

    @property
    def nbytes(self) -> int:
        return sum(s.packed.numel() for s in self.segments)
