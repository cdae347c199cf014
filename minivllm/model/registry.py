"""Model families: an architecture name -> how the family's checkpoints read into a ModelConfig.

A Hugging Face checkpoint names its architecture in config.json (`architectures[0]`), a GGUF file in
`general.architecture`. Each family is one `Family` entry: the names it goes by, the switches its
configs set (model_config.py) and the few conventions of its checkpoints, which the readers
(hf_reader.py, gguf_reader.py) consult; every family runs the one configurable decoder (decoder.py),
as vLLM's registry and mini-sglang's switches do. An architecture that is not here is refused at
load, naming it and the known ones.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minivllm.model.model_config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, ModelConfig

Switches = dict[str, Any]  # ModelConfig fields a family sets beyond the common ones
Metadata = Callable[..., Any]  # a GGUF file's "{arch}.KEY" values: meta(KEY, default)


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    gguf_architecture: str | None
    switches: Switches = field(default_factory=dict)  # fixed for the family, whatever the checkpoint
    hf_switches: Callable[[dict], Switches] = lambda cfg: {}  # read from config.json
    gguf_switches: Callable[[ModelConfig, Metadata], Switches] = lambda config, meta: {}  # read, or derived
    hf_norm_offset: float = 0.0  # Gemma computes x * (1 + w): its HF norm weights get the 1 at load
    gguf_permuted_qk: bool = False  # llama.cpp stores Q/K rows permuted for its interleaved RoPE
    gguf_tensor_names: dict[str, str] = field(default_factory=dict)  # beyond gguf_reader.GGUF_NAMES
    # HF tensor names as the decoder has them, where the family's checkpoints differ: (old, new)
    # substrings, replaced in order (Mixtral's block_sparse_moe.experts.E.w1 -> mlp.experts.E.gate_proj).
    hf_tensor_renames: tuple[tuple[str, str], ...] = ()
    # gpt-oss: stacked experts stored [experts, in, out], gate and up columns interleaved, with biases.
    hf_experts_transposed: bool = False


def rope_parameters(cfg: dict) -> dict:
    return cfg.get("rope_parameters") or {}


def _sliding(cfg: dict) -> Switches:
    """Mistral, Phi-3: a sliding window on every layer, if the config has one."""
    return {"sliding_window": cfg.get("sliding_window")}


def _sliding_if_used(cfg: dict) -> Switches:
    # Qwen2/3 configs carry a sliding_window they do not use unless use_sliding_window is set.
    return {"sliding_window": cfg.get("sliding_window") if cfg.get("use_sliding_window") else None}


def _layer_types_windows(cfg: dict) -> Switches:
    """Gemma 2/3: the layers whose `layer_types` entry is sliding_attention attend to the window."""
    types = cfg.get("layer_types") or []
    return {"sliding_window": cfg.get("sliding_window"),
            "sliding_layers": [i for i, t in enumerate(types) if t == "sliding_attention"]}


def _gemma_hf(cfg: dict) -> Switches:
    return {**_layer_types_windows(cfg), "query_scale": cfg["query_pre_attn_scalar"] ** -0.5,
            "attn_logit_softcap": cfg.get("attn_logit_softcapping"),
            "final_logit_softcap": cfg.get("final_logit_softcapping"),
            "embedding_scale": cfg["hidden_size"] ** 0.5}


def _gemma3_hf(cfg: dict) -> Switches:
    """Gemma 3's rope_parameters are per layer type: the global layers' base and scaling, the sliding
    layers' own base (v4 configs: rope_theta, rope_scaling and rope_local_base_freq at the top)."""
    rope = rope_parameters(cfg)
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    return {**_gemma_hf(cfg), "rope_theta": full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)),
            "rope_scaling": scaling, "local_rope_theta": local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))}


