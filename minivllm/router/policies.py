"""Routing policies: each picks the replica for a request, chosen by name like the scheduler's.

A policy sees only what a router in front of the replicas knows: the requests it sent where, and
which of them have finished (`Router` keeps that book). It never looks inside an engine, so the
simulator's cluster and an HTTP router over replica URLs use the same objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.engine.block_manager import block_hash


@dataclass
class ReplicaLoad:
    name: str  # a URL, or "replica-3" in the simulator
    outstanding_tokens: int = 0  # prompt + max output tokens of the requests sent and not finished
    outstanding_requests: int = 0
    up: bool = True  # False: out of rotation (the HTTP router's health checks); policies skip it


@dataclass
class Routed:
    """One request as the router books it."""

    request_id: str
    prompt_token_ids: list[int]
    num_tokens: int  # prompt + max output tokens: the load it brings
    replica: int = -1
    salt: bytes | None = None  # seeds its first block hash: the LoRA adapter it names (its KV is apart)


class RoutingPolicy:
    name = ""

    def choose(self, request: Routed, replicas: list[ReplicaLoad]) -> int:
        raise NotImplementedError

    def on_routed(self, request: Routed) -> None:
        pass


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, request: Routed, replicas: list[ReplicaLoad]) -> int:
        for _ in range(len(replicas)):
            i, self.next = self.next % len(replicas), self.next + 1
            if replicas[i].up:
                return i
        raise NoReplicaError("no replica is up")


class NoReplicaError(RuntimeError):
    pass


def least_loaded(replicas: list[ReplicaLoad]) -> int:
    """Fewest outstanding tokens among the replicas up; on a tie the lowest index."""
    up = [i for i, r in enumerate(replicas) if r.up]
    if not up:
        raise NoReplicaError("no replica is up")
    return min(up, key=lambda i: (replicas[i].outstanding_tokens, i))


class LeastOutstandingTokens(RoutingPolicy):
    name = "least-outstanding-tokens"

    def choose(self, request: Routed, replicas: list[ReplicaLoad]) -> int:
        return least_loaded(replicas)


class PrefixAware(RoutingPolicy):
    """A request whose first KV blocks match blocks sent to a replica before goes to that replica
    (the longest match wins), where its prompt prefix is likely still cached; unless that replica's
    outstanding tokens exceed `load_factor` x the mean of the replicas up plus `slack_tokens`: then
    the least loaded takes it (the load bound). The mean, not the least loaded replica's load: with
    many replicas one is nearly idle at any moment, and a bound on it sends turns away from their
    cache whenever the cluster is busy (64 simulated replicas: 69 % prefix hits, against 78 %).
    Blocks are hashed as the engine's prefix cache does, the first seeded with the request's salt as
    the engine seeds it with the adapter's: the same prompt under two adapters shares no KV, so it has
    no affinity either."""

    name = "prefix-aware"

    def __init__(self, block_size: int = 16, max_blocks: int = 32, load_factor: float = 1.5,
                 slack_tokens: int = 4096) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks
        self.load_factor, self.slack_tokens = load_factor, slack_tokens
        self.owner: dict[bytes, int] = {}  # block hash -> the replica it was last sent to

    def hashes(self, token_ids: list[int], salt: bytes | None = None) -> list[bytes]:
        bs, out, parent = self.block_size, [], salt
        for i in range(min(len(token_ids) // bs, self.max_blocks)):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def choose(self, request: Routed, replicas: list[ReplicaLoad]) -> int:
        best = least_loaded(replicas)
        match = None
        for h in self.hashes(request.prompt_token_ids, request.salt):
            if h not in self.owner:
                break
            match = self.owner[h]
        if match is None or not replicas[match].up:
            return best
        up = [r.outstanding_tokens for r in replicas if r.up]
        bound = self.load_factor * sum(up) / len(up) + self.slack_tokens
        return match if replicas[match].outstanding_tokens <= bound else best

    def on_routed(self, request: Routed) -> None:
        for h in self.hashes(request.prompt_token_ids, request.salt):
            self.owner[h] = request.replica


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobin, LeastOutstandingTokens, PrefixAware)
}


@dataclass
class Router:
    """The book a router keeps: where each request went and the load still outstanding there."""

    policy: RoutingPolicy
    replicas: list[ReplicaLoad]
    inflight: dict[str, Routed] = field(default_factory=dict)

    @classmethod
    def create(cls, policy: str, replica_names: list[str], **policy_args) -> Router:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}; got {policy!r}")
        return cls(ROUTING_POLICIES[policy](**policy_args), [ReplicaLoad(n) for n in replica_names])

    def route(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
              num_tokens: int | None = None, salt: bytes | None = None) -> int:
        """num_tokens: the load it brings, when prompt_token_ids are not tokens (the HTTP router's bytes);
        salt: the adapter the request names (Routed.salt)."""
        request = Routed(request_id, prompt_token_ids,
                         len(prompt_token_ids) + max_tokens if num_tokens is None else num_tokens, salt=salt)
        request.replica = self.policy.choose(request, self.replicas)
        load = self.replicas[request.replica]
        load.outstanding_tokens += request.num_tokens
        load.outstanding_requests += 1
        self.inflight[request_id] = request
        self.policy.on_routed(request)
        return request.replica

    def finished(self, request_id: str) -> None:
        request = self.inflight.pop(request_id)
        load = self.replicas[request.replica]
        load.outstanding_tokens -= request.num_tokens
        load.outstanding_requests -= 1
