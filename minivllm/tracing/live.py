"""The live feed of the dashboard: the step trace's records in a bounded ring, by sequence number.

The engine thread appends (an observer call per step, O(1)); readers (the dashboard's event streams,
on the server's event loop) ask for what came after the last number they saw. Nobody waits on a
reader: a slow or absent browser only falls behind, and one that falls more than the ring behind
is told how many records it missed.

    engine thread --record/on_request--> LiveFeed ring (deque, maxlen) <--since(n)-- each stream
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.tracing.trace import RequestStates, StepObserver, StepRow, request_record, step_record

DEFAULT_CAPACITY = 4096  # about a minute of a busy server's steps and request changes


@dataclass
class Batch:
    records: list[dict[str, Any]]  # each with its "seq" number, oldest first
    next_seq: int  # ask for this number next
    missed: int  # records that left the ring before this reader asked for them


class LiveFeed(StepObserver):
    def __init__(self, t0: float, run: dict[str, Any], capacity: int = DEFAULT_CAPACITY) -> None:
        self.run = run  # the budgets, sent first to every reader
        self.capacity = capacity
        self._ring: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._next = 0  # the number the next record gets
        self._lock = threading.Lock()  # the ring is written by the engine thread, read by the event loop's
        self._states = RequestStates(t0)

    # -- the engine thread ----------------------------------------------------------------------------
    def on_request(self, seq: Sequence, now: float) -> None:
        self.publish([request_record(self._states.on_request(seq, now))])

    def record(self, row: StepRow, sched: SchedulerOutput, finished: list[Sequence]) -> None:
        events = self._states.on_step(row, sched, finished)
        self.publish([step_record(row), *map(request_record, events)])

    def publish(self, records: list[dict[str, Any]]) -> None:
        with self._lock:
            for r in records:
                r["seq"] = self._next
                self._next += 1
                self._ring.append(r)

    # -- readers ----------------------------------------------------------------------------------------
    @property
    def oldest_seq(self) -> int:
        """The number of the oldest record still in the ring."""
        with self._lock:
            return self._next - len(self._ring)

    def __len__(self) -> int:
        return len(self._ring)

    def since(self, seq: int, limit: int = 1024) -> Batch:
        """Up to `limit` records numbered `seq` and later (the records are not copied: never change them)."""
        with self._lock:
            oldest = self._next - len(self._ring)
            start = max(seq, oldest)
            records = list(itertools.islice(self._ring, start - oldest, start - oldest + limit))
        return Batch(records, start + len(records), start - seq)
