"""`minivllm bench kernels`: each CPU fast path of the model against the torch code it replaces, on
this model's shapes, with weights and KV caches far larger than the caches as in a real step. It
shows why each native path exists (kernels.py) and keeps the figures of BENCHMARKS.md reproducible."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from minivllm.bench.roofline import best_time, model_gemms
from minivllm.model.attention import AttentionMetadata, PrefillSpan, decode_mask, kv_cache_shapes, paged_attention
from minivllm.model import quant
from minivllm.model.kernels import attention_kernel, gemm, layer_ops, quant_gemm
from minivllm.model.kv_cache import KVCache, allocate_kv_caches, kv_bytes_per_token, kv_format, quantize
from minivllm.model.decoder import RMSNorm, apply_rotary
from minivllm.model.model_config import ModelConfig

CPU, BF16 = torch.device("cpu"), torch.bfloat16


@dataclass
class KernelTiming:
    what: str  # the operation and its size
    torch_ms: float  # the plain torch path
    native_ms: float | None  # the fast path the model takes (None: not available here)
    note: str = ""

    @property
    def speedup(self) -> float | None:
        return None if self.native_ms is None else self.torch_ms / self.native_ms


def linears(config: ModelConfig, rows: list[int]) -> list[KernelTiming]:
    """All decoder layers' GEMMs (one step's worth of weights, read cold) at each row count: the native
    batch-invariant GEMM against F.linear (oneDNN/MKL)."""
    body, _ = model_gemms(config)
    weights = [torch.randn(s.out_features, s.in_features, dtype=BF16) for s in body for _ in range(s.count)]
    native = gemm(CPU, BF16, weights[0].shape[1])
    packed = [native.pack(w, None)[0] for w in weights] if native else []
    nbytes = sum(w.numel() * 2 for w in weights)
    out = []
    for n in rows:
        xs = {k: torch.randn(n, k, dtype=BF16) for k in {w.shape[1] for w in weights}}
        plain = best_time(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], CPU)
        fast = native and best_time(
            lambda: [native.forward(xs[w.shape[1]], p, None, w.shape[0]) for w, p in zip(weights, packed)], CPU)
        best = min(plain, fast or plain)
        out.append(KernelTiming(f"{len(weights)} layer GEMMs x {n} rows", plain * 1e3, fast and fast * 1e3,
                                f"weights read at {nbytes / best / 1e9:.1f} GB/s, {2 * n * nbytes / 2 / best / 1e9:.0f} "
                                "GFLOP/s"))
    return out


def _caches(config: ModelConfig, num_blocks: int, block_size: int, kv_cache_dtype: str,
            random: bool) -> list[KVCache]:
    """Every layer's pool in this format: random K/V (and scales), or zeros."""
    fmt = kv_format(kv_cache_dtype)
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    caches = allocate_kv_caches(config.num_hidden_layers, k_shape, v_shape, BF16, CPU, fmt)
    for cache in caches if random else []:
        for values in (cache.k, cache.v):
            values.copy_(quantize(torch.randn(values.shape), fmt)[0] if fmt.quantized else torch.randn(values.shape))
        for scales in (cache.k_scale, cache.v_scale) if fmt.quantized else ():
            scales.uniform_(0.01, 0.02)
    return caches


def quantized_linears(config: ModelConfig, rows: list[int]) -> list[KernelTiming]:
    """The same GEMMs on 4-bit weights (the default file's Q4_1 layout) with the quantized kernel, against
    the bf16 GEMM on the same weights dequantized: the bound of any dequantize-in-registers kernel,
    which would do that GEMM's work plus the dequantization."""
    body, _ = model_gemms(config)
    shapes = [(s.out_features, s.in_features) for s in body for _ in range(s.count)]
    kernel, bf16 = quant_gemm(CPU, BF16), gemm(CPU, BF16, shapes[0][1])
    if kernel is None or bf16 is None:
        return []
    weights = [quant.QuantizedWeight.of(quant.quantize(torch.randn(n, k) * 0.02, "int4")) for n, k in shapes]
    dense = [bf16.pack(w.dequantize().to(BF16), None)[0] for w in weights]
    nbytes = sum(w.nbytes for w in weights)
    out = []
    for n in rows:
        xs = {k: torch.randn(n, k, dtype=BF16) for _, k in shapes}
        plain = best_time(lambda: [bf16.forward(xs[k], p, None, m) for (m, k), p in zip(shapes, dense)], CPU)
        fast = best_time(lambda: [kernel.forward(xs[w.k], w, None) for w in weights], CPU)
        out.append(KernelTiming(f"{len(shapes)} layer GEMMs x {n} rows, 4-bit", plain * 1e3, fast * 1e3,
                                f"torch column: the bf16 GEMM on dequantized weights; 4-bit weights read at "
                                f"{nbytes / fast / 1e9:.1f} GB/s"))
    return out


