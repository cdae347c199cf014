"""minivllm: a compact LLM inference engine with continuous batching and a paged KV cache."""
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.llm import LLM
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics"]
__version__ = "0.1.0"
