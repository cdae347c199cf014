"""Driver and workers (vLLM's pattern): rank 0 holds the one scheduler, prepares each step's inputs,
broadcasts them, runs its own shard and samples; every other rank runs the same forward on its shard,
taking part in each layer's two all_reduces, and waits for the next step. Every rank builds its runner
by the one model build (model/build.py), given its TensorParallelShard."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minivllm.config import EngineConfig
from minivllm.distributed.group import (TensorParallelError, TensorParallelGroup, backend_for, join,
                                        launched_by_torchrun, spawn_workers, torchrun_rank)
from minivllm.distributed.sharding import check_divisible, make_row_parallel, shard_config, shard_weights
from minivllm.model.batch import BatchInputs
from minivllm.model.build import build_runner
from minivllm.model.decoder import CausalLM
from minivllm.model.loader import load_checkpoint
from minivllm.model.model_config import ModelConfig
from minivllm.model.runner import ModelRunner
from minivllm.startup import timed


class DriverRunner(ModelRunner):
    """Rank 0's runner: a step's inputs go to the workers before its own forward (so `prepare_time`
    includes sending them). A failed collective ends the engine with TensorParallelError."""

    def __init__(self, group: TensorParallelGroup, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def _prepare(self, batch: BatchInputs):
        inputs = super()._prepare(batch)
        input_ids, positions, meta = inputs[:3]
        self.group.send_step((input_ids, positions, dataclasses.replace(meta, kernel=None)))  # a C function
        return inputs

    def execute(self, batch: BatchInputs) -> torch.Tensor:
        if self.group.failed:
            raise TensorParallelError("the tensor-parallel group failed earlier; the engine stopped")
        try:
            return super().execute(batch)
        except TensorParallelError:
            raise
        except RuntimeError as e:  # gloo: "Connection closed by peer", a timeout, ...
            raise self.group.failure(e) from e

    def close(self) -> None:
        self.group.close()


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank `rank`'s part of the model, as model/build.py builds (and caches) it: its heads and its slice
    of the MLP, whose row-parallel layers sum over `group`. Rank 0's runner drives the others."""

    rank: int
    world_size: int
    group: TensorParallelGroup = field(compare=False)

    @property
    def key(self) -> str:
        return f"tp{self.rank}of{self.world_size}"

    def config(self, full: ModelConfig) -> ModelConfig:
        return shard_config(full, self.world_size)

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]], full: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        return shard_weights(weights, full, self.rank, self.world_size)

    def runner(self, model: CausalLM, *pool: Any) -> ModelRunner:
        make_row_parallel(model, self.group)
        return DriverRunner(self.group, model, *pool) if self.rank == 0 else ModelRunner(model, *pool)


def start_tensor_parallel(config: EngineConfig, path: Path, phases: dict[str, float]
                          ) -> tuple[ModelConfig, DriverRunner]:
    """Rank 0: join the group (spawning the workers, unless torchrun started them) and build its shard's
    runner. On a worker rank that torchrun started, serve steps until rank 0 stops, then exit the process."""
    n = config.tensor_parallel_size
    check_divisible(load_checkpoint(path)[0], n)  # before any process starts (the weights are not read)
    backend = backend_for(config.torch_device)
    if launched_by_torchrun():
        group = join(torchrun_rank(n), n, backend)
        if group.rank != 0:
            serve_steps(config, path, group)
            raise SystemExit(0)
    else:
        with timed(phases, "workers"):
            threads = share_cores(n)  # this process is rank 0: close() gives its threads back
            workers, init_method = start_workers(config, n, (config, str(path)))
            group = join(0, n, backend, init_method, workers)
            group.num_threads_before = threads
    return build_runner(config, path, TensorParallelShard(0, n, group), phases=phases)


def start_workers(config: EngineConfig, n: int, args: tuple) -> tuple[Any, str]:
    """Ranks 1.., by --distributed-executor-backend: processes of this host, or Ray actors placed on the
    cluster's nodes with as many cores each as a rank of this host would get."""
    if config.distributed_executor_backend == "ray":
        from minivllm.distributed.ray_workers import start_ray_workers
        return start_ray_workers(n, _spawned_worker, args, cores_per_rank(n), config.ray_address)
    return spawn_workers(n, _spawned_worker, args)


def _spawned_worker(rank: int, world_size: int, init_method: str, config: EngineConfig, path: str) -> None:
    share_cores(world_size)
    serve_steps(config, Path(path), join(rank, world_size, backend_for(config.torch_device), init_method))


def share_cores(world_size: int) -> int:
    """Ranks spawned on one host split its cores (oversubscribed, each rank's threads would spin
    against the others' at every all_reduce); OMP_NUM_THREADS, if set, wins (torchrun sets 1).
    Returns the thread count before."""
    before = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cores_per_rank(world_size))
    return before


def cores_per_rank(world_size: int) -> int:
    """OMP_NUM_THREADS if set, else an equal share of this host's cores."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // world_size))


def serve_steps(config: EngineConfig, path: Path, group: TensorParallelGroup) -> None:
    """A worker's life: build its shard's runner, run each step rank 0 sends, until it sends None."""
    device = config.torch_device
    if device.type == "cuda":  # one GPU per rank (NCCL; untested: the machine lent here has one GPU)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", group.rank)))
        torch.cuda.set_device(device)
    _, runner = build_runner(config, path, TensorParallelShard(group.rank, group.world_size, group), device)
    with torch.inference_mode():
        while (step := group.recv_step()) is not None:
            input_ids, positions, meta = (_on(x, device) for x in step)
            runner.model(input_ids, positions, runner.kv_caches, dataclasses.replace(meta, kernel=runner.attention_kernel))
    group.close()


def _on(x: Any, device: torch.device) -> Any:
    """A step input on this rank's device (a no-op on CPU; under NCCL, unpickled tensors land on
    the sender's GPU index)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: _on(getattr(x, f.name), device) for f in dataclasses.fields(x)
                                         if f.init})
    if isinstance(x, list):
        return [_on(v, device) for v in x]
    return x
