"""The native CPU kernels against the torch code they replace (decode attention against
scaled_dot_product_attention, the fused layer ops against the model's torch fallbacks, the few-row
linear against F.linear), and the all-torch model against the native one on the real model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.model.attention import kv_cache_shapes
from minivllm.model.kernels import (SMALL_LINEAR_ROWS, decode_attention_kernel, layer_ops, paged_decode_attention,
                                    small_linear, small_linear_kernel)
from minivllm.model.llama import RMSNorm, apply_rotary
from tests.helpers import EQUALITY_PROMPTS, greedy


def reference(q, k_cache, v_cache, tables, context_lens, scale):
    block_size = k_cache.shape[3]
    keys = torch.cat([k_cache[tables[:, i]].transpose(2, 3) for i in range(tables.shape[1])], dim=2).float()
    values = torch.cat([v_cache[tables[:, i]] for i in range(tables.shape[1])], dim=2).float()
    mask = (torch.arange(tables.shape[1] * block_size)[None] < context_lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.float().unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 1), (6, 2, 80, 32), (8, 2, 128, 16)])
def test_kernel_matches_sdpa(dtype, tol, heads, kv_heads, head_dim, block_size):
    kernel = decode_attention_kernel(torch.device("cpu"), dtype, head_dim, heads // kv_heads, block_size)
    if kernel is None:
        pytest.skip("no C compiler: the torch path is used")
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_seqs = 1200, 7
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(k_shape, generator=gen).to(dtype)
    v_cache = torch.randn(v_shape, generator=gen).to(dtype)
    context_lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 150, 1 + 40 * block_size // 16])
    max_blocks = int(-(-context_lens.max() // block_size))
    # Scattered, non-overlapping blocks, padded like the runner pads (with block 0).
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    # q as the model passes it: a view into the fused qkv output, rows wider than the heads.
    qkv = torch.randn(num_seqs, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(num_seqs, heads, head_dim)
    out = paged_decode_attention(kernel, q, k_cache, v_cache, tables, context_lens, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, context_lens, head_dim ** -0.5),
                               atol=tol, rtol=tol)


def _ops(dtype):
    ops = layer_ops(torch.device("cpu"), dtype)
    if ops is None:
        pytest.skip("no C compiler: the torch path is used")
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_layer_ops_match_torch(dtype, tokens):
    """Each fused op against the torch code it replaces, on views shaped as the model passes them."""
    ops, gen = _ops(dtype), torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim, hidden = 9, 3, 64, 576
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # sum order

    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    delta, residual = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(2))
    expected_residual = residual + delta
    ours_residual = residual.clone()
    out = ops.add_rms_norm(delta, ours_residual, norm.weight, norm.eps)
    torch.testing.assert_close(ours_residual, expected_residual, **exact)
    torch.testing.assert_close(out, norm(None, expected_residual.clone()), **close)
    first = ops.add_rms_norm(None, expected_residual.clone(), norm.weight, norm.eps)  # the first layer: no delta
    torch.testing.assert_close(first, out, atol=0, rtol=0)

    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                               kv_heads * head_dim], dim=-1))
    angles = torch.arange(100, 100 + tokens).float()[:, None] / 10_000 ** (torch.arange(0, head_dim, 2) / head_dim)
    cos, sin = angles.cos(), angles.sin()
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ops.rotary_(q, k, cos, sin)  # in place, through the views
    torch.testing.assert_close(q, expected_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, expected_k, atol=1e-6, rtol=1e-6)

    k_shape, v_shape = kv_cache_shapes(8, 16, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    ops.write_kv(k, v, slots // 16, slots % 16, k_cache, v_cache)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 16, :, :, slot % 16], k[t])
        assert torch.equal(v_cache[slot // 16, :, slot % 16], v[t])
    assert int((k_cache != 0).sum()) <= tokens * kv_heads * head_dim  # nothing written elsewhere

    gate_up = torch.randn(tokens, 2 * 1536, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", range(1, SMALL_LINEAR_ROWS + 1))
def test_small_linear_matches_f_linear(rows):
    kernel = small_linear_kernel(torch.device("cpu"), torch.bfloat16)
    if kernel is None:
        pytest.skip("no AVX512-BF16 compiler target here: F.linear is used")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1001, 576, generator=gen).bfloat16()  # a row count that leaves a partial tile
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    out = small_linear(kernel, x, weight)
    assert out.shape == (rows, 1001) and out.dtype == torch.bfloat16
    reference = x.float() @ weight.float().T  # float32 sums of the same bf16 products
    torch.testing.assert_close(out.float(), reference, atol=0.1, rtol=1e-2)


def test_torch_fallback_gives_the_same_tokens(llm):
    """CUDA and machines without a compiler run the model in plain torch: same greedy tokens."""
    runner = llm.engine.runner
    if runner.decode_kernel is None:
        pytest.skip("no native kernels here: the fallback is what every other test runs")
    prompts = EQUALITY_PROMPTS[:4]
    with_kernels = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    kernel, runner.decode_kernel = runner.decode_kernel, None
    runner.model.use_native_kernels(False)
    try:
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    finally:
        runner.decode_kernel = kernel
        runner.model.use_native_kernels(True)
    assert with_kernels == without
