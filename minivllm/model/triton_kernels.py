"""The CUDA kernels, in Triton: a GEMM, RMSNorm, the KV write and paged attention, each batch-invariant.

Batch invariance here means what it means for the CPU kernels (kernels.py): a row's bits depend on that
row alone, never on how many rows share the call. Each kernel gets there the same way: every launch
parameter that shapes the arithmetic (tiles, the split of K, warps) is a function of the weights' or the
model's shapes only, never of the row count, and every reduction runs in one fixed order.
- GEMM: tiles of BLOCK_M x BLOCK_N over K in BLOCK_K steps (tensor-core dots accumulating in float32).
  Where N alone gives too few tiles to fill the GPU at decode, K is split into SPLIT fixed ranges, chosen
  from (N, K); their float32 partials are summed in split order by a second kernel. No split chosen by M.
- RMSNorm: one program per row, the sum of squares in float32 over one block the row's width.
- Paged attention: one program per (sequence span, tile of its queries, kv head), the tile's rows being
  (query, head of the kv head's group) pairs; keys and values are read through the block table in chunks
  of BLOCK_N positions aligned to multiples of BLOCK_N, in position order, with an online softmax. A
  chunk a query cannot see leaves its state exactly as it was (scale 1, weights 0), so a query's output is
  the same bits whether it is a decode, one row of a prefill tile or of a chunk after a cached prefix.
Launch helpers below take torch tensors; cuda_kernels.py holds the table entries the model asks for.

Under TRITON_INTERPRET=1 these run on the CPU (tests/test_cuda.py); the interpreter's tl.dot on bfloat16
is wrong in some Triton releases, so the CPU tests check the dot kernels in float16 and float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The GEMM's tiles (one configuration for every row count: see above). 64 rows keep a decode's waste
# small while still using Hopper's 64-row tensor-core instructions.
GEMM_BLOCK_M, GEMM_BLOCK_K = 64, 64
GEMM_TARGET_PROGRAMS = 128  # split K until the N tiles times the splits reach this (at most)
GEMM_MIN_K_PER_SPLIT = 512
ATTN_BLOCK_M, ATTN_BLOCK_N = 64, 64  # rows (query, head) per tile; key positions per chunk
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def gemm_block_n(n: int) -> int:
    return 128 if n >= 8192 else 64


def gemm_split(n: int, k: int) -> int:
    """How many fixed ranges K is split into for an [*, k] @ [k, n] product: a function of (n, k) only."""
    tiles, split = triton.cdiv(n, gemm_block_n(n)), 1
    while tiles * split < GEMM_TARGET_PROGRAMS and k // (2 * split) >= GEMM_MIN_K_PER_SPLIT:
        split *= 2
    return split


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os,
                 k_per_split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) over this program's range of K; with SPLIT > 1 the
    float32 partial of range `split` goes to out[split] and _split_sum_kernel finishes it."""
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = split * k_per_split
    for k in range(k_first, k_first + k_per_split, BLOCK_K):
        k_ok = (k + rk) < K
        a = tl.load(x_rows + (k + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + (k + rk)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    out = out_ptr + split * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["numel"])
def _split_sum_kernel(partial_ptr, bias_ptr, out_ptr, numel, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out = sum over s of partial[s] (in s order, float32) + bias, in out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(partial_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(partial_ptr + s * numel + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]): [M, N] in x's dtype, each row in one order whatever M is."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    block_n, split = gemm_block_n(n), gemm_split(n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), GEMM_BLOCK_K) * GEMM_BLOCK_K
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(n, block_n), split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    stride_os = 0 if split == 1 else target.stride(0)
    _gemm_kernel[grid](x, weight, bias if split == 1 else None, target, m, n, k, x.stride(0), weight.stride(0),
                       n, stride_os, k_per_split, HAS_BIAS=bias is not None and split == 1, SPLIT=split,
                       BLOCK_M=GEMM_BLOCK_M, BLOCK_N=block_n, BLOCK_K=GEMM_BLOCK_K, num_warps=4, num_stages=3)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](target, bias, out, m * n, n, SPLIT=split,
                                                         HAS_BIAS=bias is not None, BLOCK=block)
    return out


@triton.jit(do_not_specialize=["rows"])
def _add_rms_norm_kernel(delta_ptr, residual_ptr, weight_ptr, out_ptr, rows, width, stride_d, stride_r,
                         stride_o, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    """residual += delta (in the residual's dtype, stored back); out = weight * norm(residual), the norm in
    float32 rounded to the dtype before the weight multiplies it, as decoder.RMSNorm computes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        r = (r.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32))
        r = r.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, r, mask=ok)
    x = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    y = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta in place (if given); returns RMSNorm(residual) * weight. Rows [T, width]."""
    rows, width = residual.shape
    out = torch.empty_like(residual)
    if rows:
        _add_rms_norm_kernel[(rows,)](delta, residual, weight, out, rows, width,
                                      0 if delta is None else delta.stride(0), residual.stride(0), out.stride(0),
                                      eps, HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(width))
    return out


@triton.jit(do_not_specialize=["tokens"])
def _head_rms_norm_kernel(x_ptr, weight_ptr, tokens, heads, head_dim, stride_t, stride_h, eps,
                          BLOCK: tl.constexpr):
    """RMSNorm of one head of one token in place (q/k norms)."""
    pid = tl.program_id(0).to(tl.int64)
    ptr = x_ptr + (pid // heads) * stride_t + (pid % heads) * stride_h
    cols = tl.arange(0, BLOCK)
    ok = cols < head_dim
    x = tl.load(ptr + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptr + cols, (y * w).to(x_ptr.dtype.element_ty), mask=ok)


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """x [T, heads, head_dim] (each head's values contiguous; a view of the qkv output is fine)."""
    tokens, heads, head_dim = x.shape
    if tokens:
        _head_rms_norm_kernel[(tokens * heads,)](x, weight, tokens, heads, head_dim, x.stride(0), x.stride(1),
                                                 eps, BLOCK=triton.next_power_of_2(head_dim))


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))  # never overflows
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _rotate_head(ptr, cos, sin, half, BLOCK: tl.constexpr):
    """The NeoX rotation of one head's first 2 * half values in place, in float32."""
    i = tl.arange(0, BLOCK)
    ok = i < half
    x1 = tl.load(ptr + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + half + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptr + i, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=ok)
    tl.store(ptr + half + i, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["tokens"])
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, tokens, heads, half, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_ct, BLOCK: tl.constexpr):
    """Head h of token t: of q where h < heads, else of k."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    cos = tl.load(cos_ptr + t * stride_ct + i, mask=i < half, other=0.0)
    sin = tl.load(sin_ptr + t * stride_ct + i, mask=i < half, other=0.0)
    if h < heads:
        _rotate_head(q_ptr + t * stride_qt + h * stride_qh, cos, sin, half, BLOCK)
    else:
        _rotate_head(k_ptr + t * stride_kt + (h - heads) * stride_kh, cos, sin, half, BLOCK)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] in place (views of the qkv output are
    fine); cos, sin: float32 [T, rotary_dim / 2], rows contiguous (partial rotary leaves the rest)."""
    tokens, half = q.shape[0], cos.shape[1]
    if tokens:
        cos, sin = cos.contiguous(), sin.contiguous()
        _rotary_kernel[(tokens, q.shape[1] + k.shape[1])](
            q, k, cos, sin, tokens, q.shape[1], half, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            BLOCK=triton.next_power_of_2(half))


