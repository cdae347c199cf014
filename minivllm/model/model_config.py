"""What the decoder needs to know about a checkpoint: its shapes and the switches of its family.

One `ModelConfig` describes every family the registry knows (registry.py): a Llama is the config with
every switch at its default; Gemma, Phi, Granite... set the few they change. The decoder
(decoder.py), the native layer loop (native_forward.py) and the readers read only this.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ROPE_GLOBAL, ROPE_LOCAL, NO_ROPE = 0, 1, -1  # a layer's rotary table (csrc/forward.c reads the same numbers)
# The MLP's gate activation; its index is csrc/forward.c's `act`. "swiglu_oai": gpt-oss's clamped SwiGLU,
# (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g) with g = min(gate, 7), its constants fixed as llama.cpp fixes them.
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
# How a mixture-of-experts router turns its logits into the top-k experts' weights (moe.py):
# "softmax": softmax over all experts, then the top k (renormalized with norm_topk_prob);
# "topk_softmax": the top k logits, then softmax over those k (Granite-MoE, gpt-oss).
ROUTINGS = ("softmax", "topk_softmax")


@dataclass
class ModelConfig:
    architecture: str  # the registry's family name (registry.FAMILIES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None  # llama3, linear, longrope, or a GGUF's per-frequency factors
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    attention_out_bias: bool = False  # gpt-oss: o_proj's too
    attention_sinks: bool = False  # gpt-oss: a learned logit per head that joins only the softmax's denominator
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm per head on q and k before RoPE
    qk_norm_span: str = "head"  # "projection": OLMoE's norm over the whole q (k) projection, before the heads split
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to +-clip_qkv
    # Sliding-window attention: each token attends to the last `sliding_window` tokens (itself included),
    # on the layers listed in `sliding_layers` (None: every layer, as Mistral v0.1).
    sliding_window: int | None = None
    sliding_layers: list[int] | None = None
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base (default scaling)
    nope_layers: list[int] = field(default_factory=list)  # SmolLM3: layers without RoPE
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini): the first this many of each head; None: all
    hidden_act: str = "silu"  # one of ACTIVATIONS
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP too (four per layer)
    query_scale: float | None = None  # the attention's score scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    embedding_scale: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: each block's output times this before the residual add
    logits_divisor: float = 1.0  # Granite: logits_scaling
    # Mixture of experts: a sparse layer's MLP is a router over `num_experts` experts (each an MLP of
    # width `moe_intermediate_size`), of which each token runs the `num_experts_per_tok` it is routed to.
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # None: intermediate_size
    dense_layers: list[int] = field(default_factory=list)  # layers that keep the dense MLP (Qwen's mlp_only_layers)
    routing: str = "softmax"  # one of ROUTINGS
    norm_topk_prob: bool = False  # "softmax" routing: divide the k weights by their sum
    shared_expert_size: int | None = None  # Qwen2-MoE: a dense expert for every token, gated by sigmoid(x . g)
    expert_bias: bool = False  # gpt-oss: the router and each expert's projections have biases
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok is {self.num_experts_per_tok}: a token must use between 1 and "
                             f"num_experts ({self.num_experts}) experts")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown expert routing {self.routing!r}; minivllm routes by {', '.join(ROUTINGS)}")

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    def long_rope(self, num_prompt_tokens: int) -> bool:
        """Phi-3's longrope: whether a request takes the long factors at every position. transformers picks
        the short or the long factors for a whole forward by the length of its sequence, so a prompt longer
        than original_max_position_embeddings is prefilled (and decoded) with the long ones. A shorter one
        has the short ones; when it grows past that length, transformers recomputes its whole cache with
        the long ones, where minivllm keeps the K/V computed and takes the long factors from there on
        (decoder.Rotary)."""
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type") == "longrope" and num_prompt_tokens > scaling["original_max_position_embeddings"]

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it attends to its whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> int:
        """Which rotary table layer `layer` uses: ROPE_GLOBAL, ROPE_LOCAL (Gemma 3's sliding layers) or NO_ROPE."""
        if layer in self.nope_layers:
            return NO_ROPE
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return ROPE_LOCAL
        return ROPE_GLOBAL
