"""Applying the adapters of one step beside the base layers (punica-style, segmented).

The model's linear layers call a `LoRALinear` hook after computing their base output; it adds
B (A x) to the rows of each adapter, grouped into segments (runs of rows of one adapter), with
csrc/lora.c where it applies and a torch twin elsewhere. Which rows belong to which adapter is
the step's `LoRAContext`, set by the runner around the forward and empty otherwise, so that an
engine without adapters sharing the model sees nothing.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minivllm.lora.request import LoRARequest
from minivllm.model.kernels import LORA_CHUNK, lora_kernel


@dataclass
class TargetWeights:
    at: torch.Tensor  # [in, padded rank], the model's dtype: the projections' A^T side by side
    bt: torch.Tensor  # [padded rank, n_pad], the model's dtype: their B^T (scaled), block-diagonal
    bands: torch.Tensor  # int64 [chunks of LORA_CHUNK columns, 2]: the rows of bt not zero there, [lo, hi)

    def address(self) -> list[int]:
        """What csrc/lora.c reads of it per segment: AT's address, BT's, the bands', the padded rank."""
        return [self.at.data_ptr(), self.bt.data_ptr(), self.bands.data_ptr(), self.at.shape[1]]


@dataclass(eq=False)
class LoadedAdapter:
    """An adapter in csrc/lora.c's layout: per target a TargetWeights, or None where it leaves the layer
    alone; and per target the addresses the kernel reads."""
    request: LoRARequest
    weights: list[TargetWeights | None]
    addresses: torch.Tensor  # int64 [targets, 4]: AT's address, BT's, bands', the padded rank (zeros: none)
    cache_salt: bytes  # folded into the first prefix-cache block hash of its requests


@dataclass
class Segment:
    start: int  # first row of the packed batch
    rows: int
    adapter: LoadedAdapter


class LoRAContext:
    """The current step's segments, shared by every LoRALinear of one model."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.kernel = lora_kernel(device, dtype)
        self.segments: list[Segment] = []
        self.starts = self.lens = self.weights = None  # the kernel's per-step arrays

    @property
    def active(self) -> bool:
        return bool(self.segments)

    @contextlib.contextmanager
    def step(self, spans: list[tuple[int, int, LoadedAdapter]]) -> Iterator[None]:
        """Rows by adapter for one forward: spans (first row, rows, adapter), neighbours of one
        adapter merged into one segment."""
        segments: list[Segment] = []
        for start, rows, adapter in spans:
            last = segments[-1] if segments else None
            if last is not None and last.adapter is adapter and last.start + last.rows == start:
                last.rows += rows
            else:
                segments.append(Segment(start, rows, adapter))
        if segments and self.kernel is not None:
            self.starts = torch.tensor([s.start for s in segments], dtype=torch.int64)
            self.lens = torch.tensor([s.rows for s in segments], dtype=torch.int64)
            # [layer targets, segments, 4]: per target each segment's addresses for csrc/lora.c.
            self.weights = torch.stack([s.adapter.addresses for s in segments], dim=1).contiguous()
        self.segments = segments
        try:
            yield
        finally:
            self.segments = []
            self.starts = self.lens = self.weights = None


class LoRALinear:
    """The hook of one base linear layer (`index`: its place in the manager's target list)."""

    def __init__(self, context: LoRAContext, index: int) -> None:
        self.context, self.index = context, index

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's x W^T) plus each segment's adapter product, in place."""
        ctx = self.context
        if not ctx.segments:
            return out
        if ctx.kernel is not None:
            if x.stride(-1) != 1:
                x = x.contiguous()
            n = out.shape[1]
            ctx.kernel(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[1], n, padded_columns(n),
                       len(ctx.segments), ctx.starts.data_ptr(), ctx.lens.data_ptr(), ctx.weights[self.index].data_ptr())
            return out
        for s in ctx.segments:
            weights = s.adapter.weights[self.index]
            if weights is not None:
                rows = slice(s.start, s.start + s.rows)
                out[rows] = lora_twin(x[rows], out[rows], weights.at, weights.bt)
        return out


def padded_columns(n: int) -> int:
    """A layer's output columns padded to whole chunks of csrc/lora.c's expand (B^T's row length)."""
    return -(-n // LORA_CHUNK) * LORA_CHUNK


def lora_twin(x: torch.Tensor, out: torch.Tensor, at: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """csrc/lora.c's arithmetic in torch (float32 sums, one rounding into out's dtype), up to the order
    of its sums: out + (x AT) BT for AT [k, rank], BT [rank, n_pad]."""
    delta = (x.float() @ at.float()) @ bt[:, :out.shape[1]].float()
    return (out.float() + delta).to(out.dtype)
