"""Step trace: a CSV row per engine step, and a Chrome trace (Perfetto opens it) with one track per
request showing when it was queued, each prefill chunk, decoding, and preemptions."""
from __future__ import annotations

import csv
import json
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from minivllm.engine.scheduler import SchedulerOutput
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


COLUMNS = [f.name for f in fields(StepRow)]


class StepTracer:
    """Keeps the rows; with a `path`, also writes them there and the Chrome trace beside it."""

    def __init__(self, path: str | Path | None, t0: float) -> None:
        self.t0 = t0
        self.rows: list[StepRow] = []
        self.csv_path = Path(path) if path else None
        if self.csv_path is None:
            return
        self.json_path = self.csv_path.with_suffix(".json")
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.csv_path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS)
        self._events: list[dict] = []
        self._tid: dict[str, int] = {}
        self._decode_open: dict[str, list[float]] = {}  # request id -> [start, end] of its decode run
        self._preempted_at: dict[str, float] = {}

    def record(self, row: StepRow, sched: SchedulerOutput, finished: list[Sequence]) -> None:
        self.rows.append(row)
        if self.csv_path is None:
            return
        self._writer.writerow(astuple(row))
        self._file.flush()
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
