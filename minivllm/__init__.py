"""minivllm: a compact LLM inference engine with continuous batching and a paged KV cache."""
from importlib import import_module

__version__ = "0.1.0"

# Imported on first use, so that the scheduler (and its tests) can be used without loading torch.
_EXPORTS = {
    "LLM": "minivllm.llm", "LLMEngine": "minivllm.engine.llm_engine", "EngineConfig": "minivllm.config",
    "SamplingParams": "minivllm.sampling_params", "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs", "RequestMetrics": "minivllm.outputs",
    "LoRARequest": "minivllm.lora.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
