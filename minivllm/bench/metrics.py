"""Latency and throughput metrics, defined as `vllm bench serve` defines them so that figures compare.

Per request: TTFT (request sent or arrived -> first token), E2E latency (-> last token),
TPOT = (E2E - TTFT) / (output tokens - 1), ITL (the gaps between successive token arrivals).
Across requests: mean, median, standard deviation and percentiles (numpy's linear interpolation);
throughputs over the benchmark's duration; goodput = requests that met every SLO, per second.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from minivllm.outputs import RequestMetrics

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def tpot(e2e: float, ttft: float, output_len: int) -> float | None:
    """Time per output token after the first; undefined for a single token (vLLM leaves those
    requests out of the TPOT statistics)."""
    if output_len < 2:
        return None
    return (e2e - ttft) / (output_len - 1)


@dataclass
class RequestRecord:
    """One request as its measurer saw it (a streaming client, or the engine's own timestamps)."""

    prompt_len: int
    output_len: int
    ttft: float  # seconds
    e2e: float  # seconds
    itl: list[float] = field(default_factory=list)
    queue_time: float | None = None  # arrival -> first scheduled; only the engine knows it
    success: bool = True
    error: str = ""
    text: str = ""  # what a streaming client received, to compare runs (bench serve --compare-to)
    # Where the request's time went, as minivllm's server reports it (framing.TIME_BREAKDOWN), in ms
    time_breakdown_ms: dict[str, float | None] | None = None

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2e, self.ttft, self.output_len)

    @classmethod
    def from_metrics(cls, m: RequestMetrics, prompt_len: int, output_len: int) -> RequestRecord:
        """A request the engine finished, measured from its arrival (queueing included)."""
        return cls(prompt_len, output_len, m.ttft, m.e2e, m.itl, m.queue_time)


def mean_time_breakdown(records: list[RequestRecord]) -> dict[str, float] | None:
    """Per phase, the mean over the requests whose server reported it (None: a server that reports none)."""
    reported = [r.time_breakdown_ms for r in records if r.success and r.time_breakdown_ms]
    if not reported:
        return None
    phases = {name: [t[name] for t in reported if t.get(name) is not None] for name in reported[0]}
    return {name: statistics.fmean(values) for name, values in phases.items() if values}


@dataclass
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # percentile (e.g. 99) -> value

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        # Like vLLM, an empty list summarizes to zeros rather than failing the whole report.
        ms = np.asarray(seconds, dtype=float) * 1000 if len(seconds) else np.zeros(1)
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {p: float(np.percentile(ms, p)) for p in percentiles})

    def p(self, percentile: float) -> float:
        return self.median if percentile == 50 else self.percentiles[percentile]


@dataclass
class ServingMetrics:
    completed: int
    failed: int
    duration: float  # seconds
    total_input: int
    total_output: int
    request_throughput: float  # requests/s
    output_throughput: float  # tokens/s
    total_token_throughput: float  # tokens/s
    request_goodput: float | None  # requests/s that met every SLO; None when no SLO was given
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution


def serving_metrics(records: Sequence[RequestRecord], duration: float, percentiles: Sequence[float] = (90, 99),
                    slos_ms: dict[str, float] | None = None) -> ServingMetrics:
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    goodput = count_good(ok, slos_ms) / duration if slos_ms else None
    return ServingMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration=duration,
        total_input=total_input, total_output=total_output,
        request_throughput=len(ok) / duration, output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration, request_goodput=goodput,
        ttft_ms=Distribution.of([r.ttft for r in ok], percentiles),
        tpot_ms=Distribution.of([r.tpot for r in ok if r.tpot is not None], percentiles),
        itl_ms=Distribution.of([gap for r in ok for gap in r.itl], percentiles),
        e2el_ms=Distribution.of([r.e2e for r in ok], percentiles))


def count_good(records: Sequence[RequestRecord], slos_ms: dict[str, float]) -> int:
    """Requests within every SLO. A one-token request has TPOT 0 here, as in vLLM's goodput."""
    def value(r: RequestRecord, name: str) -> float:
        return {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}[name]

    return sum(all(value(r, name) * 1000 <= limit for name, limit in slos_ms.items()) for r in records)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(GOODPUT_METRICS)}; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the limit must be >= 0")
    return slos

