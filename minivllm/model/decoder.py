"""The one configurable decoder every family runs (registry.py), written for packed batches.

Every forward takes a flat batch of tokens from many sequences (no padding, no batch dimension) and
attends through the paged KV cache. Q/K/V and gate/up projections are one matrix each (weights.py
fuses them as it loads the checkpoint): fewer, larger GEMMs. A family is a set of switches
(model_config.py), read here where they apply: q/k norms, the rotary table of each layer (global,
Gemma 3's local one, or none for SmolLM3's NoPE layers), partial rotary, sliding windows and
softcaps, Gemma's four norms per layer and GeGLU, Granite's multipliers, OLMoE's norms over the whole
q and k projections, gpt-oss's attention sinks, YaRN and clamped SwiGLU, and a mixture of experts in
place of a layer's MLP (SparseMoE, moe.py). Norm
weights always multiply as x * w: a Gemma checkpoint's x * (1 + w) gets its 1 added as it is read
(hf_reader.py), as llama.cpp's converter does.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model.activations import act_and_mul
from minivllm.model.attention import AttentionMetadata, paged_attention
from minivllm.model.kernels import Gemm, LayerOps, forward_layers, gemm, layer_ops, moe_kernel, quant_gemm
from minivllm.model.kv_cache import KVCache
from minivllm.model.model_config import NO_ROPE, ROPE_LOCAL, ModelConfig
from minivllm.model.moe import route, run_experts
from minivllm.model.native_forward import NativeForward, NativeMoE
from minivllm.model.quant import QuantizedWeight


class Linear(nn.Linear):
    """nn.Linear on the CPU's batch-invariant native kernels (kernels.py) for every row count. The weight
    is a float tensor, packed once into the GEMM's column panels, or quantized (`quantized`, quant.py:
    GGUF blocks or --quantization int8/int4), computed with the quantized kernel or its torch twin."""

    native: Gemm | None = None  # set by CausalLM.use_native_kernels where it applies
    packed: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (weight panels, float32 bias)
    quantized: QuantizedWeight | None = None
    quantized_bias: torch.Tensor | None = None  # the bias in float32, as the quantized paths add it

    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # lora/layers.py's LoRALinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = self.quantized.linear(x, self.quantized_bias)
        elif self.native is not None:
            out = self.native.forward(x, *self.packed, self.out_features)
        else:
            out = F.linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)  # adapters' rows: base + B A x

    def set_quantized(self, weight: QuantizedWeight) -> None:
        self.quantized = weight
        self.register_parameter("weight", None)

    def use_native(self, enabled: bool, device: torch.device, dtype: torch.dtype) -> None:
        if self.quantized is not None:
            kernel = quant_gemm(device, dtype) if enabled else None
            self.quantized.use_kernel(kernel, dtype)
            self.quantized_bias = None if self.bias is None else self.bias.detach().float().contiguous()
            return
        self.native = gemm(device, dtype, self.in_features) if enabled else None
        self.packed = None if self.native is None else self.native.pack(self.weight, self.bias)

    @property
    def uses_native(self) -> bool:
        return self.quantized.kernel is not None if self.quantized is not None else self.native is not None


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be quantized (a GGUF file's Q8_0 token_embd, tied to the LM head):
    then a lookup dequantizes just the rows it reads."""

    quantized: QuantizedWeight | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        self.quantized = weight
        self.register_parameter("weight", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.rows(ids)
        return super().forward(ids)

    def use_native(self, enabled: bool, device: torch.device, dtype: torch.dtype) -> None:
        """Rows come in the model's dtype, decoded by the native kernel or the twin (an untied table has
        no Linear to set this)."""
        if self.quantized is not None:
            self.quantized.use_kernel(quant_gemm(device, dtype) if enabled else None, dtype)


class RMSNorm(nn.Module):
    ops: LayerOps | None = None  # the fused native op, set by CausalLM.use_native_kernels

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x). With the residual stream `residual`: first residual += x in place (x is None at
        the first layer), then RMSNorm(residual): one pass where vLLM fuses the same two steps."""
        if residual is None:
            return self._norm(x)
        if self.ops is not None:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        if x is not None:
            residual += x
        return self._norm(residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the model dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """The rotary frequencies of the global layers (or of Gemma 3's local ones: their own base, no
    scaling), over the rotated part of a head; longrope's short factors (Rotary adds the long ones)."""
    dim = config.rotary_size
    theta = config.local_rope_theta if local else config.rope_theta
    # On the CPU even while the model is built on the meta device: meta tensors' math would import
    # torch._prims (a second of start-up) for a table this small.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta ** exponents)
    scaling = None if local else config.rope_scaling or {}
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":  # Llama 3.1: stretch low frequencies, keep high ones, blend between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, blended))
    elif kind == "freq_factors":  # a GGUF's rope_freqs: the same scaling, precomputed per frequency
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    elif kind == "yarn":  # gpt-oss, Qwen3's long-context configs
        inv_freq = _yarn_inv_freq(theta ** exponents, scaling, dim, theta)
    elif kind == "longrope":  # Phi-3: per-frequency factors, as transformers divides by them
        inv_freq = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu") * theta ** exponents)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


