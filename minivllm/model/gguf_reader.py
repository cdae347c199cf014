"""A GGUF file -> its `ModelConfig` and its weights, through the family's registry entry (registry.py):
`general.architecture` names the entry; its switches, metadata readers and tensor names complete the
common fields, and its weights come under Hugging Face's names (llama.cpp's permuted Q/K rows put
back), quantized blocks kept as they are where asked.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from minivllm.model.gguf_file import GGUFFile, GGUFTensorInfo
from minivllm.model.gguf_quants import BLOCK_FORMATS, FLOAT_TYPES, dequantize, format_name, supported_types
from minivllm.model.model_config import ModelConfig
from minivllm.model.quant import QuantizedTensor
from minivllm.model.registry import Family, gguf_family

GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, the experts (one 3-D tensor each, split per expert as read) and
    # Qwen2-MoE's shared expert with its gate.
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# llama.cpp's expert_gating_func values minivllm routes by (model_config.ROUTINGS); 2 is sigmoid.
GATING_FUNCS = {1: "softmax", 3: "topk_softmax"}


def read_gguf_checkpoint(path: Path, dtype: torch.dtype | None, keep_quantized: bool
                         ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | QuantizedTensor]]]:
    """The file's config and its weights under HF names, read lazily (loader.load_checkpoint)."""
    f = GGUFFile(path)
    fam = gguf_family(f.get("general.architecture"), str(path))

    def meta(key: str, default=None):
        return f.get(f"{fam.gguf_architecture}.{key}", default)

    heads = meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    hidden = meta("embedding_length")
    head_dim = meta("attention.key_length") or hidden // heads
    tensors = {t.name: t for t in f.tensors}
    vocab = meta("vocab_size") or f.array_length("tokenizer.ggml.tokens")
    eos = f.get("tokenizer.ggml.eos_token_id")
    fields = dict(
        architecture=fam.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0),
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=_gguf_rope_scaling(f, meta, tensors),
        attention_bias="blk.0.attn_q.bias" in tensors,
        attention_out_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=meta("attention.sliding_window") or None,  # Phi-3 writes 0 for none
        rotary_dim=meta("rope.dimension_count") if meta("rope.dimension_count", head_dim) < head_dim else None,
        query_scale=meta("attention.scale"),
        attn_logit_softcap=meta("attn_logit_softcapping"),
        final_logit_softcap=meta("final_logit_softcapping"),
        embedding_scale=meta("embedding_scale", 1.0),
        residual_scale=meta("residual_scale", 1.0),
        logits_divisor=meta("logit_scale", 1.0),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
    )
    fields.update(_moe_fields(meta, tensors, fields["num_hidden_layers"], str(path)))
    config = ModelConfig(**{**fields, **fam.switches})
    config = dataclasses.replace(config, **fam.gguf_switches(config, meta))  # checked again (__post_init__)
    return config, _gguf_weights(f, config, fam, dtype or torch.float32, keep_quantized)


