"""Step trace: a CSV row per engine step, a Chrome trace (Perfetto opens it) with one track per
request showing when it was queued, each prefill chunk, decoding, and preemptions, and a JSON-lines
file of the records the live dashboard streams (`minivllm view` replays it).

The engine tells its observers (the tracer, the server's live feed) two things: `on_request` when a
request arrives or is aborted, and `record` after every step. `RequestStates` turns those into one
`RequestEvent` per state change of a request, so that the file and the live stream say the same.
"""
from __future__ import annotations

import csv
import json
from dataclasses import MISSING, asdict, astuple, dataclass, fields
from pathlib import Path
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.sequence import Sequence


@dataclass
class StepRow:
    step: int
    t_start: float  # seconds since the engine started
    t_end: float
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padding_tokens: int
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_preempted: int
    num_finished: int
    # Speculative decoding and the KV tier in this step (zeros without them):
    num_drafts: int = 0  # sequences that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_tier_ram_tokens: int = 0  # prompt tokens whose K/V the KV tier copied back from RAM
    num_tier_disk_tokens: int = 0  # ... read back from its directory


COLUMNS = [f.name for f in fields(StepRow)]
REQUIRED_COLUMNS = {f.name for f in fields(StepRow) if f.default is MISSING}  # older traces lack the rest


@dataclass
class RequestEvent:
    """A request entered `state`: waiting (arrived), prefill (a chunk: `num_computed_tokens` of
    `prefill_len` now have K/V), decode (its prefill is done: it makes one token per step),
    preempted (its K/V dropped; it waits to recompute), finished (with `finish_reason`)."""
    t: float  # seconds since the engine started
    request_id: str
    state: str
    num_prompt_tokens: int
    num_computed_tokens: int
    prefill_len: int  # prefill only: the prompt, plus the output so far after a preemption
    num_output_tokens: int
    finish_reason: str | None = None
    ttft: float | None = None  # seconds, once the first token exists
    tpot: float | None = None  # seconds, once the request has finished


def run_record(config: EngineConfig) -> dict[str, Any]:
    """The budgets a trace ran under, for the page to draw them."""
    return {"kind": "run", "scheduler": config.scheduler, "scheduling_policy": config.scheduling_policy,
            "max_num_batched_tokens": config.max_num_batched_tokens, "max_num_seqs": config.max_num_seqs,
            "static_batch_size": config.static_batch_size, "enable_chunked_prefill": config.enable_chunked_prefill}


def step_record(row: StepRow) -> dict[str, Any]:
    return {"kind": "step", **asdict(row)}


def request_record(event: RequestEvent) -> dict[str, Any]:
    return {"kind": "request", **asdict(event)}


class RequestStates:
    """Each unfinished request's last reported state, to report only changes (a request that
    decodes for 500 steps is one event, not 500)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._state: dict[str, tuple[str, int]] = {}  # request id -> (state, output tokens then)

    def on_request(self, seq: Sequence, now: float) -> RequestEvent:
        """An arrival, or an abort (the sequence is already finished)."""
        if seq.is_finished:
            self._state.pop(seq.request_id, None)
            return self._event(seq, "finished", now - self.t0)
        self._state[seq.request_id] = ("waiting", 0)
        return self._event(seq, "waiting", seq.metrics.arrival_time - self.t0)

    def on_step(self, row: StepRow, sched: SchedulerOutput, finished: list[Sequence]) -> list[RequestEvent]:
        events = []
        for seq in sched.preempted:
            self._state[seq.request_id] = ("preempted", seq.num_output_tokens)
            events.append(self._event(seq, "preempted", row.t_start))
        for (seq, _), decode in zip(sched.scheduled, sched.decode_flags):
            state, outputs = self._state.get(seq.request_id, ("waiting", 0))
            sampled = seq.num_output_tokens > outputs  # the step computed its last uncomputed token
            if not decode:
                # Once it has sampled, the new token counts in num_tokens but has no K/V yet.
                events.append(self._event(seq, "prefill", row.t_start, seq.num_tokens - sampled))
            if state != "decode" and (decode or sampled):
                events.append(self._event(seq, "decode", row.t_end))
            self._state[seq.request_id] = ("decode" if decode or sampled else "prefill", seq.num_output_tokens)
        for seq in finished:
            self._state.pop(seq.request_id, None)
            events.append(self._event(seq, "finished", row.t_end))
        return events

    @staticmethod
    def _event(seq: Sequence, state: str, t: float, prefill_len: int = 0) -> RequestEvent:
        m = seq.metrics
        return RequestEvent(t, seq.request_id, state, seq.num_prompt_tokens, seq.num_computed_tokens,
                            prefill_len, seq.num_output_tokens, seq.finish_reason, m.ttft,
                            m.tpot if seq.is_finished else None)


class StepObserver:
    """What the engine calls (in its own thread, so an observer must be quick and never block)."""

    def on_request(self, seq: Sequence, now: float) -> None:
        """`seq` arrived (WAITING) or was aborted (FINISHED); `now` on the engine's clock."""

    def record(self, row: StepRow, sched: SchedulerOutput, finished: list[Sequence]) -> None:
        """A step ran: its totals, what it scheduled, the sequences that finished in it."""