@triton.jit(do_not_specialize=["tokens"])
def _act_and_mul_kernel(gate_up_ptr, out_ptr, tokens, width, stride_g, stride_o, GELU: tl.constexpr,
                        BLOCK: tl.constexpr):
    """out = act(gate) * up, each rounded to the dtype as torch's two ops round (act in float32)."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < width
    gate = tl.load(gate_up_ptr + t * stride_g + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_g + width + i, mask=ok, other=0.0).to(tl.float32)
    if GELU:  # the tanh approximation
        act = 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + i, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up from the fused [T, 2 * width] gate_up output; act "silu" or "gelu_tanh"."""
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = 1024
        _act_and_mul_kernel[(tokens, triton.cdiv(width, block))](gate_up, out, tokens, width, gate_up.stride(0),
                                                                  out.stride(0), GELU=act != "silu", BLOCK=block)
    return out


@triton.jit(do_not_specialize=["tokens"])
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr, offsets_ptr, tokens, head_dim,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_kcb, stride_kch, stride_kcd,
                     stride_vcb, stride_vch, stride_vcs, BLOCK_D: tl.constexpr):
    """Token t's K/V of kv head h into slot (blocks[t], offsets[t]); a negative block (a padded row of a
    captured decode, cuda_graphs.py) writes nothing."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    block = tl.load(blocks_ptr + t)
    if block >= 0:
        offset = tl.load(offsets_ptr + t)
        d = tl.arange(0, BLOCK_D)
        ok = d < head_dim
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
        tl.store(k_cache_ptr + block * stride_kcb + h * stride_kch + d * stride_kcd + offset, k, mask=ok)
        tl.store(v_cache_ptr + block * stride_vcb + h * stride_vch + offset * stride_vcs + d, v, mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The first len(blocks) tokens' K and V ([T, kv_heads, head_dim], head_dim contiguous) into the pool
    (attention.kv_cache_shapes' layout, the model's dtype)."""
    tokens, kv_heads, head_dim = blocks.shape[0], k.shape[1], k.shape[2]
    if tokens:
        _write_kv_kernel[(tokens, kv_heads)](
            k, v, k_cache, v_cache, blocks, offsets, tokens, head_dim, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), BLOCK_D=triton.next_power_of_2(head_dim))