# llama.cpp's layer counts of the Gemma 27B models, the one size whose query_pre_attn_scalar is hidden / heads.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_gguf(config: ModelConfig, meta: Metadata, period: int) -> Switches:
    """What llama.cpp reads or assumes for Gemma 2 (`period` 2) and Gemma 3 (6). The sliding layers: the
    file's attention.sliding_window_pattern (a flag per layer, or the period), else all but the last of
    every `period` layers. The query scale: query_pre_attn_scalar ** -0.5, which the converter does not
    write; llama.cpp takes head_dim for it, and hidden / heads for the 27B models (known by their layer
    count), as their configs have it. The sliding layers' RoPE base: rope.freq_base_swa (Gemma 3: 10000
    if absent)."""
    big = config.num_hidden_layers == GEMMA_27B_LAYERS[config.architecture]
    return {**_sliding_layers_gguf(config, meta, period),
            "query_scale": (config.hidden_size // config.num_attention_heads if big else config.head_dim) ** -0.5,
            "local_rope_theta": meta("rope.freq_base_swa", 10_000.0 if period == 6 else None),
            "embedding_scale": config.hidden_size ** 0.5}


def _sliding_layers_gguf(config: ModelConfig, meta: Metadata, period: int) -> Switches:
    """The sliding layers as llama.cpp reads them: the file's attention.sliding_window_pattern (a flag per
    layer, or the period), else all but the last of every `period` layers."""
    pattern = meta("attention.sliding_window_pattern", period)
    flags = pattern if isinstance(pattern, list) else [
        pattern == 0 or i % pattern < pattern - 1 for i in range(config.num_hidden_layers)]
    return {"sliding_layers": [i for i, sliding in enumerate(flags) if sliding]}


def _gemma2_gguf(config: ModelConfig, meta: Metadata) -> Switches:
    return _gemma_gguf(config, meta, period=2)


def _gemma3_gguf(config: ModelConfig, meta: Metadata) -> Switches:
    return _gemma_gguf(config, meta, period=6)


def _phi3_hf(cfg: dict) -> Switches:
    """Partial rotary, and longrope's short/long factors with its attention factor (computed as
    transformers does when the config leaves it out)."""
    rope = {**(cfg.get("rope_scaling") or {}), **rope_parameters(cfg)}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    switches: Switches = {**_sliding(cfg), "rotary_dim": int(head_dim * partial)}
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        factor = rope.get("factor") or cfg["max_position_embeddings"] / original
        attention = rope.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
        switches["rope_scaling"] = {"rope_type": "longrope", "short_factor": rope["short_factor"],
                                    "long_factor": rope["long_factor"], "attention_factor": attention,
                                    "original_max_position_embeddings": original}
    return switches


def _smollm3_hf(cfg: dict) -> Switches:
    flags = cfg.get("no_rope_layers")  # 1: the layer uses RoPE
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(cfg["num_hidden_layers"])]
    return {"nope_layers": [i for i, uses_rope in enumerate(flags) if not uses_rope], **_sliding_if_used(cfg)}


def _smollm3_gguf(config: ModelConfig, meta: Metadata) -> Switches:
    # llama.cpp: no RoPE on every 4th layer (fixed in its code; the converter writes no key for it).
    return {"nope_layers": [i for i in range(config.num_hidden_layers) if (i + 1) % 4 == 0]}


def _granite_hf(cfg: dict) -> Switches:
    return {"query_scale": cfg.get("attention_multiplier"), "embedding_scale": cfg.get("embedding_multiplier", 1.0),
            "residual_scale": cfg.get("residual_multiplier", 1.0), "logits_divisor": cfg.get("logits_scaling", 1.0),
            "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]}


def _moe_hf(cfg: dict) -> Switches:
    """A mixture of experts' config.json: the experts, their width, how many a token uses, and which
    layers keep a dense MLP (Qwen's mlp_only_layers and decoder_sparse_step)."""
    only, step = set(cfg.get("mlp_only_layers") or []), cfg.get("decoder_sparse_step") or 1
    return {"num_experts": cfg.get("num_experts") or cfg.get("num_local_experts"),
            "num_experts_per_tok": cfg["num_experts_per_tok"], "moe_intermediate_size": cfg.get("moe_intermediate_size"),
            "dense_layers": [i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step],
            "norm_topk_prob": cfg.get("norm_topk_prob"), "shared_expert_size": cfg.get("shared_expert_intermediate_size")}


def _norm_topk_gguf(default: bool) -> Callable[[ModelConfig, Metadata], Switches]:
    """llama.cpp's renormalization of the top-k weights for an architecture: the file's
    expert_weights_norm, which converters seldom write, else what llama.cpp hard-codes for it."""
    return lambda config, meta: {"norm_topk_prob": meta("expert_weights_norm", default)} if config.num_experts else {}


def _gpt_oss_hf(cfg: dict) -> Switches:
    """gpt-oss: biases on all four attention projections, sinks, alternating sliding and full layers, and
    a router with a bias over experts with biases and the clamped SwiGLU, whose constants minivllm's
    kernels fix as llama.cpp does."""
    alpha, limit = cfg.get("swiglu_alpha", SWIGLU_OAI_ALPHA), cfg.get("swiglu_limit", SWIGLU_OAI_LIMIT)
    if (alpha, limit) != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
        raise ValueError(f"swiglu_alpha {alpha} and swiglu_limit {limit}: minivllm runs gpt-oss's clamped SwiGLU "
                         f"with alpha {SWIGLU_OAI_ALPHA} and limit {SWIGLU_OAI_LIMIT} only")
    bias = cfg.get("attention_bias", True)
    return {**_layer_types_windows(cfg), **_moe_hf(cfg), "moe_intermediate_size": cfg["intermediate_size"],
            "attention_bias": bias, "attention_out_bias": bias}


_GPT_OSS = {"attention_sinks": True, "expert_bias": True, "routing": "topk_softmax", "hidden_act": "swiglu_oai"}

_GEMMA = {"hidden_act": "gelu_tanh", "sandwich_norms": True}
_GEMMA_TENSORS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}