def _time_attention(config: ModelConfig, caches: list[KVCache], meta: AttentionMetadata,
                    block_size: int) -> tuple[float, float | None]:
    """Seconds of one step's attention in every layer (KV write included) on the torch path (`meta` as
    the torch path wants it) and with the native kernels (None where there are none)."""
    kv_heads, head_dim, heads = config.num_key_value_heads, config.head_dim, config.num_attention_heads
    tokens = meta.num_real_tokens
    q = torch.randn(tokens, heads, head_dim, dtype=BF16)
    k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=BF16) for _ in range(2))

    def step(m: AttentionMetadata, ops=None) -> None:
        for cache in caches:
            paged_attention(q, k, v, cache, m, head_dim ** -0.5, ops)

    kernel = attention_kernel(CPU, BF16, head_dim, heads // kv_heads, block_size, caches[0].fmt.name)
    fast_meta = replace(meta, kernel=kernel, decode_mask=None, prefills=[])
    with torch.inference_mode():
        plain = best_time(lambda: step(meta), CPU)
        fast = kernel and best_time(lambda: step(fast_meta, layer_ops(CPU, BF16)), CPU)
    return plain, fast


def decode_attention(config: ModelConfig, num_seqs: int, context: int, block_size: int = 16,
                     kv_cache_dtype: str = "auto") -> KernelTiming:
    """One decode step's attention in every layer (KV write included) over caches read from DRAM."""
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    per_seq = -(-(context + 1) // block_size)
    caches = _caches(config, num_seqs * per_seq, block_size, kv_cache_dtype, random=True)
    tables = torch.arange(num_seqs * per_seq).view(num_seqs, per_seq)  # a fresh engine allocates in order
    lens = torch.full((num_seqs,), context + 1)
    slots = torch.arange(num_seqs) * per_seq + context // block_size
    meta = AttentionMetadata(slot_blocks=slots, slot_offsets=torch.full((num_seqs,), context % block_size),
                             span_starts=torch.arange(num_seqs), span_lens=torch.ones(num_seqs, dtype=torch.long),
                             span_ctx0=lens, block_tables=tables, num_decodes=num_seqs)
    plain, fast = _time_attention(config, caches, replace(meta, decode_mask=decode_mask(lens, per_seq * block_size)),
                                  block_size)
    kv_bytes = num_seqs * (context + 1) * kv_bytes_per_token(config.num_hidden_layers, kv_heads, head_dim, BF16,
                                                             caches[0].fmt)
    best = fast or plain
    return KernelTiming(f"decode attention, {num_seqs} seqs x {context} tokens, {config.num_hidden_layers} layers"
                        f", KV {kv_cache_dtype}",
                        plain * 1e3, fast and fast * 1e3, f"K/V read at {kv_bytes / best / 1e9:.1f} GB/s")


def prefill_attention(config: ModelConfig, tokens: int, block_size: int = 16,
                      kv_cache_dtype: str = "auto") -> KernelTiming:
    """One fresh prompt's attention in every layer (KV write included): the native kernel, which treats
    each query as a decode at its position (batch invariance), against causal scaled_dot_product_attention."""
    num_blocks = -(-tokens // block_size)
    caches = _caches(config, num_blocks, block_size, kv_cache_dtype, random=False)
    slots = torch.arange(tokens)
    one = torch.tensor([1])
    meta = AttentionMetadata(slot_blocks=slots // block_size, slot_offsets=slots % block_size,
                             span_starts=torch.tensor([0]), span_lens=torch.tensor([tokens]), span_ctx0=one,
                             block_tables=torch.arange(num_blocks)[None], prefills=[PrefillSpan(0, tokens, tokens)])
    plain, fast = _time_attention(config, caches, meta, block_size)
    return KernelTiming(f"prefill attention, 1 prompt x {tokens} tokens, {config.num_hidden_layers} layers"
                        f", KV {kv_cache_dtype}",
                        plain * 1e3, fast and fast * 1e3, "native: each query as a decode at its position")


def layer_op_timings(config: ModelConfig, rows: list[int]) -> list[KernelTiming]:
    """The fused ops of one layer against their torch versions, in microseconds (as ms / 1000)."""
    ops, hidden, inter = layer_ops(CPU, BF16), config.hidden_size, config.intermediate_size
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    norm = RMSNorm(hidden, config.rms_norm_eps).to(BF16)
    out = []
    for n in rows:
        x, residual = torch.randn(n, hidden, dtype=BF16), torch.randn(n, hidden, dtype=BF16)
        gate_up = torch.randn(n, 2 * inter, dtype=BF16)
        q, k = torch.randn(n, heads, head_dim, dtype=BF16), torch.randn(n, kv_heads, head_dim, dtype=BF16)
        angles = torch.rand(n, head_dim // 2) * 6.28  # real rotations: repeated in place, they keep the norm
        cos, sin = angles.cos(), angles.sin()
        cases = [("add + RMSNorm", lambda: norm._norm(residual + x),
                  ops and (lambda: ops.add_rms_norm(x, residual.clone(), norm.weight, norm.eps))),
                 ("SiLU and mul", lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:],
                  ops and (lambda: ops.act_and_mul(gate_up))),
                 ("RoPE on q and k", lambda: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)),
                  ops and (lambda: ops.rotary_(q, k, cos, sin)))]
        with torch.inference_mode():
            for name, plain, fast in cases:
                out.append(KernelTiming(f"{name}, {n} rows", best_time(plain, CPU) * 1e3,
                                        fast and best_time(fast, CPU) * 1e3))
    return out


def format_timings(timings: list[KernelTiming]) -> str:
    lines = [f"{'operation':<58}{'torch ms':>10}{'native ms':>11}{'speedup':>9}  note"]
    for t in timings:
        native = "-" if t.native_ms is None else f"{t.native_ms:.3f}"
        speedup = "-" if t.speedup is None else f"{t.speedup:.2f}x"
        lines.append(f"{t.what:<58}{t.torch_ms:>10.3f}{native:>11}{speedup:>9}  {t.note}")
    return "\n".join(lines)