class StepTracer(StepObserver):
    """Keeps the step rows; with a `path`, also writes them there (CSV), the records of the live feed
    beside it (.jsonl: what the dashboard replays) and a Chrome trace (.json)."""

    def __init__(self, path: str | Path | None, t0: float, run: dict[str, Any] | None = None) -> None:
        self.t0 = t0
        self.rows: list[StepRow] = []
        self.csv_path = Path(path) if path else None
        if self.csv_path is None:  # the simulator's in-memory rows
            return
        self.json_path = self.csv_path.with_suffix(".json")
        self.records_path = self.csv_path.with_suffix(".jsonl")
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.csv_path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS)
        self._records = open(self.records_path, "w")
        self._states = RequestStates(t0)
        if run:
            self._write(run)
        self._events: list[dict] = []
        self._tid: dict[str, int] = {}
        self._decode_open: dict[str, list[float]] = {}  # request id -> [start, end] of its decode run
        self._preempted_at: dict[str, float] = {}

    def on_request(self, seq: Sequence, now: float) -> None:
        if self.csv_path is not None:
            self._write(request_record(self._states.on_request(seq, now)))

    def record(self, row: StepRow, sched: SchedulerOutput, finished: list[Sequence]) -> None:
        self.rows.append(row)
        if self.csv_path is None:
            return
        self._writer.writerow(astuple(row))
        self._file.flush()
        self._write(step_record(row))
        for event in self._states.on_step(row, sched, finished):
            self._write(request_record(event))
        self._records.flush()
        t0, t1 = row.t_start, row.t_end
        scheduled_ids = set()
        for (seq, n), decode in zip(sched.scheduled, sched.decode_flags):
            rid = seq.request_id
            scheduled_ids.add(rid)
            if rid not in self._tid:
                self._tid[rid] = len(self._tid) + 1
                self._span(rid, "queued", seq.metrics.arrival_time - self.t0, t0)
            if rid in self._preempted_at:
                self._span(rid, "preempted", self._preempted_at.pop(rid), t0)
            if decode:
                span = self._decode_open.setdefault(rid, [t0, t1])
                span[1] = t1
            else:
                self._close_decode(rid)
                self._span(rid, f"prefill {n} tokens", t0, t1)
        for seq in sched.preempted:
            self._close_decode(seq.request_id)
            self._preempted_at[seq.request_id] = t1
        for rid in [r for r in self._decode_open if r not in scheduled_ids]:
            self._close_decode(rid)
        for seq in finished:
            self._close_decode(seq.request_id)

    def _write(self, record: dict[str, Any]) -> None:
        self._records.write(json.dumps(record) + "\n")

    def _close_decode(self, rid: str) -> None:
        span = self._decode_open.pop(rid, None)
        if span:
            self._span(rid, "decode", span[0], span[1])

    def _span(self, rid: str, name: str, start: float, end: float) -> None:
        tid = self._tid.setdefault(rid, len(self._tid) + 1)
        self._events.append({"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": start * 1e6,
                             "dur": max(end - start, 0) * 1e6})

    def flush(self) -> None:
        """Write the CSV rows and the Chrome trace of everything so far (open decode runs included)."""
        if self.csv_path is None:
            return
        self._file.flush()
        names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"request {rid}"}}
                 for rid, tid in self._tid.items()]
        open_runs = [{"name": "decode", "ph": "X", "pid": 1, "tid": self._tid[rid], "ts": s * 1e6,
                      "dur": (e - s) * 1e6} for rid, (s, e) in self._decode_open.items()]
        self.json_path.write_text(json.dumps({"traceEvents": names + self._events + open_runs,
                                              "displayTimeUnit": "ms"}))

    def close(self) -> None:
        if self.csv_path is None:
            return
        self.flush()
        self._file.close()
        self._records.close()