@triton.jit(do_not_specialize=["window"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, starts_ptr, lens_ptr, ctx0_ptr, sinks_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kcb, stride_kch, stride_kcd,
        stride_vcb, stride_vch, stride_vcs, stride_table, scale, window, softcap,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr):
    span, tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(lens_ptr + span)
    if tile * BLOCK_Q < n:
        first_row = tl.load(starts_ptr + span)
        ctx0 = tl.load(ctx0_ptr + span)  # context of the span's first query, itself included
        r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        qi = tile * BLOCK_Q + r // GROUP_PAD  # the query within the span
        g = r % GROUP_PAD
        row_ok = (qi < n) & (g < GROUP)
        head = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        token = (first_row + qi).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        ctx = ctx0 + qi  # query i sees positions < ctx (and, with a window, >= ctx - window)
        last = tl.minimum(n, (tile + 1) * BLOCK_Q) - 1
        end = ctx0 + last  # the tile's last query sees positions < end
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx0 + tile * BLOCK_Q - window, 0) // BLOCK_N * BLOCK_N
        table = tables_ptr + span.to(tl.int64) * stride_table
        kv_base = kv_head.to(tl.int64)
        m_i = tl.full((BLOCK_Q * GROUP_PAD,), -1.0e30, dtype=tl.float32)  # finite: a fully hidden chunk is a no-op
        l_i = tl.zeros((BLOCK_Q * GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_Q * GROUP_PAD, BLOCK_D), dtype=tl.float32)
        for start in range(lo, end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < end
            block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
            offset = pos % BLOCK_SIZE
            k = tl.load(k_cache_ptr + block[None, :] * stride_kcb + kv_base * stride_kch + d[:, None] * stride_kcd
                        + offset[None, :], mask=d_ok[:, None] & pos_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee") * scale
            else:
                s = tl.dot(q, k) * scale
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            visible = pos[None, :] < ctx[:, None]
            if HAS_WINDOW:
                visible = visible & (pos[None, :] >= ctx[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + block[:, None] * stride_vcb + kv_base * stride_vch
                        + offset[:, None] * stride_vcs + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if HAS_SINKS:  # the head's sink logit joins the denominator alone (past e^80 the weights are 0 anyway)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
            l_i = l_i + tl.exp(tl.minimum(sink - m_i, 80.0))
        o = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    span_starts: torch.Tensor, span_lens: torch.Tensor, span_ctx0: torch.Tensor, max_span_len: int,
                    scale: float, out: torch.Tensor, window: int | None, softcap: float | None,
                    sinks: torch.Tensor | None = None) -> None:
    """Attention for every query row a span covers, into `out` [T, heads, head_dim]; the arguments as
    kernels.paged_attention_native's, plus the longest span (it sizes the grid, so no device read)."""
    spans = span_starts.shape[0]
    if not spans:
        return
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[3]
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, ATTN_BLOCK_M // group_pad)
    grid = (spans, triton.cdiv(max_span_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, span_starts, span_lens, span_ctx0, sinks if sinks is not None else q,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), scale, window or 0, softcap or 1.0,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=ATTN_BLOCK_N,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2)
