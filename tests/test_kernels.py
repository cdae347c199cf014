"""The native decode-attention kernel against torch's scaled_dot_product_attention, and the torch
fallback against the kernel on the real model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.model.kernels import decode_attention_kernel, paged_decode_attention
from tests.helpers import EQUALITY_PROMPTS, greedy


def reference(q, k_cache, v_cache, tables, context_lens, scale):
    block_size = k_cache.shape[1]
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2).float()
    values = v_cache[tables].flatten(1, 2).transpose(1, 2).float()
    mask = (torch.arange(tables.shape[1] * block_size)[None] < context_lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.float().unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 1)])
def test_kernel_matches_sdpa(dtype, tol, heads, kv_heads, head_dim, block_size):
    kernel = decode_attention_kernel(torch.device("cpu"), dtype, head_dim, heads // kv_heads)
    if kernel is None:
        pytest.skip("no C compiler: the torch path is used")
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_seqs = 1200, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 150, 1 + 40 * block_size // 16])
    max_blocks = int(-(-context_lens.max() // block_size))
    # Scattered, non-overlapping blocks, padded like the runner pads (with block 0).
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    out = paged_decode_attention(kernel, q, k_cache, v_cache, tables, context_lens, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, tables, context_lens, head_dim ** -0.5),
                               atol=tol, rtol=tol)


def test_torch_fallback_gives_the_same_tokens(llm):
    """CUDA and machines without a compiler take the gather + SDPA path: same greedy tokens."""
    runner = llm.engine.runner
    if runner.decode_kernel is None:
        pytest.skip("no native kernel here: the fallback is what every other test runs")
    prompts = EQUALITY_PROMPTS[:4]
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    kernel, runner.decode_kernel = runner.decode_kernel, None
    try:
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    finally:
        runner.decode_kernel = kernel
    assert with_kernel == without
