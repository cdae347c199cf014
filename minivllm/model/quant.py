"""Quantized weights: kept as integers with a scale and offset per group of k, never dequantized on the CPU.

Every format ends up as one `QuantizedTensor`, W[n, k] = d * u + m with unsigned integers u and a
float16 (d, m) per group of 32 k (16 for Q6_K's sub-blocks): a GGUF file's blocks split by the
traits table of gguf_quants.py, or a float checkpoint quantized at load (`--quantization int8|int4`).
The native kernel (csrc/quant_gemm.c) takes it packed into column panels; `linear_twin` here is its
torch twin, the same arithmetic in torch (the CUDA path, machines without a compiler,
MINIVLLM_NO_KERNELS=1, and the reference its tests check it against).

The activations are quantized too, per row and per 32 k (dx = amax / 127, x8 = round(x / dx)), so that
each group is an exact integer dot product; a row's result depends on that row alone (issue 12).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minivllm.model.gguf_quants import Ints

GROUP = 32  # k per activation block and per weight group (sub-groups of 16 for Q6_K)
PANEL = 16  # csrc/quant_gemm.c: output columns per packed panel
INT4_GROUPS = (128, 64, 32)  # `--quantization int4`: one scale and offset per 128 k as AWQ/GPTQ use, or
# the largest of these that divides in_features (the default model's 576 takes 64)


@dataclass
class QuantizedTensor:
    """W [n, k] = d * u + m, with a (d, m) pair per group of k // d.shape[1] (32 or 16) k."""
    u: torch.Tensor  # uint8 [n, k]; below 16 when bits == 4
    d: torch.Tensor  # float16 [n, groups]
    m: torch.Tensor  # float16 [n, groups]
    bits: int  # 4 or 8: how u is stored when packed

    @classmethod
    def from_blocks(cls, ints: Ints, shape: tuple[int, ...]) -> "QuantizedTensor":
        """A GGUF tensor of `shape` [n, k] from its blocks split into integers (gguf_quants.Ints)."""
        n, k = shape
        groups = ints.d.numel() // n
        return cls(ints.u.reshape(n, k), ints.d.reshape(n, groups).half(), ints.m.reshape(n, groups).half(),
                   ints.bits)

    @property
    def shape(self) -> torch.Size:
        return self.u.shape

    @property
    def group(self) -> int:
        """k per (d, m) pair: 32, or 16."""
        return self.u.shape[1] // self.d.shape[1]

    @property
    def sub(self) -> int:
        """(d, m) pairs per 32 k: 1, or 2 for groups of 16."""
        return GROUP // self.group

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        u = self.u.view(self.u.shape[0], -1, self.group).float()
        w = u * self.d.float()[..., None] + self.m.float()[..., None]
        return w.view(self.u.shape).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedTensor":
        """Rows (dim 0) or whole groups of columns (dim 1): what tensor parallelism shards."""
        if dim == 0:
            return QuantizedTensor(self.u.narrow(0, start, length), self.d.narrow(0, start, length),
                                   self.m.narrow(0, start, length), self.bits)
        if start % GROUP or length % GROUP:
            raise ValueError(f"a quantized weight splits along k at multiples of {GROUP}, not {start}+{length}")
        g = self.group
        return QuantizedTensor(self.u.narrow(1, start, length), self.d.narrow(1, start // g, length // g),
                               self.m.narrow(1, start // g, length // g), self.bits)

    def to(self, device: torch.device) -> "QuantizedTensor":
        return QuantizedTensor(self.u.to(device), self.d.to(device), self.m.to(device), self.bits)

    def map_rows(self, fn) -> "QuantizedTensor":
        """The same row permutation `fn` applied to the integers and their scales."""
        return QuantizedTensor(fn(self.u), fn(self.d), fn(self.m), self.bits)


def cat_rows(parts: list) -> "torch.Tensor | QuantizedTensor":
    """Fuse weights along the output dimension (q/k/v, gate/up), float or quantized alike."""
    if not isinstance(parts[0], QuantizedTensor):
        return torch.cat(parts)
    if len({(p.bits, p.sub) for p in parts}) > 1:  # e.g. Q4_K q/k beside a Q6_K v: widen to one layout
        parts = [QuantizedTensor(p.u, p.d, p.m, 8) for p in parts]
        if len({p.sub for p in parts}) > 1:
            parts = [_split_groups(p) for p in parts]
    return QuantizedTensor(torch.cat([p.u for p in parts]), torch.cat([p.d for p in parts]),
                           torch.cat([p.m for p in parts]), max(p.bits for p in parts))


def _split_groups(t: QuantizedTensor) -> QuantizedTensor:
    """Groups of 32 as two groups of 16 with the same scale: the same weights in Q6_K's layout."""
    if t.sub == 2:
        return t
    return QuantizedTensor(t.u, t.d.repeat_interleave(2, dim=1), t.m.repeat_interleave(2, dim=1), t.bits)


def quantize(w: torch.Tensor, scheme: str) -> QuantizedTensor:
    """A float weight [n, k] quantized at load: `int8` symmetric per output channel (u = q + 128), or
    `int4` asymmetric per group of 128 k (min/max over the group, as AWQ does; 64 or 32 where 128 does
    not divide k)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"--quantization {scheme} needs in_features divisible by {GROUP}, not {k}")
    w = w.float()
    if scheme == "int8":
        d = (w.abs().amax(dim=1, keepdim=True) / 127).half().float()
        q = torch.where(d > 0, w / d, 0).round().clamp(-127, 127)
        u = (q + 128).to(torch.uint8)
        d = d.expand(n, k // GROUP)
        return QuantizedTensor(u, d.half(), (d * -128).half(), 8)
    group = next(g for g in INT4_GROUPS if k % g == 0)
    groups = w.view(n, k // group, group)
    lo, hi = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    u = torch.where(d > 0, (groups - m) / d, 0).round().clamp(0, 15).to(torch.uint8).view(n, k)
    per_block = group // GROUP  # the kernel's groups are 32: repeat each scale
    return QuantizedTensor(u, d.view(n, -1).repeat_interleave(per_block, 1).half(),
                           m.view(n, -1).repeat_interleave(per_block, 1).half(), 4)


# -- the packed layout of csrc/quant_gemm.c ------------------------------------------------------
def block_bytes(bits: int, sub: int) -> int:
    return PANEL * GROUP * bits // 8 + sub * 2 * PANEL * 2


def pack(t: QuantizedTensor, pack_quantized) -> torch.Tensor:
    """uint8 [panels, k / 32, block_bytes] by the C packer `pack_quantized` (kernels.QuantGemm.pack):
    per panel of 16 columns and block of 32 k, the integers in groups of 4 k (column c's 4 bytes at
    c * 4; bits 4: group g + 4 in the high nibbles of group g), then per sub-group 16 float16 d and 16
    float16 m. Columns past n are zero."""
    n, k = t.shape
    u, d, m = t.u.contiguous(), t.d.contiguous(), t.m.contiguous()
    out = torch.empty(-(-n // PANEL), k // GROUP, block_bytes(t.bits, t.sub), dtype=torch.uint8)
    pack_quantized(u.data_ptr(), d.data_ptr(), m.data_ptr(), n, k, t.bits, t.sub, out.data_ptr())
    return out


def unpack(packed: torch.Tensor, n: int, bits: int, sub: int) -> QuantizedTensor:
    """The inverse of `pack`: for the torch twin when a model packed for the kernel runs without it."""
    panels, blocks, _ = packed.shape
    qbytes = PANEL * GROUP * bits // 8
    u = packed[:, :, :qbytes].reshape(panels, blocks, -1, PANEL, 4)
    if bits == 4:
        u = torch.cat([u & 0x0F, u >> 4], dim=2)
    u = u.permute(0, 3, 1, 2, 4).reshape(panels * PANEL, blocks * GROUP)[:n]
    scales = packed[:, :, qbytes:].contiguous().view(torch.float16).view(panels, blocks, sub, 2, PANEL)
    d, m = (scales[:, :, :, i].permute(0, 3, 1, 2).reshape(panels * PANEL, blocks * sub)[:n] for i in (0, 1))
    return QuantizedTensor(u.contiguous(), d.contiguous(), m.contiguous(), bits)


# -- the torch twin -------------------------------------------------------------------------------
def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] -> (x8 as float32 [rows, k / 32, 32], dx float32 [rows, k / 32, 1]), per row and block."""
    blocks = x.float().view(x.shape[0], -1, GROUP)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0)
    return (blocks * inv).round(), amax / 127


def linear_twin(x: torch.Tensor, t: QuantizedTensor, bias: torch.Tensor | None = None,
                chunk: int = 4096) -> torch.Tensor:
    """The quantized linear in torch: each group's dot product of x8 and u (exact integers in float32),
    scaled by d * dx, plus m * dx * sum(x8). Sums are ordered differently from the kernel's, so results
    agree to float32 rounding, not bit for bit."""
    x8, dx = quantize_activations(x)
    sub = t.sub
    x8 = x8.view(x.shape[0], -1, t.group)  # [rows, groups, group]
    dx = dx.repeat_interleave(sub, dim=1)  # [rows, groups, 1]
    sx = x8.sum(dim=2) * dx[..., 0]  # [rows, groups]
    out = torch.empty(x.shape[0], t.shape[0], dtype=torch.float32, device=x.device)
    for n0 in range(0, t.shape[0], chunk):  # bounded memory for a large LM head
        part = t.narrow(0, n0, min(chunk, t.shape[0] - n0))
        u = part.u.view(part.u.shape[0], -1, t.group).float()
        isum = torch.einsum("rgk,ngk->rng", x8, u)
        d, m = part.d.float(), part.m.float()
        out[:, n0:n0 + part.shape[0]] = (isum * (d[None] * dx[:, None, :, 0])).sum(-1) + sx @ m.T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


@dataclass(eq=False)  # compared by identity: a tied embedding and LM head share one object
class QuantizedWeight:
    """A linear layer's quantized weight, held the way its compute path wants it: packed for the native
    kernel (only that copy is kept: the memory target), or as a QuantizedTensor for the torch twin.
    An embedding tied to the LM head shares the object and reads its rows from it."""
    n: int
    k: int
    bits: int
    sub: int
    tensor: QuantizedTensor | None = None  # for the torch twin
    packed: torch.Tensor | None = None  # for the native kernel (quant.pack; weight_cache.py maps it back)
    kernel: Any = None  # kernels.QuantGemm, or None: the twin
    dtype: torch.dtype = torch.float32  # of the activations, and of the rows an embedding reads

    @classmethod
    def of(cls, tensor: QuantizedTensor) -> "QuantizedWeight":
        n, k = tensor.shape
        return cls(n, k, tensor.bits, tensor.sub, tensor)

    def use_kernel(self, kernel, dtype: torch.dtype) -> None:
        if kernel is not None and self.packed is None:
            self.packed, self.tensor = kernel.pack(self.tensor), None
        elif kernel is None and self.tensor is None:
            self.tensor, self.packed = unpack(self.packed, self.n, self.bits, self.sub), None
        self.kernel, self.dtype = kernel, dtype

    def to(self, device: torch.device) -> None:
        """Where the twin computes (CUDA dequantizes by default; this is the explicit --quantization path)."""
        if self.tensor is not None:
            self.tensor = self.tensor.to(device)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, padded_bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.forward(x, self.packed, self.bits, self.sub, padded_bias, self.n)
        return linear_twin(x, self.tensor, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.rows(self.packed, self.bits, self.sub, self.k, ids.flatten()).view(*ids.shape, self.k)
        t = self.tensor
        return t.map_rows(lambda r: r[ids.flatten()]).dequantize(self.dtype).view(*ids.shape, self.k)

    @property
    def nbytes(self) -> int:
        held = [self.packed] if self.packed is not None else [self.tensor.u, self.tensor.d, self.tensor.m]
        return sum(t.numel() * t.element_size() for t in held)


def padded_bias(bias: torch.Tensor | None, n: int, panel: int = PANEL) -> torch.Tensor | None:
    """A native kernel's bias: float32, zero-padded to whole panels."""
    if bias is None:
        return None
    out = torch.zeros(-(-n // panel) * panel, dtype=torch.float32)
    out[:n] = bias.float()
    return out