def _yarn_inv_freq(base_powers: torch.Tensor, scaling: dict, dim: int, theta: float) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by the factor), those that turn more than beta_fast times kept, a linear ramp between, as
    transformers computes them."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    span = high - low if high > low else 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / span).clamp(0, 1)
    return 1.0 / (factor * base_powers) * ramp + 1.0 / base_powers * (1 - ramp)


def rope_attention_factor(scaling: dict) -> float:
    """The factor YaRN and longrope multiply cos and sin by: the config's, else YaRN's 0.1 ln(factor) + 1."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling.get("factor", 1.0)
    return 0.1 * math.log(factor) + 1.0 if scaling.get("rope_type") == "yarn" and factor > 1 else 1.0


class Rotary(nn.Module):
    """cos/sin of each position's angles, float32 [tokens, rotary_dim / 2], computed once per forward
    (no table to size). Longrope (Phi-3) uses its long factors from position original_max on, and at
    every position of a request whose prompt is longer than that (`long_rows`: ModelConfig.long_rope),
    as transformers chooses them; per token, so that a token's angles never depend on what else is in
    the batch."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config, local), persistent=False)
        scaling = {} if local else config.rope_scaling or {}
        self.long_from, self.attention_factor = None, rope_attention_factor(scaling)
        if scaling.get("rope_type") == "longrope":
            exponents = torch.arange(0, config.rotary_size, 2, device="cpu").float() / config.rotary_size
            long = torch.tensor(scaling["long_factor"], dtype=torch.float32, device="cpu")
            self.register_buffer("long_inv_freq", 1.0 / (long * config.rope_theta ** exponents), persistent=False)
            self.long_from = scaling["original_max_position_embeddings"]

    def forward(self, positions: torch.Tensor, long_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.long_from is not None:
            long = positions.float()[:, None] * self.long_inv_freq[None, :]
            use_long = positions >= self.long_from
            if long_rows is not None:
                use_long = use_long | long_rows
            freqs = torch.where(use_long[:, None], long, freqs)
        if self.attention_factor != 1.0:
            return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]; the NeoX rotation of the two halves of the first 2 * cos.shape[1]
    dimensions (all of them but with partial rotary), in x's dtype as in HF."""
    rot = 2 * cos.shape[-1]
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(x.dtype)
    rotated = x[..., :rot] * cos + _rotate_half(x[..., :rot]) * sin
    return rotated if rot == x.shape[-1] else torch.cat((rotated, x[..., rot:]), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


Rope = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    ops: LayerOps | None = None

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        # gpt-oss's attention sinks: a logit per head in the softmax's denominator (float32 for the kernels).
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        self.sink_logits: torch.Tensor | None = None
        # Per head (Qwen3, Gemma 3), or over the whole projection before the heads split (OLMoE).
        self.norm_projection = config.qk_norm_span == "projection"
        q_norm_size, k_norm_size = (self.q_size, self.kv_size) if self.norm_projection else (self.head_dim,) * 2
        self.q_norm = RMSNorm(q_norm_size, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, config.rms_norm_eps) if config.qk_norm else None
        self.clip_qkv = config.clip_qkv
        self.scale = config.scale
        self.rope = config.layer_rope(layer)  # model_config.ROPE_GLOBAL, ROPE_LOCAL or NO_ROPE
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcap

    def forward(self, x: torch.Tensor, ropes: list[Rope], kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norm_projection:  # the projection as one head
            q, k = self._qk_norm(q.unflatten(-1, (1, -1)), k.unflatten(-1, (1, -1)))
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_projection:
            q, k = self._qk_norm(q, k)
        if self.rope != NO_ROPE:
            rope = ropes[self.rope]
            if self.ops is not None:
                self.ops.rotary_(q, k, *rope)
            else:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.ops, self.window, self.softcap,
                            self.sink_logits)
        return self.o_proj(o.flatten(1))

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k norms of each head of q [T, heads, d] and k [T, kv_heads, d], in place where native."""
        if self.ops is None:
            return self.q_norm(q), self.k_norm(k)
        self.ops.head_rms_norm_(q, self.q_norm.weight, self.q_norm.eps)
        self.ops.head_rms_norm_(k, self.k_norm.weight, self.k_norm.eps)
        return q, k


class MLP(nn.Module):
    ops: LayerOps | None = None

    def __init__(self, config: ModelConfig, width: int | None = None, bias: bool = False) -> None:
        super().__init__()
        width = width or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, bias=bias)
        self.down_proj = Linear(width, config.hidden_size, bias=bias)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        activation = self.ops.act_and_mul if self.ops is not None else act_and_mul
        return self.down_proj(activation(gate_up, self.act))


class SparseMoE(nn.Module):
    """A sparse layer's MLP: the router (`gate`) picks each token's top-k experts, each an MLP; Qwen2-MoE
    adds a shared expert that every token runs, scaled by sigmoid(x . shared_expert_gate). `expert_load`
    counts the tokens each expert has taken since the model was built (the routing skew, for /metrics).
    With every linear native, the whole layer is one call to csrc/moe.c (`native`); moe.py is its twin."""

    native: NativeMoE | None = None  # set by CausalLM.use_native_kernels where it applies

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(config.hidden_size, config.num_experts, bias=config.expert_bias)
        self.experts = nn.ModuleList(MLP(config, config.expert_size, config.expert_bias)
                                     for _ in range(config.num_experts))
        self.shared_expert = MLP(config, config.shared_expert_size) if config.shared_expert_size else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if config.shared_expert_size else None
        self.top_k, self.routing, self.norm_topk_prob = config.num_experts_per_tok, config.routing, config.norm_topk_prob
        self.register_buffer("expert_load", torch.zeros(config.num_experts, dtype=torch.int64, device="cpu"),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native(x)
        weights, ids = route(self.gate(x), self.top_k, self.routing, self.norm_topk_prob)
        out = run_experts(x, weights, ids, self.experts, self.expert_load)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        # Without sandwich norms, post_attention_layernorm is the MLP's input norm (Llama's name); with
        # them (Gemma) it normalizes the attention's output and pre_feedforward_layernorm is the MLP's.
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config) if config.layer_is_sparse(layer) else MLP(config)
        self.sandwich = config.sandwich_norms
        self.residual_scale = config.residual_scale

    def forward(self, delta: torch.Tensor | None, residual: torch.Tensor, ropes: list[Rope],
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """`residual` is the residual stream, updated in place; `delta` is the previous layer's MLP
        output, not yet added to it (None at the first layer). Returns this layer's MLP output."""
        x = self.self_attn(self.input_layernorm(delta, residual), ropes, kv_cache, meta)
        if self.sandwich:
            x = self.post_attention_layernorm(x)
        x = self._scaled(x)
        y = self.mlp((self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm)(x, residual))
        if self.sandwich:
            y = self.post_feedforward_layernorm(y)
        return self._scaled(y)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """Granite's residual multiplier on a block's output (in its dtype, as transformers rounds it)."""
        return x if self.residual_scale == 1.0 else x * self.residual_scale


class CausalLM(nn.Module):
    # The whole layer loop in one native call (native_forward.py), when every kernel is native; the
    # Python loop in `forward` is its reference.
    native_forward: NativeForward | None = None
    lora: Any = None  # lora/layers.py's LoRAContext once an engine serves adapters on this model

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Given a weight, Embedding skips its random init, whose meta-device version imports torch._dynamo
        # (about 1 s of start-up).
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Index ROPE_GLOBAL, and ROPE_LOCAL where some layer uses Gemma 3's local table.
        uses_local = any(config.layer_rope(i) == ROPE_LOCAL for i in range(config.num_hidden_layers))
        self.rotaries = nn.ModuleList([Rotary(config)] + ([Rotary(config, local=True)] if uses_local else []))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)
        if self.config.embedding_scale != 1.0:  # Gemma: sqrt(hidden) rounded to the dtype first, as transformers
            residual = residual * torch.tensor(self.config.embedding_scale, dtype=residual.dtype)
        ropes = [rotary(positions, meta.long_rope) for rotary in self.rotaries]
        if self.native_forward is not None and meta.kernel is not None:  # adapters' rows too (their native kernel)
            return self.native_forward(residual, ropes, kv_caches, meta, self.lora)
        delta = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            delta = layer(delta, residual, ropes, kv_cache, meta)
        return self.norm(delta, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.config.logits_divisor != 1.0:  # Granite
            logits = logits / self.config.logits_divisor
        if self.config.final_logit_softcap is not None:  # Gemma 2
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def expert_load(self) -> list[list[int]]:
        """Per layer, the tokens each of its experts has taken (the routing skew); [] for a dense layer."""
        return [layer.mlp.expert_load.tolist() if isinstance(layer.mlp, SparseMoE) else [] for layer in self.layers]

    def quantized_weights(self) -> list[QuantizedWeight]:
        return list({id(m.quantized): m.quantized for m in self.modules()
                     if isinstance(m, (Linear, Embedding)) and m.quantized is not None}.values())

    def use_native_kernels(self, enabled: bool) -> None:
        """Route the layers' small ops and GEMMs to the CPU fast paths (kernels.py) where they exist
        for this device and dtype; with False, everything runs as plain torch."""
        device, dtype = self.norm.weight.device, self.norm.weight.dtype
        ops = layer_ops(device, dtype) if enabled else None
        for module in self.modules():
            if isinstance(module, (Linear, Embedding)):
                module.use_native(enabled, device, dtype)
            elif isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops
            if isinstance(module, Attention) and module.sinks is not None:  # every path reads them in float32
                module.sink_logits = module.sinks.detach().float().contiguous()
        experts = moe_kernel(device, dtype) if enabled else None
        for module in self.modules():
            if isinstance(module, SparseMoE):
                linears_native = all(m.uses_native for m in module.modules() if isinstance(m, Linear))
                module.native = NativeMoE(module, self.config, experts) if experts and linears_native else None
        function = forward_layers(device, dtype) if enabled and NativeForward.covers(self.config) else None
        self.native_forward = NativeForward(self, function) if function and self.uses_native_kernels else None

    def layer_loop(self) -> str:
        """Which loop runs the layers, and why not the native one: for the engine's start-up line."""
        if self.native_forward is not None:
            return "native layer loop (csrc/forward.c)"
        device, dtype = self.norm.weight.device, self.norm.weight.dtype
        if not NativeForward.covers(self.config):
            return "Python layer loop: csrc/forward.c has no projection q/k-norm layers"
        if forward_layers(device, dtype) is None:
            return f"Python layer loop: no native layer loop for {device.type}/{dtype} on this target"
        torch_linears = [n for n, m in self.named_modules() if isinstance(m, Linear) and not m.uses_native]
        return f"Python layer loop: {', '.join(torch_linears[:3]) or 'a layer op'} run(s) as torch"

    @property
    def uses_native_kernels(self) -> bool:
        """Whether every GEMM and layer op runs natively (the batch-invariant kernels)."""
        return all(m.uses_native for m in self.modules() if isinstance(m, Linear)) and all(
            m.ops is not None for m in self.modules() if isinstance(m, (RMSNorm, Attention, MLP))) and all(
            m.native is not None for m in self.modules() if isinstance(m, SparseMoE))
