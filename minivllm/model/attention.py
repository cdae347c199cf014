"""Attention over the paged KV cache.

Pool layout, one pair per layer: k_cache [blocks, kv_heads, head_dim, block_size] (each head's keys
transposed, so that the CPU kernel scores a block with vector FMAs) and v_cache [blocks, kv_heads,
block_size, head_dim]. `kv_cache_shapes` is the one place that says so.

The runner packs a step's tokens as [decode tokens | prefill tokens | padding], one span per
sequence. Each layer first writes the new K/V into its cache slots (block, offset), then attends.
With the native CPU kernel every span, decode or prefill chunk, goes through one call that reads the
pool in place and treats each query by its context length alone: a token's output is the same bits in
a prefill, a chunk after a cached prefix or a decode (batch invariance, kernels.py). The torch twin
batches the decodes for scaled_dot_product_attention over gathered blocks and runs each prefill chunk
on its own (a fresh prompt attends to its own K/V directly; a later chunk reads its context from the
cache); it is not batch-invariant. Padding tokens (static batching) attend to nothing: output zero.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minivllm.model.kernels import LayerOps, paged_attention_native


@dataclass
class PrefillSpan:
    """A prefill chunk for the torch path."""
    start: int  # first token in the packed batch
    num_tokens: int
    context_len: int  # tokens attended to by the last query: cached + this chunk
    block_table: torch.Tensor | None = None  # set when part of the context is already cached
    mask: torch.Tensor | None = None  # [num_tokens, context_len] causal mask offset by the cached part


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
    return (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, num_kv_heads, block_size, head_dim)


@dataclass
class AttentionMetadata:
    # Where each new token's K/V goes: slot = block * block_size + offset, as (block, offset) pairs.
    slot_blocks: torch.Tensor  # [num_real_tokens]
    slot_offsets: torch.Tensor  # [num_real_tokens]
    # One span per sequence, decodes first: rows span_starts[i] .. + span_lens[i] of the packed batch,
    # whose first query sees span_ctx0[i] tokens (itself included), through block_tables[i].
    span_starts: torch.Tensor | None = None  # [spans]
    span_lens: torch.Tensor | None = None
    span_ctx0: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None  # [spans, max_blocks]
    num_decodes: int = 0
    # The native kernel (kernels.py) reads the pool in place; without it, the torch path below.
    kernel: Callable | None = None
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size], torch path only
    prefills: list[PrefillSpan] = field(default_factory=list)  # torch path only

    @property
    def num_real_tokens(self) -> int:
        return self.slot_blocks.shape[0]


def decode_mask(context_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The torch path's mask over gathered blocks: [seqs, 1, 1, num_tokens], True where a token exists."""
    positions = torch.arange(num_tokens, device=context_lens.device)
    return (positions[None, :] < context_lens[:, None])[:, None, None, :]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, ops: LayerOps | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; caches as `kv_cache_shapes`.
    Returns [T, heads, head_dim]. `ops`: the native CPU ops, for the cache write."""
    n = meta.num_real_tokens
    if ops is not None:
        ops.write_kv(k, v, meta.slot_blocks, meta.slot_offsets, k_cache, v_cache)
    else:
        k_cache[meta.slot_blocks, :, :, meta.slot_offsets] = k[:n]
        v_cache[meta.slot_blocks, :, meta.slot_offsets] = v[:n]
    out = torch.zeros_like(q) if n < q.shape[0] else torch.empty_like(q)
    if meta.kernel is not None:
        paged_attention_native(meta.kernel, q, k_cache, v_cache, meta.block_tables, meta.span_starts,
                               meta.span_lens, meta.span_ctx0, scale, out)
        return out

    d = meta.num_decodes
    if d:
        keys, values = _gather(k_cache, v_cache, meta.block_tables[:d])  # [d, kv_heads, ctx, head_dim]
        o = F.scaled_dot_product_attention(q[:d].unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                           scale=scale, enable_gqa=True)
        out[:d] = o.squeeze(2)
    for p in meta.prefills:
        end = p.start + p.num_tokens
        query = q[p.start:end].transpose(0, 1).unsqueeze(0)
        if p.block_table is None:
            keys = k[p.start:end].transpose(0, 1).unsqueeze(0)
            values = v[p.start:end].transpose(0, 1).unsqueeze(0)
        else:
            keys, values = _gather(k_cache, v_cache, p.block_table[None], p.context_len)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=p.mask, is_causal=p.mask is None,
                                           scale=scale, enable_gqa=True)
        out[p.start:end] = o[0].transpose(0, 1)
    return out


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, max_blocks] block ids -> keys and values, each [batch, kv_heads, tokens, head_dim]."""
    keys = k_cache[block_tables].permute(0, 2, 1, 4, 3).flatten(2, 3)  # from [b, blocks, kvh, hd, bs]
    values = v_cache[block_tables].transpose(1, 2).flatten(2, 3)  # from [b, blocks, kvh, bs, hd]
    return keys[:, :, :length], values[:, :, :length]
