"""The one way a model is built from a checkpoint, by the engine and by every tensor-parallel rank.

A checkpoint (HF directory or GGUF file, loader.py) becomes the registry's model (registry.py, all
families: decoder.CausalLM), its quantized weights packed once and cached on disk (weight_cache.py):
later starts, and every rank of a tensor-parallel group after its first start, map the packed weights
instead of packing them again.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from minivllm.model import weight_cache
from minivllm.model.decoder import CausalLM
from minivllm.model.loader import load_checkpoint
from minivllm.model.model_config import ModelConfig


class Shard(Protocol):
    """One rank's part of the model (distributed/sharding.py's TensorParallelShard)."""

    key: str  # names the shard in the weight cache

    def config(self, full: ModelConfig) -> ModelConfig: ...

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]], full: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]: ...


@functools.lru_cache(maxsize=2)
def load_model(path: Path, device: torch.device, dtype: torch.dtype, quantization: str = "none",
               shard: Shard | None = None) -> tuple[ModelConfig, CausalLM]:
    """The whole model's config and the model (of `shard` only, when given; its config is the shard's).
    Engines in one process (a benchmark comparing schedulers, a test suite) share read-only weights: the
    KV cache and all state are per engine. Quantized weights, once packed, are cached on disk and mapped
    at later starts (weight_cache.py)."""
    cached = weight_cache.cache_file(path, device, dtype, quantization, shard.key if shard else "")
    hit = weight_cache.load(cached) if cached is not None else None
    if hit is not None:
        full, state = hit
        try:
            return full, CausalLM.from_state(shard.config(full) if shard else full, state, device)
        except (ValueError, KeyError, AttributeError, RuntimeError) as e:  # an entry this code cannot use
            print(f"minivllm: the cached weights in {cached} do not fit this model ({e}); rebuilding",
                  file=sys.stderr, flush=True)
    if cached is not None:
        print(f"minivllm: packing the weights once into {cached.parent} ...", file=sys.stderr, flush=True)
    # Decoded straight into the model's dtype, or kept quantized.
    full, weights = load_checkpoint(path, dtype, keep_quantized=quantization == "gguf")
    if shard is not None:
        model = CausalLM.from_weights(shard.config(full), shard.weights(weights, full), device, dtype, quantization)
    else:
        model = CausalLM.from_weights(full, weights, device, dtype, quantization)
    if cached is not None:
        weight_cache.save(cached, full, model.state())
    return full, model
