"""The executor: what runs the model for the engine, built from its config. One process's runner
over the whole model, or rank 0's runner driving a tensor-parallel group (distributed/worker.py);
the same model build (model/build.py) makes either. Beside it: the tokenizer, the sampler, and the
KV tier where evicted prefix blocks go.

The engine (engine/llm_engine.py) is handed these `ModelParts`; the simulator (bench/simulate.py)
hands it a cost model instead.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minivllm.config import EngineConfig
from minivllm.distributed.worker import start_tensor_parallel
from minivllm.kv_tier.store import KVTier, make_kv_tier
from minivllm.model.build import build_runner
from minivllm.model.kernels import layer_ops
from minivllm.model.kernels import report as kernels_report
from minivllm.model.loader import holds_blocks, resolve_model_path
from minivllm.model.model_config import ModelConfig
from minivllm.model.sampler import Sampler
from minivllm.model.tokenizer import Tokenizer, get_tokenizer
from minivllm.startup import timed


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
    """The real model: kernels ready, weights loaded, KV pool allocated, and the seconds each phase took."""
    device, dtype = config.torch_device, config.torch_dtype
    path = resolve_model_path(config.model)
    phases: dict[str, float] = {}
    with timed(phases, "kernels"):  # compiled on a cold cache, else loaded
        layer_ops(device, dtype)
    print(kernels_report(device, dtype), file=sys.stderr, flush=True)  # the target, and what runs as torch
    parallel = config.tensor_parallel_size > 1
    if parallel:  # rank 0: its shard's runner; the workers start and build theirs
        model_config, runner = start_tensor_parallel(config, path, phases)
    else:
        model_config, runner = build_runner(config, path, phases=phases)
    with timed(phases, "tokenizer"):
        tokenizer = get_tokenizer(Path(config.tokenizer).expanduser() if config.tokenizer else path, model_config)
    loop = runner.model.layer_loop() if runner.attention_kernel is not None else \
        f"Python layer loop: no native attention kernel for head_dim {model_config.head_dim} on {device.type}/{dtype}"
    print(f"minivllm: {model_config.architecture}: {loop}", file=sys.stderr, flush=True)
    return ModelParts(model_config, tokenizer, runner, Sampler(device, config.seed), runner.num_blocks, phases,
                      release=runner.close if parallel else None, kv_tier=build_kv_tier(config, path, runner, phases))


def build_kv_tier(config: EngineConfig, path: Path, runner: Any, phases: dict[str, float]) -> KVTier | None:
    """The KV tier (--kv-offloading-*), or None: indexes its directory, if any."""
    if not config.kv_offloading:
        return None
    with timed(phases, "kv_tier"):
        return make_kv_tier(config, path, config.weight_quantization(holds_blocks(path)), runner)
