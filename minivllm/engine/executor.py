"""What an engine computes with, built from its config: the model (shared read-only between the
engines of one process), the KV pool, the sampler, and (tensor-parallel) the workers.

The engine (llm_engine.py) and the tensor-parallel workers (distributed/worker.py) both build on this
module, so neither imports the other.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm.config import EngineConfig, parse_size
from minivllm.kv_tier.store import KVTier, make_kv_tier
from minivllm.model.kernels import layer_ops
from minivllm.model.kernels import report as kernels_report
from minivllm.model.loader import resolve_model_path
from minivllm.model.loading import load_model
from minivllm.model.model_config import ModelConfig
from minivllm.model.runner import ModelRunner, kv_bytes_per_block
from minivllm.model.sampler import Sampler
from minivllm.model.tokenizer import Tokenizer, get_tokenizer
from minivllm.startup import timed


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    return config.num_kv_blocks or max(
        1, parse_size(config.kv_cache_memory) // kv_bytes_per_block(model_config, config.block_size, dtype,
                                                                    config.kv_cache_dtype))


@dataclass
class ModelParts:
    """What the engine computes with: `runner.execute(BatchInputs)` returns what `sampler(that, its
    SamplingRows)` turns into a SamplerOutput (model/batch.py: engine/model_inputs.py builds both).
    Without a tokenizer, prompts are token ids and outputs carry no text."""

    model_config: ModelConfig
    tokenizer: Tokenizer | None
    runner: Any
    sampler: Any
    num_blocks: int
    startup_time: dict[str, float] = field(default_factory=dict)  # seconds per phase of loading them
    release: Callable[[], None] | None = None  # what close() must stop (tensor-parallel workers)
    kv_tier: KVTier | None = None  # where evicted prefix blocks go (--kv-offloading-*)


def load_parts(config: EngineConfig) -> ModelParts:
    """The real model: weights loaded, KV cache allocated, and the seconds each phase took."""
    device, dtype = config.torch_device, config.torch_dtype
    path = resolve_model_path(config.model)
    phases: dict[str, float] = {}
    quantization = config.weight_quantization(path.is_file())
    with timed(phases, "kernels"):  # compiled on a cold cache, else loaded
        layer_ops(device, dtype)
    print(kernels_report(device, dtype), file=sys.stderr, flush=True)  # the target, and what runs as torch
    group = None
    with timed(phases, "weights"):
        if config.tensor_parallel_size > 1:  # rank 0: its shard; the workers start and load theirs
            from minivllm.distributed.worker import start_tensor_parallel

            model_config, model, group = start_tensor_parallel(config, path)
        else:
            model_config, model = load_model(path, device, dtype, quantization)
    with timed(phases, "tokenizer"):
        tokenizer = get_tokenizer(path, model_config)
    num_blocks = num_kv_blocks(config, model.config, dtype)  # the rank's shard of the KV heads
    with timed(phases, "kv_pool"):
        if group is None:
            runner = ModelRunner(model, num_blocks, config.block_size, device, dtype, config.kv_cache_dtype)
        else:
            from minivllm.distributed.worker import DriverRunner

            runner = DriverRunner(group, model, num_blocks, config.block_size, device, dtype, config.kv_cache_dtype)
    loop = model.layer_loop() if runner.attention_kernel is not None else \
        f"Python layer loop: no native attention kernel for head_dim {model_config.head_dim} on {device.type}/{dtype}"
    print(f"minivllm: {model_config.architecture}: {loop}", file=sys.stderr, flush=True)
    kv_tier = None
    if config.kv_offloading:
        with timed(phases, "kv_tier"):  # indexes its directory, if any
            kv_tier = make_kv_tier(config, path, quantization, runner)
    return ModelParts(model_config, tokenizer, runner, Sampler(device, config.seed), num_blocks, phases,
                      release=runner.close if group is not None else None, kv_tier=kv_tier)
