"""The decoder's layer loop in one native call (csrc/forward.c), beside decoder.py's Python loop.

With every kernel native, a step still pays Python between them: a dozen launches per layer, each a
few microseconds of ctypes, views and allocations; at one sequence on a 135M model that is as much
time as the arithmetic. `NativeForward` describes the model once (weights, norms, shapes as C structs)
and then runs all layers of a step in one call to the same kernels in the same order: the same bits
as the Python loop, which stays the readable reference and the path for what this one does not cover
(the torch twins, tensor-parallel ranks). A step with LoRA adapters passes their segments along (the
arrays of lora/layers.py's LoRAContext), and forward.c adds them after each linear as the Python loop's
hooks do. A sparse layer's mixture of experts is one call to csrc/moe.c (NativeMoE), in both loops.
Every family switch the registry knows is covered (forward.c's LayerDesc and ModelDesc); the structs
below mirror forward.c's and layer_desc.h's field for field, which tests/test_native_forward.py checks
against the C source.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from minivllm.model.attention import AttentionMetadata
from minivllm.model.kv_cache import KVCache
from minivllm.model.model_config import ACTIVATIONS, ROUTINGS, ModelConfig

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


MAX_SEGMENTS = 3  # csrc/forward.c: a fused q/k/v in three formats


class _Segment(ctypes.Structure):
    _fields_ = [("weight", _PTR), ("n", _I64), ("qtype", _I64)]


class _Linear(ctypes.Structure):
    _fields_ = [("weight", _PTR), ("bias", _PTR), ("n", _I64), ("k", _I64), ("num_segments", _I64),
                ("segments", _Segment * MAX_SEGMENTS)]


class _Expert(ctypes.Structure):
    _fields_ = [("gate_up", _Linear), ("down", _Linear)]


class _MoE(ctypes.Structure):
    _fields_ = [("router", _Linear), ("experts", ctypes.POINTER(_Expert)), ("shared", _Expert),
                ("shared_gate", _Linear)] + [
        (name, _I64) for name in ("num_experts", "top_k", "inter", "shared_inter", "routing", "norm_topk_prob",
                                  "act")] + [("load", _PTR)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("moe", _PTR)] + [
        (name, _PTR) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm",
                                  "sinks")] + [
        ("rope", _I64), ("window", _I64), ("norm_projection", _I64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                          "block_size", "rot_dim", "act")] + [
        (name, ctypes.c_float) for name in ("eps", "scale", "softcap", "residual_scale")] + [
        ("layers", ctypes.POINTER(_Layer)), ("final_norm", _PTR), ("attention", _PTR), ("write_kv_quant", _PTR),
        ("kv_inv_qmax", ctypes.c_float), ("kv_qmax", ctypes.c_float)]


NUM_ROPES = 2  # csrc/forward.c: model_config.ROPE_GLOBAL and ROPE_LOCAL


class _Step(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("tokens", "real_tokens", "spans", "max_blocks")] + [
        ("cos", _PTR * NUM_ROPES), ("sin", _PTR * NUM_ROPES)] + [
        (name, _PTR) for name in ("slot_blocks", "slot_offsets", "block_tables", "span_starts", "span_lens",
                                  "span_ctx0", "k_caches", "v_caches", "k_scales", "v_scales")] + [
        ("lora_segments", _I64), ("lora_starts", _PTR), ("lora_lens", _PTR), ("lora_weights", _PTR)]


def _linear(module) -> _Linear:
    """A decoder.Linear's native weight as the C side wants it (it must be on a native path)."""
    if module.quantized is not None:
        w = module.quantized
        segments = [_Segment(s.packed.data_ptr(), s.n, s.qtype) for s in w.segments]
        return _Linear(None, _ptr(module.quantized_bias), w.n, w.k, len(segments),
                       (_Segment * MAX_SEGMENTS)(*segments))
    packed, bias = module.packed
    return _Linear(packed.data_ptr(), _ptr(bias), module.out_features, module.in_features, 0)


def _expert(mlp) -> _Expert:
    return _Expert(_linear(mlp.gate_up_proj), _linear(mlp.down_proj)) if mlp is not None else _Expert()


def _layer(layer) -> _Layer:
    """A decoder.DecoderLayer as forward.c's LayerDesc; a sparse layer's MLP is its NativeMoE's description."""
    attn, sandwich, mlp = layer.self_attn, layer.sandwich, layer.mlp
    mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
    sparse = hasattr(mlp, "experts")
    dense, moe = _expert(None if sparse else mlp), ctypes.addressof(mlp.native.desc) if sparse else None
    return _Layer(_linear(attn.qkv_proj), _linear(attn.o_proj), dense.gate_up, dense.down, moe,
                  layer.input_layernorm.weight.data_ptr(), mlp_norm.weight.data_ptr(),
                  _weight(attn.q_norm), _weight(attn.k_norm),
                  _weight(layer.post_attention_layernorm if sandwich else None),
                  _weight(layer.post_feedforward_layernorm if sandwich else None), _ptr(attn.sink_logits),
                  attn.rope, attn.window or 0, attn.norm_projection)


