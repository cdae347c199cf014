"""A checkpoint's weights into the decoder (decoder.py), which holds the forward only.

The model is built without initializing it (on the meta device), then takes the checkpoint's tensors
as its parameters: no random init, no second copy of the weights. Tensors come named as in Hugging
Face's Llama checkpoints (the readers make every format look so); q/k/v and gate/up are fused here
into one matrix each: fewer, larger GEMMs.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.model.decoder import CausalLM, Embedding, Linear
from minivllm.model.model_config import ModelConfig
from minivllm.model.quant import QuantizedTensor, QuantizedWeight, fuse_rows, quantize

State = dict[str, torch.Tensor | QuantizedWeight]
Checkpointed = torch.Tensor | QuantizedTensor | list[QuantizedTensor]  # a weight as the readers give it

_FUSED_ORDER = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_PARTS = {part: target for target, ps in _FUSED_ORDER.items() for part in ps}


def model_from_weights(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                       dtype: torch.dtype, quantization: str = "none") -> CausalLM:
    """The model holding `weights`. `quantization` (EngineConfig.weight_quantization): "gguf" keeps the
    file's quantized blocks as they come, "int8"/"int4" quantize the float weights, "none" dequantizes
    whatever comes quantized."""
    with torch.device("meta"):
        model = CausalLM(config)
    _assign(model, weights, dtype, quantization)
    return _placed(model, device)


def model_from_state(config: ModelConfig, state: State, device: torch.device) -> CausalLM:
    """The model from what `model_state` returned for it (weight_cache.py): nothing converted."""
    with torch.device("meta"):
        model = CausalLM(config)
    for name, value in state.items():
        _hold(model, name, value)
    _tie_embeddings(model)
    _check_complete(model)
    return _placed(model, device)


def model_state(model: CausalLM) -> State:
    """Every parameter and quantized weight the model holds once built, by name; a tied LM head is
    left out (`_tie_embeddings` restores it)."""
    state: State = dict(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, (Linear, Embedding)) and module.quantized is not None:
            state[f"{name}.weight"] = module.quantized
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _placed(model: CausalLM, device: torch.device) -> CausalLM:
    model = model.to(device).eval()
    for weight in model.quantized_weights():
        weight.to(device)
    model.use_native_kernels(True)
    return model


def _assign(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
            quantization: str) -> None:
    """Load tensors named as in Hugging Face checkpoints, fusing q/k/v and gate/up."""
    expected = dict(model.named_parameters())
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        name = name.removeprefix("model.")
        for part, target in _FUSED_PARTS.items():
            if f".{part}." in name:
                parts.setdefault(name.replace(part, target), {})[part] = tensor
                break
        else:
            if name in expected and not (name == "lm_head.weight" and model.config.tie_word_embeddings):
                _set(model, name, tensor, expected, dtype, quantization)
    for name, pieces in parts.items():
        target = next(t for t in _FUSED_ORDER if f".{t}." in name)
        missing = [p for p in _FUSED_ORDER[target] if p not in pieces]
        if missing:
            raise ValueError(f"checkpoint lacks {missing} for {name}")
        _set(model, name, fuse_rows([pieces[p] for p in _FUSED_ORDER[target]]), expected, dtype, quantization)
    _tie_embeddings(model)
    _check_complete(model)


def _check_complete(model: CausalLM) -> None:
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"checkpoint lacks weights: {still_meta[:5]}")


def _tie_embeddings(model: CausalLM) -> None:
    if model.config.tie_word_embeddings:
        if model.embed_tokens.quantized is not None:
            model.lm_head.set_quantized(model.embed_tokens.quantized)
        else:
            model.lm_head.weight = model.embed_tokens.weight


def _set(model: CausalLM, name: str, tensor: Checkpointed, expected: dict[str, torch.Tensor], dtype: torch.dtype,
         quantization: str) -> None:
    shape = _shape(tensor)
    if tuple(expected[name].shape) != shape:
        raise ValueError(f"weight {name}: checkpoint shape {shape} != model {tuple(expected[name].shape)}")
    module = model.get_submodule(name.rpartition(".")[0])
    if isinstance(module, (Linear, Embedding)) and name.endswith(".weight") and quantization != "none":
        if quantization in ("int8", "int4"):
            # The embedding / LM head stays int8 under int4: the logits are where 4 bits cost most.
            scheme = "int8" if isinstance(module, Embedding) or name == "lm_head.weight" else quantization
            tensor = quantize(_float(tensor), scheme)
        if isinstance(tensor, (QuantizedTensor, list)):
            _hold(model, name, QuantizedWeight.of(tensor))
            return
    _hold(model, name, _float(tensor).to(dtype))


def _hold(model: CausalLM, name: str, value: torch.Tensor | QuantizedWeight) -> None:
    """Make `value` the weight `name`: a parameter, or its module's quantized weight."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(value, QuantizedWeight):
        module.set_quantized(value)
    else:
        setattr(module, attr, nn.Parameter(value, requires_grad=False))


def _float(tensor: Checkpointed) -> torch.Tensor:
    if isinstance(tensor, list):  # a fused weight in segments of different formats
        return torch.cat([t.dequantize() for t in tensor])
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor


def _shape(tensor: Checkpointed) -> tuple[int, ...]:
    if isinstance(tensor, list):
        return (sum(t.shape[0] for t in tensor), tensor[0].shape[1])
    return tuple(tensor.shape)
