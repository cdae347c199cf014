"""The native CPU kernels against the torch code they replace (paged attention against
scaled_dot_product_attention, the fused layer ops against the model's torch fallbacks, the GEMM
against float32 matmul), each kernel's batch invariance (a row's bits never depend on the other rows),
and the all-torch model against the native one on the real model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minivllm.model.attention import kv_cache_shapes
from minivllm.model.kv_cache import write_kv
from minivllm.model.kernels import (KERNEL_GROUPS, attention_kernel, cpu_arch, gemm, layer_ops, library,
                                    paged_attention_native, report)
from minivllm.model.kv_cache import KVCache, allocate_kv_caches, dequantize, kv_format
from minivllm.model.decoder import RMSNorm, apply_rotary
from tests.helpers import EQUALITY_PROMPTS, greedy


def reference(q, k_cache, v_cache, table, context_len, scale):
    """One query row [heads, head_dim] over the first context_len tokens of its blocks, in float32."""
    keys = torch.cat([k_cache[b].transpose(1, 2) for b in table.tolist()], dim=1)[:, :context_len].float()
    values = torch.cat([v_cache[b] for b in table.tolist()], dim=1)[:, :context_len].float()
    return F.scaled_dot_product_attention(q.float()[None, :, None], keys[None], values[None], scale=scale,
                                          enable_gqa=True)[0, :, 0]


def windowed_reference(q, k_cache, v_cache, table, context_len, scale, window, softcap, sinks=None):
    """reference() with a sliding window (the last `window` tokens), a logit softcap and attention sinks
    (a column of the softmax per head, dropped before the values), written out; None: without it."""
    keys = torch.cat([k_cache[b].transpose(1, 2) for b in table.tolist()], dim=1)[:, :context_len].float()
    values = torch.cat([v_cache[b] for b in table.tolist()], dim=1)[:, :context_len].float()
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = torch.einsum("hd,htd->ht", q.float(), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if window is not None:
        scores[:, :max(0, context_len - window)] = float("-inf")
    if sinks is not None:
        return torch.einsum("ht,htd->hd", torch.cat((scores, sinks[:, None]), 1).softmax(-1)[:, :-1], values)
    return torch.einsum("ht,htd->hd", scores.softmax(-1), values)


def _tile_modes() -> list[bool]:
    lib = library(cpu_arch())
    return [True, False] if lib is not None and lib.amx_tiles_ready() else [False]


@pytest.fixture(params=_tile_modes(), ids=lambda on: "amx" if on else "vector")
def tiles(request: pytest.FixtureRequest):
    """Where the CPU has AMX, the bf16 attention runs on the tiles and, again, on the vector kernel."""
    lib = library(cpu_arch())
    lib.use_amx_tiles(request.param)
    yield request.param
    lib.use_amx_tiles(True)


def _attend(kernel, q, cache, tables, spans, scale, window=None, softcap=None, sinks=None):
    """Run the kernel over spans [(first row, rows, context of the first query)]; padding rows stay 0."""
    out = torch.zeros(q.shape, dtype=q.dtype)
    starts, lens, ctx0 = (torch.tensor(c, dtype=torch.long) for c in zip(*spans))
    paged_attention_native(kernel, q, cache, tables, starts, lens, ctx0, scale, out, window, softcap, sinks)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 1), (6, 2, 80, 32), (12, 2, 128, 16)])
def test_attention_matches_sdpa_and_is_batch_invariant(dtype, tol, heads, kv_heads, head_dim, block_size, cpu_target,
                                                      tiles):
    """On each target this machine runs: decodes and prefill chunks in one call, each row against SDPA;
    then every row again on its own, as a decode at that position: the same bits (a token's attention does
    not depend on how it was batched)."""
    kernel = attention_kernel(torch.device("cpu"), dtype, head_dim, heads // kv_heads, block_size)
    if kernel is None:
        pytest.skip("no C compiler: the torch path is used")
    gen = torch.Generator().manual_seed(0)
    num_blocks, scale = 1200, head_dim ** -0.5
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(k_shape, generator=gen).to(dtype)
    v_cache = torch.randn(v_shape, generator=gen).to(dtype)
    # Three decodes (contexts 1, block_size + 1, 150), a fresh prompt of 21 tokens, a chunk of 13 after 37
    # cached tokens, then 2 padding rows.
    spans = [(0, 1, 1), (1, 1, block_size + 1), (2, 1, 150), (3, 21, 1), (24, 13, 38)]
    max_blocks = -(-200 // block_size)
    # Scattered, non-overlapping blocks, padded like the runner pads (with block 0).
    tables = torch.randperm(num_blocks, generator=gen)[: len(spans) * max_blocks].view(len(spans), max_blocks)
    # q as the model passes it: a view into the fused qkv output, rows wider than the heads.
    qkv = torch.randn(39, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(39, heads, head_dim)
    cache = KVCache(k_cache, v_cache, kv_format("auto"))
    out = _attend(kernel, q, cache, tables, spans, scale)
    assert out.dtype == dtype and out.shape == q.shape and not out[37:].any()
    for s, (first, rows, ctx0) in enumerate(spans):
        for i in range(rows):
            row = first + i
            torch.testing.assert_close(out[row].float(), reference(q[row], k_cache, v_cache, tables[s], ctx0 + i, scale),
                                       atol=tol, rtol=tol)
            alone = _attend(kernel, q[row:row + 1], cache, tables[s:s + 1], [(0, 1, ctx0 + i)], scale)
            assert torch.equal(alone[0], out[row]), f"row {row} differs when computed alone"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_sliding_window_softcap_and_sinks(dtype, tol, tiles):
    """Gemma's sliding window (shorter, equal and longer than a block) and logit softcap, gpt-oss's sinks
    (with and without a window; one sink far above the scores, one far below): each row against the
    written-out reference, and the same bits alone as in the batch."""
    heads, kv_heads, head_dim, block_size, scale, softcap = 4, 2, 64, 16, 0.125, 2.0
    kernel = attention_kernel(torch.device("cpu"), dtype, head_dim, heads // kv_heads, block_size)
    if kernel is None:
        pytest.skip("no C compiler: the torch path is used")
    gen = torch.Generator().manual_seed(1)
    k_shape, v_shape = kv_cache_shapes(64, block_size, kv_heads, head_dim)
    cache = KVCache(torch.randn(k_shape, generator=gen).to(dtype), torch.randn(v_shape, generator=gen).to(dtype),
                    kv_format("auto"))
    spans = [(0, 1, 7), (1, 1, 60), (2, 20, 1), (22, 11, 45)]  # decodes, a fresh prompt, a chunk after 44 cached
    tables = torch.randperm(64, generator=gen)[:4 * 4].view(4, 4)
    q = torch.randn(33, heads, head_dim, generator=gen).to(dtype)
    sinks = torch.tensor([0.5, -1.0, 30.0, -30.0])
    for window, softcap, sinks in ((5, 2.0, None), (16, 2.0, None), (40, 2.0, None), (None, None, sinks),
                                   (16, None, sinks)):
        out = _attend(kernel, q, cache, tables, spans, scale, window, softcap, sinks)
        for s, (first, rows, ctx0) in enumerate(spans):
            for i in range(rows):
                row = first + i
                expected = windowed_reference(q[row], cache.k, cache.v, tables[s], ctx0 + i, scale, window, softcap,
                                              sinks)
                torch.testing.assert_close(out[row].float(), expected, atol=tol, rtol=tol)
                alone = _attend(kernel, q[row:row + 1], cache, tables[s:s + 1], [(0, 1, ctx0 + i)], scale, window,
                                softcap, sinks)
                assert torch.equal(alone[0], out[row]), f"row {row} differs when computed alone"


@pytest.mark.parametrize("window", [None, 700])
def test_attention_long_context_chunk_is_invariant(window, tiles):
    """A chunk of 150 queries after 1,900 cached tokens (Qwen2.5's group of 7 heads per kv head) beside a
    decode: sampled rows against the reference, and each the same bits computed alone, as a decode."""
    heads, kv_heads, head_dim, block_size, dtype = 14, 2, 64, 16, torch.bfloat16
    kernel = attention_kernel(torch.device("cpu"), dtype, head_dim, heads // kv_heads, block_size)
    if kernel is None:
        pytest.skip("no C compiler: the torch path is used")
    gen = torch.Generator().manual_seed(2)
    num_blocks, scale = 300, head_dim ** -0.5
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    cache = KVCache(torch.randn(k_shape, generator=gen).to(dtype), torch.randn(v_shape, generator=gen).to(dtype),
                    kv_format("auto"))
    spans = [(0, 150, 1901), (150, 1, 2100)]
    tables = torch.randperm(num_blocks, generator=gen)[:2 * 140].view(2, 140)
    q = torch.randn(151, heads, head_dim, generator=gen).to(dtype)
    out = _attend(kernel, q, cache, tables, spans, scale, window)
    for row in (0, 17, 18, 100, 149, 150):
        s, i = (0, row) if row < 150 else (1, 0)
        ctx = spans[s][2] + i
        expected = (reference(q[row], cache.k, cache.v, tables[s], ctx, scale) if window is None else
                    windowed_reference(q[row], cache.k, cache.v, tables[s], ctx, scale, window, 1e9))
        torch.testing.assert_close(out[row].float(), expected, atol=2e-2, rtol=2e-2)
        alone = _attend(kernel, q[row:row + 1], cache, tables[s:s + 1], [(0, 1, ctx)], scale, window)
        assert torch.equal(alone[0], out[row]), f"row {row} differs when computed alone"


def test_attention_follows_scores_that_climb_and_leap(tiles):
    """Scores that rise along the context (each key leans further towards the query) and one key far above
    the rest: the tiles' softmax keeps its max until a score passes it by a wide margin, then moves it and
    rescales; each row still matches the reference, and alone gives the same bits as in the batch."""
    heads, kv_heads, head_dim, block_size, dtype = 4, 2, 64, 16, torch.bfloat16
    kernel = attention_kernel(torch.device("cpu"), dtype, head_dim, heads // kv_heads, block_size)
    if kernel is None:
        pytest.skip("no C compiler: the torch path is used")
    gen = torch.Generator().manual_seed(3)
    num_blocks, scale, ctx = 40, head_dim ** -0.5, 300
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    tables = torch.randperm(num_blocks, generator=gen)[:2 * 20].view(2, 20)
    q = torch.randn(41, heads, head_dim, generator=gen)
    direction = q[0].view(kv_heads, heads // kv_heads, head_dim).mean(1)  # each kv head's query direction
    k = torch.randn(k_shape, generator=gen)
    for t in range(ctx):  # key t: noise plus the query's direction, t / 12 times (score ~ t / 3 higher)
        lean = 40.0 if t == 230 else t / 12
        for s in range(2):
            k[tables[s, t // block_size], :, :, t % block_size] += lean * direction
    cache = KVCache(k.to(dtype), torch.randn(v_shape, generator=gen).to(dtype), kv_format("auto"))
    q = q.to(dtype)
    spans = [(0, 1, ctx), (1, 40, ctx - 39)]  # a decode at 300, a chunk of 40 queries ending there
    out = _attend(kernel, q, cache, tables, spans, scale)
    for row in (0, 1, 20, 40):
        s, i = (0, 0) if row == 0 else (1, row - 1)
        ctx_row = spans[s][2] + i
        torch.testing.assert_close(out[row].float(), reference(q[row], cache.k, cache.v, tables[s], ctx_row, scale),
                                   atol=2e-2, rtol=2e-2)
        alone = _attend(kernel, q[row:row + 1], cache, tables[s:s + 1], [(0, 1, ctx_row)], scale)
        assert torch.equal(alone[0], out[row]), f"row {row} differs when computed alone"


def _ops(dtype):
    ops = layer_ops(torch.device("cpu"), dtype)
    if ops is None:
        pytest.skip("no C compiler: the torch path is used")
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_layer_ops_match_torch(dtype, tokens, cpu_target):
    """Each fused op against the torch code it replaces, on views shaped as the model passes them, on each
    target this machine runs."""
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
    ops.write_kv(k, v, slots // 16, slots % 16, KVCache(k_cache, v_cache, kv_format("auto")))
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 16, :, :, slot % 16], k[t])
        assert torch.equal(v_cache[slot // 16, :, slot % 16], v[t])
    assert int((k_cache != 0).sum()) <= tokens * kv_heads * head_dim  # nothing written elsewhere

    gate_up = torch.randn(tokens, 2 * 1536, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.act_and_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features,bias", [(1001, 576, False), (960, 576, True), (64, 1536, False)])
def test_gemm_matches_matmul_and_is_batch_invariant(dtype, out_features, in_features, bias, cpu_target):
    """On each target this machine runs: the native GEMM against float32 matmul of the same inputs
    (partial panels, bias), and every row of a 300-row call equal, bit for bit, to the same row computed
    alone and in calls of other sizes (AVX-512's bf16 runs vdpbf16ps for 1-2 rows and float32 FMAs for
    more: denormal inputs included, they must agree)."""
    native = gemm(torch.device("cpu"), dtype, in_features)
    if native is None:
        pytest.skip("no native GEMM for this dtype here: F.linear is used")
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    packed, padded_bias = native.pack(weight, b)
    x = torch.randn(300, in_features, generator=gen).to(dtype)
    x[0, :8], x[17, ::7], x[120] = 1e-39, -3e-39, 2e-40  # denormals (bf16 has them), a whole row of them
    out = native.forward(x, packed, padded_bias, out_features)
    assert out.shape == (300, out_features) and out.dtype == dtype
    reference = x.float() @ weight.float().T + (0 if b is None else b.float())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=1e-2)  # bf16: the output's rounding
    torch.testing.assert_close(out.float(), reference, **tol)
    for first, rows in [(0, 1), (17, 1), (16, 2), (120, 1), (3, 5), (100, 13), (40, 97), (50, 250)]:
        part = native.forward(x[first:first + rows], packed, padded_bias, out_features)
        assert torch.equal(part, out[first:first + rows]), f"rows {first}..{first + rows} differ"


def test_report_names_the_target_and_what_falls_back(cpu_target):
    """The engine's start-up line: the target as MINIVLLM_CPU_ARCH gives it, simd.h's section, and every
    kernel family native (a target with a section) or named under torch (float16: no kernels at all)."""
    lib = library(cpu_arch())
    if lib is None:
        pytest.skip("no C compiler: the torch path is used")
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    amx = cpu_target == "native" and "amx_bf16" in flags and not os.environ.get("MINIVLLM_NO_AMX")
    section = lib.simd_target().decode() + ("+amx" if amx else "")
    families = ", ".join(KERNEL_GROUPS)
    line = report(torch.device("cpu"), torch.bfloat16)
    if section == "none":
        assert line == (f"minivllm: kernels for {cpu_target} (none): paged attention, layer ops, LoRA; "
                        "torch for: quantized GEMM, GEMM, layer loop, experts")
    else:
        assert line == f"minivllm: kernels for {cpu_target} ({section}): {families}; torch for: nothing"
    float16 = report(torch.device("cpu"), torch.float16)
    assert float16 == f"minivllm: kernels for {cpu_target}: nothing; torch for: {families}"


def test_torch_fallback_gives_the_same_tokens(llm):
    """CUDA and machines without a compiler run the model in plain torch: same greedy tokens."""
    runner = llm.engine.runner
    if not runner.batch_invariant:
        pytest.skip("no native kernels here: the fallback is what every other test runs")
    prompts = EQUALITY_PROMPTS[:4]
    with_kernels = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    kernel, runner.attention_kernel = runner.attention_kernel, None
    runner.model.use_native_kernels(False)
    try:
        assert not runner.batch_invariant
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    finally:
        runner.attention_kernel = kernel
        runner.model.use_native_kernels(True)
    assert with_kernels == without


QUANTIZED_KV = ["int8", "fp8_e4m3", "fp8_e5m2"]
# Largest |stored - exact| relative to the token's amax: half a step of the format's grid at the top of
# its range (int8: 0.5 / 127; e4m3: 3 mantissa bits -> 2^-4 of 448 / 448; e5m2: 2 bits -> 2^-3).
KV_ROUNDING = {"int8": 0.5 / 127, "fp8_e4m3": 2 ** -4, "fp8_e5m2": 2 ** -3}
# Worst attention output error of a row against exact K/V, relative to the row's largest output, over
# random K/V and queries (logits of standard deviation up to 3): about 1.5x what was measured (0.03,
# 0.15, 0.24). The model's own figures are teacher-forced perplexity (`minivllm bench quality`).
ATTENTION_KV_ERROR = {"int8": 0.05, "fp8_e4m3": 0.22, "fp8_e5m2": 0.35}


def _quantized_pool(dtype, kv_cache_dtype, num_blocks, block_size, kv_heads, head_dim, gen):
    """A pool of every slot written with random K/V through the native write_kv, and the same K/V in a
    float32 pool of the model's layout (what `auto` would hold, unrounded)."""
    ops = _ops(dtype)
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
    quantized = allocate_kv_caches(1, k_shape, v_shape, dtype, torch.device("cpu"), kv_format(kv_cache_dtype))[0]
    exact = allocate_kv_caches(1, k_shape, v_shape, torch.float32, torch.device("cpu"))[0]
    slots = torch.randperm(num_blocks * block_size, generator=gen)
    # Heads of different magnitudes (queries of unit size then give logits of standard deviation 0.1 to 3).
    k, v = ((torch.randn(len(slots), kv_heads, head_dim, generator=gen)
             * torch.logspace(-1, 0.5, kv_heads)[:, None]).to(dtype) for _ in range(2))
    ops.write_kv(k, v, slots // block_size, slots % block_size, quantized)
    write_kv(k.float(), v.float(), slots // block_size, slots % block_size, exact)
    return quantized, exact, (k, v, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_KV)
def test_write_kv_quantized_matches_the_torch_twin(dtype, kv_cache_dtype):
    """The native write_kv stores the same bits and scales as the torch twin (kv_cache.quantize), one
    scale per token and head (amax / QMAX), and every value within half a grid step of the input."""
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim, block_size, num_blocks = 3, 64, 16, 8
    native, _, (k, v, slots) = _quantized_pool(dtype, kv_cache_dtype, num_blocks, block_size, kv_heads, head_dim, gen)
    k[5], v[7, 1] = 0, 0  # all-zero heads: scale 0, values 0
    ops, fmt = _ops(dtype), native.fmt
    native = allocate_kv_caches(1, native.k.shape, native.v.shape, dtype, torch.device("cpu"), fmt)[0]
    twin = allocate_kv_caches(1, native.k.shape, native.v.shape, dtype, torch.device("cpu"), fmt)[0]
    part = slots[:40]  # 40 of the 128 slots: the others must stay zero
    ops.write_kv(k, v, part // block_size, part % block_size, native)
    write_kv(k[:40], v[:40], part // block_size, part % block_size, twin)
    for ours, theirs in zip(native.tensors(), twin.tensors()):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    b, o = part // block_size, part % block_size
    for x, stored, scale in ((k[:40], native.k[b, :, :, o], native.k_scale[b, :, o]),
                             (v[:40], native.v[b, :, o], native.v_scale[b, :, o])):
        amax = x.float().abs().amax(-1)
        assert torch.equal(scale, amax * torch.tensor(1 / fmt.qmax))
        back = dequantize(stored, scale[..., None], fmt, torch.float32)
        assert ((back - x.float()).abs() <= KV_ROUNDING[kv_cache_dtype] * amax[..., None] * 1.0001).all()
    assert int(native.k_scale.count_nonzero()) <= 40 * kv_heads  # nothing written elsewhere
    assert int(native.k.view(torch.uint8).count_nonzero()) <= 40 * kv_heads * head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_KV)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (12, 2, 128, 16), (6, 2, 80, 32)])
def test_attention_reads_quantized_kv(dtype, kv_cache_dtype, heads, kv_heads, head_dim, block_size):
    """The kernel on a quantized pool: each row against SDPA over the dequantized K/V (the kernel's own
    tolerance), against SDPA over the exact K/V (the format's cost, tolerance ATTENTION_KV_ERROR), and
    each row alone equal to it in the batch (batch invariance holds on quantized pools too)."""
    kernel = attention_kernel(torch.device("cpu"), dtype, head_dim, heads // kv_heads, block_size, kv_cache_dtype)
    if kernel is None:
        pytest.skip("no C compiler: the torch path is used")
    gen = torch.Generator().manual_seed(2)
    num_blocks, scale = 60, head_dim ** -0.5
    cache, exact, _ = _quantized_pool(dtype, kv_cache_dtype, num_blocks, block_size, kv_heads, head_dim, gen)
    fmt = cache.fmt
    k_deq = dequantize(cache.k, cache.k_scale[:, :, None, :], fmt, torch.float32)
    v_deq = dequantize(cache.v, cache.v_scale[..., None], fmt, torch.float32)
    spans = [(0, 1, 1), (1, 1, block_size + 1), (2, 1, 150), (3, 21, 1), (24, 13, 38)]
    max_blocks = -(-200 // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[:max_blocks].repeat(len(spans), 1)
    q = torch.randn(39, heads, head_dim, generator=gen).to(dtype)
    out = _attend(kernel, q, cache, tables, spans, scale)
    worst = 0.0
    for s, (first, rows, ctx0) in enumerate(spans):
        for i in range(rows):
            row = first + i
            own = reference(q[row], k_deq, v_deq, tables[s], ctx0 + i, scale)
            # float32: the scales are applied to scores and weights, not to K/V, so sums round differently.
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[row].float(), own, atol=tol, rtol=tol)
            full = reference(q[row], exact.k, exact.v, tables[s], ctx0 + i, scale)
            worst = max(worst, float((out[row].float() - full).abs().max() / full.abs().max()))
            alone = _attend(kernel, q[row:row + 1], cache, tables[s:s + 1], [(0, 1, ctx0 + i)], scale)
            assert torch.equal(alone[0], out[row]), f"row {row} differs when computed alone"
    assert worst <= ATTENTION_KV_ERROR[kv_cache_dtype]
