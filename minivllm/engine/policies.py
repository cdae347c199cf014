"""Scheduling policies: each orders the waiting queue and picks preemption victims.

The scheduler asks a policy three questions and never looks inside it: in what order should waiting
sequences be admitted (`waiting_key`, lowest first), whom to preempt when memory runs out
(`victim_key`, highest first), and whether a blocked waiting sequence may push out a running one
(`may_preempt_for`). Aging terms use seconds waited, so that nothing starves.
"""
from __future__ import annotations

from collections import Counter

from minivllm.engine.sequence import Sequence


class SchedulingPolicy:
    name = "fcfs"

    def waiting_key(self, seq: Sequence, now: float) -> tuple:
        return (seq.metrics.arrival_time,)

    def victim_key(self, seq: Sequence) -> tuple:
        return (seq.metrics.arrival_time,)  # the latest arrival is preempted first

    def may_preempt_for(self, waiting: Sequence, running: Sequence, now: float) -> bool:
        return False

    def on_add(self, seq: Sequence) -> None:
        pass

    def on_scheduled(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def on_finish(self, seq: Sequence) -> None:
        pass

    def sort_waiting(self, waiting: list[Sequence], now: float) -> None:
        waiting.sort(key=lambda s: self.waiting_key(s, now))

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        # On a tie, the most recently admitted (the last in `running`) goes.
        return max(reversed(running), key=self.victim_key)


class FCFSPolicy(SchedulingPolicy):
    """First come, first served."""


class SJFPolicy(SchedulingPolicy):
    """Shortest remaining prompt first; every second waited counts as `aging_tokens_per_s` fewer
    tokens, so a long prompt waits at most (its length / rate) seconds behind fresh short ones."""

    name = "sjf"

    def __init__(self, aging_tokens_per_s: float = 256.0) -> None:
        self.aging_tokens_per_s = aging_tokens_per_s

    def waiting_key(self, seq: Sequence, now: float) -> tuple:
        waited = now - seq.metrics.arrival_time
        return (seq.num_uncomputed_tokens - self.aging_tokens_per_s * waited, seq.metrics.arrival_time)


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value runs first; every `aging_s` seconds waited is worth one level."""

    name = "priority"

    def __init__(self, aging_s: float = 10.0) -> None:
        self.aging_s = aging_s

    def effective_priority(self, seq: Sequence, now: float) -> float:
        return seq.priority - (now - seq.metrics.arrival_time) / self.aging_s

    def waiting_key(self, seq: Sequence, now: float) -> tuple:
        return (self.effective_priority(seq, now), seq.metrics.arrival_time)

    def victim_key(self, seq: Sequence) -> tuple:
        return (seq.priority, seq.metrics.arrival_time)

    def may_preempt_for(self, waiting: Sequence, running: Sequence, now: float) -> bool:
        # Raw priorities: with aging, two equals would take turns preempting each other forever.
        return waiting.priority < running.priority


class FairPolicy(SchedulingPolicy):
    """Per-tenant fair share of computed tokens: the tenant served least so far goes first.

    A tenant that becomes active starts at the smallest counter of the active tenants, so that an
    idle spell is not banked as credit to flood the others later.
    """

    name = "fair"

    def __init__(self) -> None:
        self.served: dict[str, float] = {}
        self.active: Counter[str] = Counter()

    def waiting_key(self, seq: Sequence, now: float) -> tuple:
        return (self.served[seq.tenant], seq.metrics.arrival_time)

    def victim_key(self, seq: Sequence) -> tuple:
        return (self.served[seq.tenant], seq.metrics.arrival_time)

    def on_add(self, seq: Sequence) -> None:
        if self.active[seq.tenant] == 0:
            floor = min((self.served[t] for t, n in self.active.items() if n), default=0.0)
            self.served[seq.tenant] = max(self.served.get(seq.tenant, 0.0), floor)
        self.active[seq.tenant] += 1

    def on_scheduled(self, seq: Sequence, num_tokens: int) -> None:
        self.served[seq.tenant] += num_tokens

    def on_finish(self, seq: Sequence) -> None:
        self.active[seq.tenant] -= 1


POLICIES: dict[str, type[SchedulingPolicy]] = {
    p.name: p for p in (FCFSPolicy, SJFPolicy, PriorityPolicy, FairPolicy)
}