def _moe_fields(meta, tensors: dict[str, GGUFTensorInfo], layers: int, where: str) -> dict:
    """A mixture of experts' keys; the layers without a router keep a dense MLP."""
    experts = meta("expert_count", 0)
    if not experts:
        return {}
    gating = meta("expert_gating_func")
    if gating is not None and gating not in GATING_FUNCS:
        raise ValueError(f"{where}: expert_gating_func {gating} is not a routing minivllm runs "
                         f"(known: {', '.join(f'{k} ({v})' for k, v in GATING_FUNCS.items())})")
    switches = {"num_experts": experts, "num_experts_per_tok": meta("expert_used_count", 0),
                "moe_intermediate_size": meta("expert_feed_forward_length"),
                "shared_expert_size": meta("expert_shared_feed_forward_length"),
                "dense_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]}
    if gating is not None:
        switches["routing"] = GATING_FUNCS[gating]
    return switches


def _gguf_rope_scaling(f: GGUFFile, meta, tensors: dict[str, GGUFTensorInfo]) -> dict | None:
    if meta("rope.scaling.type") == "linear":
        return {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    if meta("rope.scaling.type") == "yarn":
        return {"rope_type": "yarn", "factor": meta("rope.scaling.factor"),
                "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
                "beta_fast": meta("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": meta("rope.scaling.yarn_beta_slow", 1.0),
                "attention_factor": meta("rope.scaling.yarn_attn_factor")}
    # llama.cpp writes Llama 3's RoPE scaling as a tensor of per-frequency divisors, not as metadata,
    # and longrope's (Phi-3) as two such tensors, with its attention factor as metadata.
    if "rope_freqs.weight" in tensors:
        factors = gguf_tensor(f, tensors["rope_freqs.weight"], torch.float32)
        return {"rope_type": "freq_factors", "factors": factors.reshape(-1).tolist()}
    if "rope_factors_long.weight" in tensors:
        short, long = (gguf_tensor(f, tensors[f"rope_factors_{kind}.weight"], torch.float32).reshape(-1).tolist()
                       for kind in ("short", "long"))
        return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                "attention_factor": meta("rope.scaling.attn_factor", 1.0),
                "original_max_position_embeddings": meta("rope.scaling.original_context_length")}
    return None


def _gguf_weights(f: GGUFFile, config: ModelConfig, fam: Family, dtype: torch.dtype, keep_quantized: bool
                  ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    names = {**GGUF_NAMES, **fam.gguf_tensor_names}
    for t in f.tensors:
        base, _, suffix = t.name.rpartition(".")  # suffix: weight | bias
        parts = base.split(".")
        if parts[0] == "blk":
            # gpt-oss's sinks: the converter appends .weight to a name that has none
            hf = f"model.layers.{parts[1]}.{names[parts[2]]}" + ("" if parts[2] == "attn_sinks" else f".{suffix}")
        elif base in names:
            hf = f"{names[base]}.{suffix}"
        else:
            continue  # e.g. rope_freqs: read into the config's rope_scaling
        if t.type not in BLOCK_FORMATS and t.type not in FLOAT_TYPES:
            raise ValueError(f"{f.path}: tensor {t.name} is {format_name(t.type)}, a block format minivllm does "
                             f"not run; supported: {supported_types()}")
        if parts[0] == "blk" and parts[2].endswith("_exps"):
            yield from _per_expert(f, t, hf, dtype, keep_quantized)
            continue
        if keep_quantized and t.type in BLOCK_FORMATS and len(t.shape) == 2:
            tensor = QuantizedTensor(f.raw(t).view(t.shape[0], -1), t.type)
        else:
            tensor = gguf_tensor(f, t, dtype)
            if parts[-1] == "ffn_gate_inp_shexp":  # stored as a vector: the [1, hidden] matrix it is
                tensor = tensor.reshape(1, -1)
        # llama.cpp stores Llama's Q and K rows permuted for its interleaved RoPE; undo it.
        if fam.gguf_permuted_qk and parts[-1] in ("attn_q", "attn_k"):
            n = config.num_attention_heads if parts[-1] == "attn_q" else config.num_key_value_heads
            unpermute = functools.partial(unpermute_rows, num_heads=n)
            if isinstance(tensor, QuantizedTensor):  # the same permutation of the rows' blocks
                tensor = QuantizedTensor(unpermute(tensor.blocks), tensor.qtype)
            else:
                tensor = unpermute(tensor)
        yield hf, tensor


def _per_expert(f: GGUFFile, t: GGUFTensorInfo, hf: str, dtype: torch.dtype, keep_quantized: bool
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """A 3-D expert tensor [experts, out, in] as one `experts.E.<proj>.weight` per expert, each in place
    in the file (a view of its blocks, or decoded from them); gpt-oss's biases [experts, out] as one
    `experts.E.<proj>.bias` each."""
    stem, _, suffix = hf.rpartition(".")
    head, proj = stem.rsplit(".", 1)
    if suffix == "bias" and len(t.shape) == 2:
        for expert, bias in enumerate(gguf_tensor(f, t, dtype).unbind(0)):
            yield f"{head}.{expert}.{proj}.bias", bias
        return
    if len(t.shape) != 3:
        raise ValueError(f"{f.path}: expert tensor {t.name} has shape {tuple(t.shape)}; expected [experts, out, in]")
    experts, rows, cols = t.shape
    raw = f.raw(t).view(experts, -1)
    for expert in range(experts):
        if keep_quantized and t.type in BLOCK_FORMATS:
            tensor = QuantizedTensor(raw[expert].view(rows, -1), t.type)
        else:
            tensor = dequantize(raw[expert], t.type, (rows, cols), dtype)
        yield f"{head}.{expert}.{proj}.weight", tensor


def gguf_tensor(f: GGUFFile, t: GGUFTensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """The file's bytes in place when they already are a `dtype` tensor, else decoded from them."""
    return dequantize(f.raw(t), t.type, t.shape, dtype)


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
