"""The adapters an engine knows and keeps loaded, checked against its model.

Registered adapters (name -> LoRARequest) stay known until removed; at most `max_cpu_loras` of them
are held loaded, least recently used first out, and one evicted is read again from its path when a
request names it. Loading turns an adapter's factors (adapter.py) into the layout csrc/lora.c reads,
per base linear layer ("target"): a fused q/k/v or gate/up layer gets one A^T with the projections'
ranks side by side and one block-diagonal B^T, so that one kernel call per layer adds all of them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from minivllm.lora.adapter import PROJECTIONS, AdapterError, AdapterWeights, read_adapter
from minivllm.lora.layers import LoadedAdapter, LoRAContext, LoRALinear, TargetWeights, padded_columns
from minivllm.lora.request import LoRARequest
from minivllm.model.kernels import LORA_CHUNK, LORA_LANES, MAX_LORA_RANK


@dataclass
class Target:
    """A base linear layer that adapters add to: per projection it holds, its (first row, rows)."""
    layer: int
    linear: torch.nn.Module
    slices: dict[str, tuple[int, int]]


def model_targets(model) -> list[Target]:
    """The adaptable linear layers of a llama.py model, in a fixed order."""
    cfg = model.config
    if cfg.num_experts:  # the experts' MLPs would need an adapter each: not built
        raise ValueError("LoRA adapters on a mixture-of-experts model are not supported")
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    targets = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        targets += [Target(i, attn.qkv_proj, {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}),
                    Target(i, attn.o_proj, {"o_proj": (0, attn.o_proj.out_features)}),
                    Target(i, mlp.gate_up_proj, {"gate_proj": (0, inter), "up_proj": (inter, inter)}),
                    Target(i, mlp.down_proj, {"down_proj": (0, mlp.down_proj.out_features)})]
    return targets


def target_layout(weights: AdapterWeights, target: Target, n_pad: int, device: torch.device,
                  dtype: torch.dtype) -> TargetWeights | None:
    """One target's weights: the projections' A^T side by side, B^T block-diagonal; rank padded to
    LORA_LANES and columns to n_pad with zeros, and per chunk of columns the band of B^T's rows
    that is not zero there (the kernel skips the rest)."""
    parts = [(weights.factors[(target.layer, p)], target.slices[p]) for p in PROJECTIONS
             if p in target.slices and (target.layer, p) in weights.factors]
    if not parts:
        return None
    total = sum(f.a.shape[0] for f, _ in parts)
    padded = -(-total // LORA_LANES) * LORA_LANES
    at = torch.zeros(target.linear.in_features, padded)
    bt = torch.zeros(padded, n_pad)
    bands = torch.zeros(n_pad // LORA_CHUNK, 2, dtype=torch.int64)
    col = 0
    for f, (row0, rows) in parts:
        r = f.a.shape[0]
        at[:, col:col + r] = f.a.T
        bt[col:col + r, row0:row0 + rows] = f.b.T
        chunks = bands[row0 // LORA_CHUNK:-(-(row0 + rows) // LORA_CHUNK)]
        chunks[:, 0] = torch.where(chunks[:, 1] > 0, chunks[:, 0], col)  # the first part in the chunk sets lo
        chunks[:, 1] = col + r
        col += r
    return TargetWeights(at.to(device, dtype), bt.to(device, dtype), bands)


class LoRAManager:
    def __init__(self, model, max_loras: int, max_cpu_loras: int | None, max_lora_rank: int) -> None:
        if max_lora_rank < 1 or max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {max_lora_rank}")
        max_cpu_loras = max_cpu_loras or max_loras
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.model, self.max_lora_rank, self.max_cpu_loras = model, max_lora_rank, max_cpu_loras
        self.targets = model_targets(model)
        weight = model.norm.weight
        self.device, self.dtype = weight.device, weight.dtype  # the factors are kept in the model's dtype
        if model.lora is None:  # engines sharing one model share its hooks (each step sets its rows)
            model.lora = LoRAContext(weight.device, weight.dtype)
            for index, target in enumerate(self.targets):
                target.linear.lora = LoRALinear(model.lora, index)
        self.registered: dict[str, LoRARequest] = {}
        self.loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()  # least recently used first

    def add(self, request: LoRARequest) -> LoadedAdapter:
        """Register `request` and load it (raises AdapterError naming what is wrong); a name already
        registered with another id or path is refused."""
        known = self.registered.get(request.lora_name)
        if known is not None and known != request:
            raise AdapterError(f"an adapter named {request.lora_name!r} is already loaded from {known.lora_path!r} "
                               f"(id {known.lora_int_id}); unload it first")
        adapter = self.get(request)
        self.registered[request.lora_name] = request
        return adapter

    def remove(self, name: str) -> bool:
        """Forget the adapter `name`; running requests keep what they hold. False if unknown."""
        self.loaded.pop(name, None)
        return self.registered.pop(name, None) is not None

    def list(self) -> list[LoRARequest]:
        return list(self.registered.values())

    def get(self, request: LoRARequest) -> LoadedAdapter:
        """The loaded adapter for `request`, read now if it is not held (evicting the least recently used)."""
        adapter = self.loaded.get(request.lora_name)
        if adapter is not None and adapter.request == request:
            self.loaded.move_to_end(request.lora_name)
            return adapter
        adapter = self._load(request)
        self.loaded[request.lora_name] = adapter
        self.loaded.move_to_end(request.lora_name)
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
        return adapter

    def _load(self, request: LoRARequest) -> LoadedAdapter:
        cfg = self.model.config
        weights = read_adapter(request.lora_path, cfg.num_attention_heads, cfg.num_key_value_heads)
        self._check(weights, request)
        per_target = [target_layout(weights, target, padded_columns(target.linear.out_features), self.device,
                                    self.dtype) for target in self.targets]
        addresses = torch.tensor([w.address() if w else [0, 0, 0, 0] for w in per_target], dtype=torch.int64)
        return LoadedAdapter(request, per_target, addresses, weights.fingerprint)

    def _check(self, weights: AdapterWeights, request: LoRARequest) -> None:
        where = f"adapter {request.lora_name!r} ({request.lora_path})"
        if weights.rank > self.max_lora_rank:
            raise AdapterError(f"{where}: rank {weights.rank} is above --max-lora-rank {self.max_lora_rank}")
        num_layers = len(self.model.layers)
        for (layer, projection), f in weights.factors.items():
            if layer >= num_layers:
                raise AdapterError(f"{where}: it adapts layer {layer}, a module the model lacks (it has "
                                   f"{num_layers} layers)")
            target = next(t for t in self.targets if t.layer == layer and projection in t.slices)
            rows = target.slices[projection][1]
            if f.a.shape[1] != target.linear.in_features or f.b.shape[0] != rows:
                raise AdapterError(f"{where}: layer {layer} {projection}: shape mismatch: lora_A {tuple(f.a.shape)}"
                                   f" and lora_B {tuple(f.b.shape)} do not fit the model's "
                                   f"[{rows}, {target.linear.in_features}] weight")
