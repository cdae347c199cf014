"""`--distributed-executor-backend ray`: ranks 1.. of the tensor-parallel group as Ray actors, one per
bundle of one placement group, so that Ray places them on the nodes that have room and supervises
them. Rank 0 stays in the engine's process, as with `mp`. Ray only places and watches: each step's
data still goes over torch.distributed (gloo), and an idle worker waits in a blocking receive, not in
a polling loop (no compiled graphs): an idle worker uses ~0.5 % of a core.

Ranks follow Ray node ids, not IPs (the nodes of a test cluster share one IP): the driver's node
first, then each other node's workers together.
"""
from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm.distributed.group import JOIN_TIMEOUT_S, free_init_method

PLACEMENT_TIMEOUT_S = float(os.environ.get("MINIVLLM_RAY_PLACEMENT_TIMEOUT", 60))


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("the ray backends need Ray: pip install 'minivllm[ray]'") from None
    return ray


class TensorParallelRank:
    """One worker rank, made a Ray actor by `start_ray_workers` (Ray is imported only there)."""

    def where(self) -> tuple[str, int]:
        """The Ray node id and the process id (asked before `run`: an actor answers one call at a time)."""
        import ray
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, target: Callable, num_threads: int, *args: Any) -> None:
        """The worker's life (`target`, as a spawned process runs it) on the cores its bundle holds.
        A failing rank ends its process, as a spawned one does: Ray would keep the actor alive after the
        exception, and its open gloo connections would leave the other ranks waiting for the timeout."""
        os.environ["OMP_NUM_THREADS"] = str(num_threads)  # share_cores reads it
        import torch
        torch.set_num_threads(num_threads)
        try:
            target(*args)
        except BaseException:
            traceback.print_exc()
            os._exit(1)


@dataclass
class RayWorkers:
    """Ranks 1.. as actors, in rank order; `runs` are their `run` calls, which end when the rank does."""

    actors: list[Any]
    runs: list[Any]
    node_ids: list[str]
    pids: list[int]
    placement_group: Any
    owns_ray: bool = False  # this process started the Ray instance (no cluster given): stop() shuts it down

    def dead(self) -> list[str]:
        import ray
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        dead = []
        for rank, (ref, node_id) in enumerate(zip(self.runs, self.node_ids), 1):
            if ref not in done:
                continue
            try:
                ray.get(ref)
                what = "stopped"
            except Exception as e:  # ActorDiedError, the rank's own exception
                what = f"died: {type(e).__name__}"
            dead.append(f"rank {rank} (Ray actor on node {node_id[:8]}) {what}")
        return dead

    def stop(self) -> None:
        """After rank 0 sent the stop: wait for the ranks to return, then free the actors and the bundles."""
        import ray
        from ray.util.placement_group import remove_placement_group
        ray.wait(self.runs, num_returns=len(self.runs), timeout=JOIN_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)
        if self.owns_ray:
            ray.shutdown()


def start_ray_workers(world_size: int, target: Callable, args: tuple, num_threads: int,
                      address: str | None) -> tuple[RayWorkers, str]:
    """Ranks 1.. placed by Ray, each running `target(rank, world_size, init_method, *args)` on
    `num_threads` cores; returns them and the group's rendezvous address (on the driver's node)."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    owns_ray = connect_ray(address)
    num_workers = world_size - 1
    asked = num_workers * num_threads
    total = ray.cluster_resources().get("CPU", 0)
    if asked > total:
        raise ValueError(_cannot_place(ray, num_workers, num_threads, "the whole cluster has fewer"))
    group = placement_group([{"CPU": num_threads}] * num_workers, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ValueError(_cannot_place(ray, num_workers, num_threads,
                                         f"not placed within {PLACEMENT_TIMEOUT_S:.0f} s")) from None
    rank_actor = ray.remote(TensorParallelRank)
    actors = [rank_actor.options(num_cpus=num_threads, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote() for i in range(num_workers)]
    where = ray.get([a.where.remote() for a in actors])
    here = ray.get_runtime_context().get_node_id()
    order = sorted(range(num_workers), key=lambda i: (where[i][0] != here, where[i][0]))
    actors, where = [actors[i] for i in order], [where[i] for i in order]
    init_method = free_init_method(ray.util.get_node_ip_address())
    runs = [a.run.remote(target, num_threads, rank, world_size, init_method, *args)
            for rank, a in enumerate(actors, 1)]
    return RayWorkers(actors, runs, [node for node, _ in where], [pid for _, pid in where], group, owns_ray), init_method


def connect_ray(address: str | None) -> bool:
    """Join the cluster at `address` (else RAY_ADDRESS, else start a Ray instance here), unless this
    process is connected already; True when it started the instance itself (then it shuts it down)."""
    ray = import_ray()
    address = address or os.environ.get("RAY_ADDRESS")
    _check_reachable(address)
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return not address


def _check_reachable(address: str | None) -> None:
    """A head at host:port that does not answer: say so at once (ray.init retries for minutes). Bad
    configuration is a ValueError, which the CLI prints as one line."""
    if not address or "://" in address or ":" not in address:
        return  # None (start a local instance), "auto", "local", or a ray:// client address
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except (OSError, ValueError) as e:
        raise ValueError(f"no Ray cluster answers at {address} ({e}): start one with `ray start --head`, or "
                           "give its head's address with --ray-address or RAY_ADDRESS") from None


def _cannot_place(ray: Any, num_workers: int, num_threads: int, why: str) -> str:
    free = ray.available_resources().get("CPU", 0)
    return (f"the Ray cluster cannot place {num_workers} tensor-parallel worker(s) of {num_threads} CPU each "
            f"({why}: {num_workers * num_threads} CPU asked, {free:g} free on {len(ray.nodes())} node(s)); "
            "lower --tensor-parallel-size or add nodes (ray start --address ...)")
