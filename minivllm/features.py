"""Which features an engine has, from its config: the admission gates and step extensions (engine/seams.py)
that LLMEngine composes at construction. The one place that names them all; the loop and the
scheduler name none.

    LoRA adapters          gate (at most --max-loras running) + extension (lora_request=, add_lora)
    structured outputs     gate (grammar compiled) + extension (start, mask, advance the grammar)
    speculative decoding   extension (verify the drafts, propose the next ones)
    KV tier                extension (the block manager's block store, persist at close)

Each is present whatever the config (off, it only refuses its options or reports zero counters), so
that an engine's stats have the same keys whatever it serves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.seams import AdmissionGate, StepExtension
from minivllm.kv_tier.extension import KVTierExtension
from minivllm.lora.extension import LoRAAdapters
from minivllm.spec_decode.extension import SpeculativeDecoding
from minivllm.structured_output.extension import StructuredOutputs


@dataclass
class Features:
    gates: list[AdmissionGate] = field(default_factory=list)
    extensions: list[StepExtension] = field(default_factory=list)


def build_features(engine: Any, parts: Any) -> Features:
    """The features of `engine` (the LLMEngine being built: config, scheduler and block manager made)
    over its `parts` (executor.ModelParts). In the order their hooks run: the adapter is resolved before
    the grammar compiles."""
    config = engine.config
    lora = LoRAAdapters(config, engine.runner)
    grammars = StructuredOutputs(engine.tokenizer, engine.model_config.vocab_size, engine.abort_request)
    speculation = SpeculativeDecoding(config.speculative, engine.scheduler, engine.max_model_len, engine.clock,
                                      engine.stats, bool(getattr(engine.runner, "batch_invariant", False)))
    tier = KVTierExtension(engine.block_manager, parts.kv_tier)
    return Features(gates=[grammars, lora], extensions=[lora, grammars, speculation, tier])