def _weight(norm) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _address(function) -> int | None:
    return None if function is None else ctypes.cast(function, ctypes.c_void_p).value


class NativeMoE:
    """decoder.SparseMoE in one call to csrc/moe.c: the router, the grouped experts, the weighted sum and
    the shared expert. Its description (a MoEDesc) also joins forward.c's layer loop, so that the Python
    loop and the native one run the same kernel and give the same bits."""

    def __init__(self, moe, config: ModelConfig, function) -> None:
        self._function = function
        self._experts = (_Expert * len(moe.experts))(*[_expert(e) for e in moe.experts])
        shared_gate = _linear(moe.shared_expert_gate) if moe.shared_expert is not None else _Linear()
        self.desc = _MoE(_linear(moe.gate), self._experts, _expert(moe.shared_expert), shared_gate,
                         config.num_experts, config.num_experts_per_tok, config.expert_size,
                         config.shared_expert_size or 0, ROUTINGS.index(config.routing), int(config.norm_topk_prob),
                         ACTIVATIONS.index(config.hidden_act), moe.expert_load.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self._function(ctypes.byref(self.desc), x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
        return out


class NativeForward:
    @staticmethod
    def covers(config: ModelConfig) -> bool:
        """Whether forward.c runs this model's layers: not where q, k and v are clamped (OLMo's clip_qkv;
        decoder.py's Python loop runs those, on the same native kernels)."""
        return config.clip_qkv is None

    def __init__(self, model, function) -> None:
        cfg = model.config
        self._function = function
        self._layers = (_Layer * len(model.layers))(*[_layer(layer) for layer in model.layers])
        self._model = _Model(len(model.layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.head_dim, cfg.intermediate_size, 0, cfg.rotary_size, ACTIVATIONS.index(cfg.hidden_act),
                             model.norm.eps, cfg.scale, cfg.attn_logit_softcap or 0.0, cfg.residual_scale,
                             self._layers, model.norm.weight.data_ptr())
        self._ops = model.layers[0].self_attn.ops if model.layers else None  # for a quantized pool's KV write
        self._caches: tuple[list, list[ctypes.Array | None]] | None = None

    def __call__(self, residual: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                 kv_caches: list[KVCache], meta: AttentionMetadata, lora: Any = None) -> torch.Tensor:
        """`lora`: the model's LoRAContext (lora/layers.py) where adapters serve on it; a step with
        adapter rows passes its segments to forward.c."""
        k_ptrs, v_ptrs, k_scales, v_scales = self._cache_pointers(kv_caches)
        self._model.block_size = kv_caches[0].k.shape[3]
        self._model.attention = _address(meta.kernel)  # the pool format's kernel (runner.attention_kernel)
        tables = [ropes[min(i, len(ropes) - 1)] for i in range(NUM_ROPES)]  # a model with one table: both slots
        step = _Step(residual.shape[0], meta.num_real_tokens, meta.span_starts.shape[0], meta.block_tables.shape[1],
                     (_PTR * NUM_ROPES)(*[cos.data_ptr() for cos, _ in tables]),
                     (_PTR * NUM_ROPES)(*[sin.data_ptr() for _, sin in tables]),
                     meta.slot_blocks.data_ptr(), meta.slot_offsets.data_ptr(),
                     meta.block_tables.data_ptr(), meta.span_starts.data_ptr(), meta.span_lens.data_ptr(),
                     meta.span_ctx0.data_ptr(), ctypes.addressof(k_ptrs), ctypes.addressof(v_ptrs),
                     k_scales and ctypes.addressof(k_scales), v_scales and ctypes.addressof(v_scales))
        if lora is not None and lora.active:
            step.lora_segments = len(lora.segments)
            step.lora_starts, step.lora_lens = lora.starts.data_ptr(), lora.lens.data_ptr()
            step.lora_weights = lora.weights.data_ptr()
        out = torch.empty_like(residual)
        self._function(ctypes.byref(self._model), ctypes.byref(step), residual.data_ptr(), out.data_ptr())
        return out

    def _cache_pointers(self, kv_caches: list[KVCache]) -> list[ctypes.Array | None]:
        """The pool's per-layer pointers (K, V, and the scales of a quantized pool, else None), built once
        per pool (the list is kept, so its id stays its own); the pool's format sets the KV write."""
        if self._caches is None or self._caches[0] is not kv_caches:
            fmt = kv_caches[0].fmt
            arrays = [(ctypes.c_void_p * len(kv_caches))(*[getattr(c, name).data_ptr() for c in kv_caches])
                      if fmt.quantized or name in ("k", "v") else None for name in ("k", "v", "k_scale", "v_scale")]
            self._caches = (kv_caches, arrays)
            write = self._ops.quantized_write_kv(fmt) if fmt.quantized else None
            self._model.write_kv_quant = _address(write)
            self._model.kv_inv_qmax, self._model.kv_qmax = (fmt.inv_qmax, fmt.qmax) if fmt.quantized else (0.0, 0.0)
        return self._caches[1]
