"""`minivllm bench compare`: one arrival trace through static and continuous batching (and
optionally Hugging Face transformers), in one process on one model, and the numbers that show why
static batching is not enough for online serving.

Each system replays the same trace: a request is added once its arrival instant has passed, with
that instant as its arrival time, so time spent waiting behind a long step counts as queueing.
"""
from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from tqdm import tqdm

from minivllm.bench.hf_backend import HFGenerator
from minivllm.bench.metrics import Distribution, RequestRecord, ServingMetrics, serving_metrics
from minivllm.bench.workloads import BenchRequest
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestMetrics
from minivllm.sampling_params import SamplingParams
from minivllm.tracing.trace import StepRow, StepTracer, run_record

PERCENTILES = (50, 90, 99)
DECAY_POINTS = (0.0, 0.25, 0.5, 0.75, 1.0)  # where in a static batch its occupancy is sampled


@dataclass
class SystemRun:
    name: str
    requests: list[BenchRequest]
    metrics: list[RequestMetrics]  # aligned with `requests`
    rows: list[StepRow]  # step trace, times in seconds since the first arrival
    t0: float  # perf_counter of the first arrival
    router_seconds: float = 0.0  # simulated clusters: wall time in the router's route and finished calls


def warm_up(engine: LLMEngine) -> None:
    """One tiny request first, so that one-time setup is not billed to the first arrivals."""
    engine.add_request("warm-up", engine.tokenizer.encode("Warming up."), SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def replay_engine(engine: LLMEngine, requests: list[BenchRequest], name: str, show_progress: bool = True,
                  sleep: Callable[[float], None] = time.sleep) -> SystemRun:
    """On the engine's clock: the wall clock, or the simulator's virtual one (with its `sleep`)."""
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    done: dict[str, RequestMetrics] = {}
    bar = tqdm(total=len(requests), desc=name, disable=not show_progress, dynamic_ncols=True)
    t0 = engine.clock()
    while pending or engine.has_unfinished_requests():
        now = engine.clock()
        while pending and t0 + pending[0].arrival <= now:
            req = pending.popleft()
            engine.add_request(req.request_id, req.prompt_token_ids, req.sampling_params(),
                               arrival_time=t0 + req.arrival, priority=req.priority, tenant=req.tenant)
        if not engine.has_unfinished_requests():
            sleep(t0 + pending[0].arrival - now)  # idle until the next arrival
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.metrics
                bar.update(1)
    bar.close()
    shift = t0 - engine.start_time  # trace rows count from the engine's start (the simulator's: both 0)
    rows = engine.tracer.rows if shift == 0 else [replace(r, t_start=r.t_start - shift, t_end=r.t_end - shift)
                                                    for r in engine.tracer.rows]
    return SystemRun(name, requests, [done[r.request_id] for r in requests], rows, t0)


def run_engine(config: EngineConfig, requests: list[BenchRequest], trace_path: str,
               show_progress: bool = True, wrap_runner: Callable[[Any], Any] | None = None) -> SystemRun:
    """`wrap_runner`, if given, wraps the model runner after the warm-up (the simulator's validation
    notes each step's shape that way)."""
    engine = LLMEngine(config)
    warm_up(engine)
    if wrap_runner is not None:
        engine.runner = wrap_runner(engine.runner)
    engine.tracer = StepTracer(trace_path, engine.start_time, run_record(config))  # from here on: the warm-up stays out
    try:
        return replay_engine(engine, requests, config.scheduler, show_progress)
    finally:
        engine.close()
        del engine
        gc.collect()  # free this engine's KV cache before the next engine allocates its own


def run_hf(generator: HFGenerator, requests: list[BenchRequest], batch_size: int,
           show_progress: bool = True) -> SystemRun:
    """Static batches as Hugging Face serves them: when idle, take up to `batch_size` requests that
    have arrived (waiting for the next one if none has) and generate until the longest is done."""
    generator.warm_up()
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    done: dict[str, RequestMetrics] = {}
    rows: list[StepRow] = []
    bar = tqdm(total=len(requests), desc="hf", disable=not show_progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    while pending:
        time.sleep(max(0.0, t0 + pending[0].arrival - time.perf_counter()))
        now = time.perf_counter()
        batch = []
        while pending and len(batch) < batch_size and t0 + pending[0].arrival <= now:
            batch.append(pending.popleft())
        run = generator.run_batch(batch)
        for req, m in zip(batch, run.metrics([t0 + r.arrival for r in batch])):
            done[req.request_id] = m
        rows += run.rows(t0, len(rows) + 1, [t0 + r.arrival for r in pending])
        bar.update(len(batch))
    bar.close()
    return SystemRun("hf", requests, [done[r.request_id] for r in requests], rows, t0)


# -- the numbers ------------------------------------------------------------------------------------
@dataclass
class SystemSummary:
    name: str
    serving: ServingMetrics  # throughput over first arrival -> last finish; TTFT, TPOT, E2E
    queue_ms: Distribution  # arrival -> first scheduled
    padding_waste: float  # share of computed tokens that were padding or idle slots
    mean_batch: float  # sequences computing per step, weighted by the step's duration
    slot_occupancy: float  # in decode steps, live sequences / slots computed
    batch_decay: list[float] | None  # static only: occupancy at DECAY_POINTS of a batch's steps
    short_ttft_ms: Distribution  # TTFT of every short request
    hol_ttft_ms: Distribution  # TTFT of short requests that arrived right behind a long one
    num_hol_requests: int
    num_steps: int


def summarize(run: SystemRun) -> SystemSummary:
    records = [RequestRecord.from_metrics(m, r.prompt_len, len(m.token_times))
               for r, m in zip(run.requests, run.metrics)]
    duration = max(m.finished_time for m in run.metrics) - run.t0
    shorts = [m.ttft for r, m in zip(run.requests, run.metrics) if r.kind == "short"]
    hol = [run.metrics[i].ttft for i in behind_long(run.requests)]
    return SystemSummary(
        name=run.name, serving=serving_metrics(records, duration, PERCENTILES),
        queue_ms=Distribution.of([m.queue_time for m in run.metrics], PERCENTILES),
        padding_waste=padding_waste(run.rows), mean_batch=mean_batch(run.rows),
        slot_occupancy=slot_occupancy(run.rows), batch_decay=batch_decay(run.rows) if run.name != "continuous" else None,
        short_ttft_ms=Distribution.of(shorts, PERCENTILES), hol_ttft_ms=Distribution.of(hol, PERCENTILES),
        num_hol_requests=len(hol), num_steps=len(run.rows))


def behind_long(requests: list[BenchRequest]) -> list[int]:
    """Indices of short requests whose previous arrival was a long request. Chosen from the trace
    alone, so every system is judged on the same requests."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    return [i for prev, i in zip(order, order[1:])
            if requests[i].kind == "short" and requests[prev].kind == "long"]


def batch_size(row: StepRow) -> int:
    """Sequences that computed in the step: those still running after it, and those it finished."""
    return row.num_running + row.num_finished


def padding_waste(rows: list[StepRow]) -> float:
    computed = sum(r.num_scheduled_tokens for r in rows)
    return sum(r.num_padding_tokens for r in rows) / computed if computed else 0.0


def mean_batch(rows: list[StepRow]) -> float:
    durations = [r.t_end - r.t_start for r in rows]
    return float(np.average([batch_size(r) for r in rows], weights=durations)) if sum(durations) > 0 else 0.0


def slot_occupancy(rows: list[StepRow]) -> float:
    """In pure decode steps every slot is one token, so useful / computed is live / slots."""
    decodes = [r for r in rows if r.num_prefill_tokens == 0]
    slots = sum(r.num_scheduled_tokens for r in decodes)
    return sum(r.num_decode_tokens for r in decodes) / slots if slots else 1.0


def static_batches(rows: list[StepRow]) -> list[list[StepRow]]:
    """A static batch starts with its prefill step and runs until the next one."""
    batches: list[list[StepRow]] = []
    for row in rows:
        if row.num_prefill_tokens > 0 or not batches:
            batches.append([])
        batches[-1].append(row)
    return batches


def batch_decay(rows: list[StepRow]) -> list[float]:
    """Mean over static batches of live members / batch size, at each of DECAY_POINTS of the way
    through the batch's steps: how a static batch empties while its longest member runs on."""
    curves = []
    for batch in static_batches(rows):
        size = batch_size(batch[0])
        curves.append([batch_size(batch[round(p * (len(batch) - 1))]) / size for p in DECAY_POINTS])
    return [float(x) for x in np.mean(curves, axis=0)]
