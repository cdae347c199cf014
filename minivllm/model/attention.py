"""Attention over the paged KV cache.

Pool layout, per layer (kv_cache.KVCache): k [blocks, kv_heads, head_dim, block_size] (each head's keys
transposed, so that the CPU kernel scores a block with vector FMAs) and v [blocks, kv_heads, block_size,
head_dim]. `kv_cache_shapes` is the one place that says so. With a quantized --kv-cache-dtype the values
are one byte each with a float32 scale per (token, kv head) beside them (kv_cache.py).

The runner packs a step's tokens as [decode tokens | prefill tokens | padding], one span per
sequence. Each layer first writes the new K/V into its cache slots (block, offset), then attends.
With the native CPU kernel every span, decode or prefill chunk, goes through one call that reads the
pool in place and treats each query by its context length alone: a token's output is the same bits in
a prefill, a chunk after a cached prefix or a decode (batch invariance, kernels.py). The torch twin
batches the decodes for scaled_dot_product_attention over gathered blocks and runs each prefill chunk
on its own (a fresh prompt attends to its own K/V directly; a later chunk reads its context from the
cache); it is not batch-invariant. A sliding window (a query at position p sees positions > p - window,
as transformers masks it), Gemma 2's logit softcap (scores -> cap * tanh(scores / cap) before the
softmax) and gpt-oss's attention sinks (a logit per head that joins the softmax's denominator and attends
to nothing) are per layer, in both paths. With a quantized cache it attends to what the pool gives back
(kv_cache.round_trip), as the native kernel does, so both see the same K/V. Padding tokens (static batching) attend to nothing: output zero.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minivllm.model.cuda_kernels import TritonAttention
from minivllm.model.kernels import LayerOps, paged_attention_native
from minivllm.model.kv_cache import KVCache, dequantize, round_trip, write_kv


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
    max_span_len: int = 1  # the longest span: sizes the CUDA kernel's grid without reading the device
    # The native kernel (kernels.py) reads the pool in place; without it, the torch path below.
    kernel: Callable | None = None
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size], torch path only
    prefills: list[PrefillSpan] = field(default_factory=list)  # torch path only
    # [tokens] bool, where some prompt chunk takes longrope's long factors below their threshold position
    long_rope: torch.Tensor | None = None

    @property
    def num_real_tokens(self) -> int:
        return self.slot_blocks.shape[0]


def decode_mask(context_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The torch path's mask over gathered blocks: [seqs, 1, 1, num_tokens], True where a token exists."""
    positions = torch.arange(num_tokens, device=context_lens.device)
    return (positions[None, :] < context_lens[:, None])[:, None, None, :]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float, ops: LayerOps | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; `cache` this layer's pool.
    Returns [T, heads, head_dim]. `ops`: the native CPU ops, for the cache write; `window`: the layer's
    sliding window, if any; `softcap`: its attention logit softcap, if any; `sinks`: its attention
    sinks, float32 [heads], if any."""
    n = meta.num_real_tokens
    if ops is not None:
        ops.write_kv(k, v, meta.slot_blocks, meta.slot_offsets, cache)
    else:
        write_kv(k[:n], v[:n], meta.slot_blocks, meta.slot_offsets, cache)
    out = torch.zeros_like(q) if n < q.shape[0] else torch.empty_like(q)
    if isinstance(meta.kernel, TritonAttention):  # CUDA (cuda_kernels.py)
        meta.kernel(q, cache, meta, scale, out, window, softcap, sinks)
        return out
    if meta.kernel is not None:
        paged_attention_native(meta.kernel, q, cache, meta.block_tables, meta.span_starts,
                               meta.span_lens, meta.span_ctx0, scale, out, window, softcap, sinks)
        return out

    d = meta.num_decodes
    if d:
        keys, values = _gather(cache, meta.block_tables[:d], q.dtype)  # [d, kv_heads, ctx, head_dim]
        mask = meta.decode_mask
        if window is not None:  # the query is at position ctx - 1
            first = (meta.span_ctx0[:d] - window)[:, None, None, None]
            mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= first)
        out[:d] = _attend(q[:d].unsqueeze(2), keys, values, mask, scale, softcap, sinks).squeeze(2)
    for p in meta.prefills:
        end = p.start + p.num_tokens
        query = q[p.start:end].transpose(0, 1).unsqueeze(0)
        if p.block_table is None:  # a fresh prompt: its own K/V, as the pool gives them back
            keys = round_trip(k[p.start:end], cache.fmt).transpose(0, 1).unsqueeze(0)
            values = round_trip(v[p.start:end], cache.fmt).transpose(0, 1).unsqueeze(0)
        else:
            keys, values = _gather(cache, p.block_table[None], q.dtype, p.context_len)
        mask = p.mask
        if mask is None and (window is not None or softcap is not None or sinks is not None):
            mask = torch.ones(p.num_tokens, p.num_tokens, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            q_pos = torch.arange(p.context_len - p.num_tokens, p.context_len, device=q.device)[:, None]
            mask = mask & (torch.arange(p.context_len, device=q.device)[None, :] > q_pos - window)
        out[p.start:end] = _attend(query, keys, values, mask, scale, softcap, sinks)[0].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, heads, n, d], k and v [b, kv_heads, m, d]; mask (True: attend) broadcast to [b, heads, n, m],
    None: causal. scaled_dot_product_attention, or with a softcap or sinks the same written out (in
    float32; a sink is one more column of the softmax, dropped before the values)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(-1) @ v).to(q.dtype)
    sink_column = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
    return (weights @ v).to(q.dtype)


def _gather(cache: KVCache, block_tables: torch.Tensor, dtype: torch.dtype,
            length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, max_blocks] block ids -> keys and values in `dtype`, each [batch, kv_heads, tokens, head_dim]."""
    keys = cache.k[block_tables].permute(0, 2, 1, 4, 3).flatten(2, 3)  # from [b, blocks, kvh, hd, bs]
    values = cache.v[block_tables].transpose(1, 2).flatten(2, 3)  # from [b, blocks, kvh, bs, hd]
    if cache.fmt.quantized:  # scales [b, blocks, kvh, bs] -> [b, kvh, tokens, 1]
        k_scale = cache.k_scale[block_tables].transpose(1, 2).flatten(2, 3)[..., None]
        v_scale = cache.v_scale[block_tables].transpose(1, 2).flatten(2, 3)[..., None]
        keys, values = dequantize(keys, k_scale, cache.fmt, dtype), dequantize(values, v_scale, cache.fmt, dtype)
    return keys[:, :, :length], values[:, :, :length]
