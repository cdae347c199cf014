"""The one model build, for the engine's process, every tensor-parallel rank and every replica alike:

    build_runner(config, path, shard) -> (the whole model's ModelConfig, a ModelRunner)
      the checkpoint (loader.py: an HF directory or a GGUF file, each read into a ModelConfig and a
        stream of weights through its family's registry entry)
      -> the decoder (decoder.py) holding those weights (weights.py), or the packed copy of them that
         an earlier start cached (weight_cache.py)
      -> the runner (runner.py) over a KV pool sized from the config

A shard (distributed/worker.py's TensorParallelShard) is one rank's part: it cuts the config and the
weights, and makes the rank's runner; without one the process holds the whole model.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from minivllm.config import EngineConfig, parse_size
from minivllm.model import weight_cache
from minivllm.model.decoder import CausalLM
from minivllm.model.loader import holds_blocks, load_checkpoint, weight_bytes
from minivllm.model.model_config import ModelConfig
from minivllm.model.runner import ModelRunner, kv_bytes_per_block
from minivllm.model.weights import model_from_state, model_from_weights, model_state
from minivllm.startup import timed


class Shard(Protocol):
    """One rank's part of the model."""

    key: str  # names the shard in the weight cache
    world_size: int  # the shards the model is cut into (each holds about this fraction of the weights)

    def config(self, full: ModelConfig) -> ModelConfig: ...

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]], full: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]: ...

    def runner(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
               kv_cache_dtype: str) -> ModelRunner:
        """The rank's runner over its part (whose layers this joins to the group's collectives)."""


def build_runner(config: EngineConfig, path: Path, shard: Shard | None = None, device: torch.device | None = None,
                 phases: dict[str, float] | None = None) -> tuple[ModelConfig, ModelRunner]:
    """The whole model's config and the runner of this process's part of it (`shard`'s, or all of it)
    on `device` (the config's by default); `phases` gets the seconds of the weights and the KV pool."""
    device = device or config.torch_device
    dtype, phases = config.torch_dtype, {} if phases is None else phases
    quantization = config.weight_quantization(holds_blocks(path))  # blocks are cut as they are
    with timed(phases, "weights"):
        if shard is None:
            full, model = build_model(path, device, dtype, quantization)
        else:  # not the per-process memo: the shard's runner joins the model's layers to its group
            full, model = build_model.__wrapped__(path, device, dtype, quantization, shard)
    num_blocks = num_kv_blocks(config, model.config, dtype)  # the rank's shard of the KV heads
    if device.type == "cpu":
        ensure_fits(f"the KV pool ({num_blocks} blocks: --kv-cache-memory or --num-kv-blocks)",
                    num_blocks * kv_bytes_per_block(model.config, config.block_size, dtype, config.kv_cache_dtype))
    with timed(phases, "kv_pool"):
        pool = (num_blocks, config.block_size, device, dtype, config.kv_cache_dtype)
        runner = ModelRunner(model, *pool) if shard is None else shard.runner(model, *pool)
        if shard is None and not config.enforce_eager:  # CUDA only: the decode step's graphs (cuda_graphs.py)
            longest = min(config.max_model_len or full.max_position_embeddings, num_blocks * config.block_size)
            runner.use_cuda_graphs(config.max_num_seqs, longest)
    return full, runner


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    return config.num_kv_blocks or max(
        1, parse_size(config.kv_cache_memory) // kv_bytes_per_block(model_config, config.block_size, dtype,
                                                                    config.kv_cache_dtype))


def available_memory() -> int | None:
    """Bytes the kernel can still give this machine's processes without swapping (MemAvailable), or None
    where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            kib = next((line.split()[1] for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None
    return None if kib is None else int(kib) * 1024


def ensure_fits(what: str, needed: int) -> None:
    """Refuse at start, with both figures, what would not fit in the memory left, rather than be killed by
    the kernel's OOM killer halfway through loading it."""
    available = available_memory()
    if available is not None and needed > available:
        raise ValueError(f"{what} need {readable_size(needed)} of memory, but {readable_size(available)} is "
                         "available (MemAvailable in /proc/meminfo)")


def readable_size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@functools.lru_cache(maxsize=2)
def build_model(path: Path, device: torch.device, dtype: torch.dtype, quantization: str = "none",
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
            return full, model_from_state(shard.config(full) if shard else full, state, device)
        except (ValueError, KeyError, AttributeError, RuntimeError) as e:  # an entry this code cannot use
            print(f"minivllm: the cached weights in {cached} do not fit this model ({e}); rebuilding",
                  file=sys.stderr, flush=True)
    if device.type == "cpu":
        ensure_fits(f"the weights of {path.name}", weight_bytes(path, dtype, quantization) // (shard.world_size if shard else 1))
    if cached is not None:
        print(f"minivllm: packing the weights once into {cached.parent} ...", file=sys.stderr, flush=True)
    # Decoded straight into the model's dtype, or kept quantized.
    full, weights = load_checkpoint(path, dtype, keep_quantized=quantization == "gguf")
    if shard is not None:
        model = model_from_weights(shard.config(full), shard.weights(weights, full), device, dtype, quantization)
    else:
        model = model_from_weights(full, weights, device, dtype, quantization)
    if cached is not None:
        weight_cache.save(cached, full, model_state(model))
    return full, model