_MIXTRAL_TENSORS = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                    (".w2.", ".down_proj."))
# Granite-MoE stores its experts fused ([experts, 2 * width, hidden] and [experts, hidden, width]), which
# hf_reader.py splits per expert.
_GRANITE_MOE_TENSORS = (("block_sparse_moe.router.layer.", "mlp.gate."),
                        ("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj"),
                        ("block_sparse_moe.output_linear.weight", "mlp.experts.down_proj"))

FAMILIES = [
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), "llama", hf_switches=_sliding,
           gguf_switches=_norm_topk_gguf(True), gguf_permuted_qk=True),  # llama.cpp writes Mixtral as llama
    Family("qwen2", ("Qwen2ForCausalLM",), "qwen2",
           hf_switches=lambda cfg: {"attention_bias": cfg.get("attention_bias", True), **_sliding_if_used(cfg)}),
    Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", {"qk_norm": True}, hf_switches=_sliding_if_used),
    Family("gemma2", ("Gemma2ForCausalLM",), "gemma2", _GEMMA, _gemma_hf, _gemma2_gguf, hf_norm_offset=1.0,
           gguf_tensor_names=_GEMMA_TENSORS),
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), "gemma3", {**_GEMMA, "qk_norm": True},
           _gemma3_hf, _gemma3_gguf, hf_norm_offset=1.0, gguf_tensor_names=_GEMMA_TENSORS),
    Family("phi3", ("Phi3ForCausalLM",), "phi3", hf_switches=_phi3_hf,
           gguf_tensor_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    Family("smollm3", ("SmolLM3ForCausalLM",), "smollm3", hf_switches=_smollm3_hf, gguf_switches=_smollm3_gguf,
           gguf_permuted_qk=True),
    Family("granite", ("GraniteForCausalLM",), "granite", hf_switches=_granite_hf, gguf_permuted_qk=True),
    # Mixtures of experts.
    Family("mixtral", ("MixtralForCausalLM",), None, {"norm_topk_prob": True},
           hf_switches=lambda cfg: {**_sliding(cfg), **_moe_hf(cfg)}, hf_tensor_renames=_MIXTRAL_TENSORS),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), "qwen2moe", gguf_switches=_norm_topk_gguf(False),
           hf_switches=lambda cfg: {"attention_bias": cfg.get("qkv_bias", True), **_sliding_if_used(cfg), **_moe_hf(cfg)}),
    # llama.cpp always renormalizes Qwen3-MoE's top-k weights (its released models set norm_topk_prob).
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3moe", {"qk_norm": True}, gguf_switches=_norm_topk_gguf(True),
           hf_switches=lambda cfg: {**_sliding_if_used(cfg), **_moe_hf(cfg)}),
    Family("olmoe", ("OlmoeForCausalLM",), "olmoe", {"qk_norm": True, "qk_norm_span": "projection"},
           hf_switches=lambda cfg: {**_moe_hf(cfg), "clip_qkv": cfg.get("clip_qkv")},
           gguf_switches=_norm_topk_gguf(False)),
    Family("granite_moe", ("GraniteMoeForCausalLM",), "granitemoe", {"routing": "topk_softmax"},
           hf_switches=lambda cfg: {**_granite_hf(cfg), **_moe_hf(cfg)}, gguf_permuted_qk=True,
           hf_tensor_renames=_GRANITE_MOE_TENSORS),
    # llama.cpp: even layers sliding; its YaRN truncates the ramp's ends (transformers' gpt-oss config does not).
    Family("gpt_oss", ("GptOssForCausalLM",), "gpt-oss", _GPT_OSS, hf_switches=_gpt_oss_hf,
           gguf_switches=lambda config, meta: {**_sliding_layers_gguf(config, meta, 2),
                                               "rope_scaling": {**config.rope_scaling, "truncate": True}},
           gguf_tensor_names={"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm"},
           hf_tensor_renames=((".mlp.router.", ".mlp.gate."),), hf_experts_transposed=True),
]
_BY_HF = {arch: f for f in FAMILIES for arch in f.hf_architectures}
_BY_GGUF = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture}
_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    """The family a ModelConfig's `architecture` names."""
    return _BY_NAME[name]


def hf_family(architectures: list[str], where: str) -> Family:
    found = next((_BY_HF[a] for a in architectures if a in _BY_HF), None)
    if found is None:
        raise ValueError(f"unsupported architecture {architectures} in {where}; minivllm runs "
                         f"{', '.join(_BY_HF)}")
    return found


def gguf_family(architecture: str, where: str) -> Family:
    if architecture not in _BY_GGUF:
        raise ValueError(f"unsupported GGUF architecture {architecture!r} in {where}; minivllm runs "
                         f"{', '.join(_BY_GGUF)}")
    return _BY_GGUF[architecture]
