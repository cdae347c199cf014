"""The tensor-parallel group: an object the runner and the row-parallel layers hold (no globals),
and how its ranks start: spawned with torch.multiprocessing on one host, placed by Ray as actors
(ray_workers.py), or launched by torchrun (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).

Two process groups over the same ranks: the default one carries the all_reduces of a step, with a
timeout (MINIVLLM_TP_TIMEOUT seconds, 300 by default) so that a stopped rank fails the step instead
of hanging it; the control group carries the step broadcasts, on which idle workers may wait forever.
A rank that dies closes its sockets: the others' next collective fails at once (gloo).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEP_TIMEOUT = timedelta(seconds=float(os.environ.get("MINIVLLM_TP_TIMEOUT", 300)))
IDLE_TIMEOUT = timedelta(days=365)
JOIN_TIMEOUT_S = 30


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed: the engine cannot step any more."""


class SpawnedWorkers(list):
    """Ranks 1.. as processes of this host (torch.multiprocessing). Ray's actors (ray_workers.py) answer
    the same two questions: which ranks died, and stop."""

    def dead(self) -> list[str]:
        return [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(self, 1) if p.exitcode is not None]

    def stop(self) -> None:
        for p in self:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    control: Any  # the process group of the step broadcasts
    workers: Any = field(default_factory=SpawnedWorkers)  # ranks 1.. when rank 0 started them
    all_reduce_time: float = 0.0  # seconds in all_reduce, for `bench latency`'s share of the step
    send_time: float = 0.0  # seconds rank 0 spent broadcasting step inputs
    failed: bool = False
    num_threads_before: int | None = None  # rank 0's torch threads before it shared the cores

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(x)
        self.all_reduce_time += time.perf_counter() - start
        return x

    def send_step(self, inputs: Any) -> None:
        """Rank 0: this step's inputs (or None: stop) to every worker."""
        start = time.perf_counter()
        dist.broadcast_object_list([inputs], src=0, group=self.control)
        self.send_time += time.perf_counter() - start

    def recv_step(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def failure(self, error: BaseException) -> TensorParallelError:
        """A clear error for a failed collective: which spawned worker died, if one did."""
        self.failed = True
        time.sleep(0.2)  # a worker that just died: let its exit code arrive
        dead = self.workers.dead()
        why = "; ".join(dead) if dead else f"{type(error).__name__}: {error}"
        return TensorParallelError(f"tensor-parallel group of {self.world_size} failed ({why}); the engine "
                                   "stopped")

    def close(self) -> None:
        """Rank 0: stop the workers, wait for them, leave the group. Idempotent."""
        if not dist.is_initialized():
            return
        if self.rank == 0 and not self.failed:
            try:
                self.send_step(None)
            except RuntimeError:
                pass
        self.workers.stop()
        dist.destroy_process_group()
        if self.num_threads_before is not None:
            torch.set_num_threads(self.num_threads_before)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"  # NCCL: written for CUDA, untested here (one GPU)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def join(rank: int, world_size: int, backend: str, init_method: str = "env://",
         workers: Any = None) -> TensorParallelGroup:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend=backend, timeout=IDLE_TIMEOUT)
    return TensorParallelGroup(rank, world_size, control, workers or SpawnedWorkers())


def torchrun_rank(world_size: int) -> int:
    """This process's rank under torchrun, checked against --tensor-parallel-size."""
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"tensor_parallel_size is {world_size} but torchrun started WORLD_SIZE="
                         f"{os.environ['WORLD_SIZE']} processes: they must be equal")
    return int(os.environ["RANK"])


def free_init_method(host: str = "127.0.0.1") -> str:
    """A rendezvous address for the group on this host: a port free now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def spawn_workers(world_size: int, target: Any, args: tuple) -> tuple[SpawnedWorkers, str]:
    """Ranks 1.. as torch.multiprocessing processes; `target(rank, world_size, init_method, *args)`."""
    init_method = free_init_method()
    ctx = mp.get_context("spawn")
    workers = SpawnedWorkers(ctx.Process(target=target, args=(rank, world_size, init_method, *args), daemon=True,
                                          name=f"minivllm-tp-rank{rank}") for rank in range(1, world_size))
    for p in workers:
        p.start()
    return workers, init_method
