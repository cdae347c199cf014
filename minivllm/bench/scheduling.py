"""`minivllm bench scheduling`: the scheduler's trade-offs, measured on the real model.

chunked-prefill: 16 streams are decoding when a 2,048-token prompt arrives (--num-streams,
    --long-len), and short requests (32-token prompts) arrive while it is prefilled. Chunked prefill
    (a small token budget, and long-prefill thresholds that cap the long prompt's chunk) against no
    chunking (the whole prompt in one step): TTFT of the short requests and of the long prompt, and
    the streams' inter-token latency while it prefills against the same tokens of the same streams
    run alone first, with the ratio of the two means (what a long prompt costs the streams' TPOT).
fair: a light tenant alone, then beside a tenant sending 10x more requests, under `fair` and under
    `fcfs` for contrast: the light tenant's TTFT.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from minivllm.bench.compare import run_engine
from minivllm.bench.metrics import Distribution
from minivllm.bench.workloads import BenchRequest, TextCorpus, arrival_offsets
from minivllm.config import EngineConfig

PERCENTILES = (50, 90, 99, 100)
FAIR_MAX_SEQS = 16  # 100: the maximum


@dataclass
class Row:
    name: str
    group: str  # which requests the numbers describe
    ttft_ms: Distribution | None
    itl_ms: Distribution | None
    itl_vs_alone: float | None = None  # the streams' mean ITL over that of the same tokens without the long prompt


def _request(corpus: TextCorpus, rid: str, prompt_len: int, output_len: int, arrival: float,
             rng: np.random.Generator, tenant: str = "default", kind: str = "") -> BenchRequest:
    text, ids = corpus.window(prompt_len, rng)
    return BenchRequest(rid, text, ids, output_len, arrival, kind=kind, tenant=tenant)


def chunked_prefill_workload(corpus: TextCorpus, rng: np.random.Generator, long_len: int = 2048,
                             num_streams: int = 16, num_short: int = 8,
                             stream_output_len: int = 160) -> list[BenchRequest]:
    """The streams must outlive the long prompt's prefill (stream_output_len) for its ITL rows to mean
    anything: a 16k prompt chunked finely takes thousands of steps."""
    streams = [_request(corpus, f"stream{i}", 32, stream_output_len, 0.0, rng, kind="stream")
               for i in range(num_streams)]
    long = [_request(corpus, "long", long_len, 8, 1.0, rng, kind="long")]
    shorts = [_request(corpus, f"short{i}", 32, 8, 1.0 + 0.1 * (i + 1), rng, kind="short") for i in range(num_short)]
    return streams + long + shorts


def fair_workload(corpus: TextCorpus, rng: np.random.Generator, with_heavy: bool, num_light: int = 16,
                  light_rate: float = 3.0, heavy_factor: int = 10) -> list[BenchRequest]:
    """At these rates the heavy tenant alone asks for more than the engine computes here: a
    backlog builds, and the policy decides who waits in it."""
    def tenant(name: str, n: int, rate: float) -> list[BenchRequest]:
        times = arrival_offsets(n, rate, 1.0, rng)
        return [_request(corpus, f"{name}{i}", 64, 32, t, rng, tenant=name, kind=name) for i, t in enumerate(times)]

    light = tenant("light", num_light, light_rate)
    heavy = tenant("heavy", num_light * heavy_factor, light_rate * heavy_factor) if with_heavy else []
    return light + heavy


def _rows(name: str, run, kinds: dict[str, str]) -> list[Row]:
    out = []
    for kind, what in kinds.items():
        metrics = [m for r, m in zip(run.requests, run.metrics) if r.kind == kind]
        ttft = Distribution.of([m.ttft for m in metrics], PERCENTILES) if what in ("ttft", "both") else None
        itl = Distribution.of([g for m in metrics for g in m.itl], PERCENTILES) if what in ("itl", "both") else None
        out.append(Row(name, kind, ttft, itl))
    return out


def stream_gaps(run, start: float = -np.inf, end: float = np.inf) -> dict[tuple[str, int], float]:
    """Each stream's gaps between tokens (seconds) that ended in (start, end], by (request id, token index)."""
    return {(r.request_id, i): after - before
            for r, m in zip(run.requests, run.metrics) if r.kind == "stream"
            for i, (before, after) in enumerate(zip(m.token_times, m.token_times[1:])) if start < after <= end}


def gaps_during_long_prefill(run) -> dict[tuple[str, int], float]:
    """The streams' gaps that ended while the long prompt was prefilled (its arrival to its first token)."""
    long = next(m for r, m in zip(run.requests, run.metrics) if r.kind == "long")
    return stream_gaps(run, long.arrival_time, long.first_token_time)


def _stream_rows(name: str, run, alone: dict[tuple[str, int], float]) -> list[Row]:
    """The same tokens of the same streams, run without the long prompt: a stream's step grows with its
    own context, so only the same token indices make a fair baseline."""
    during = gaps_during_long_prefill(run)
    baseline = [alone[key] for key in during]  # every key: the streams ignore EOS, so both runs have every token
    ratio = float(np.mean(list(during.values())) / np.mean(baseline)) if during and baseline else None
    return [Row(name, "stream, the same tokens alone", None, Distribution.of(baseline, PERCENTILES)),
            Row(name, "stream, during the long prefill", None, Distribution.of(list(during.values()), PERCENTILES),
                ratio)]


def chunked_prefill_settings(base: EngineConfig, budget: int, long_len: int = 2048,
                             thresholds: list[int] | None = None) -> dict[str, EngineConfig]:
    """Chunked with `budget` alone, then capped at each long-prefill threshold (default budget / 2: the
    long prompt's chunk leaves room for short prompts in every step, and the smaller the cap, the less
    a step beside the streams costs), then the whole prompt in one step."""
    settings = {f"chunked (budget {budget})": replace(base, enable_chunked_prefill=True,
                                                      max_num_batched_tokens=budget)}
    for threshold in thresholds or [budget // 2]:
        settings[f"chunked (budget {budget}, long-prefill threshold {threshold})"] = replace(
            base, enable_chunked_prefill=True, max_num_batched_tokens=budget,
            long_prefill_token_threshold=threshold)
    settings[f"not chunked (budget {long_len + 64})"] = replace(base, enable_chunked_prefill=False,
                                                                max_num_batched_tokens=long_len + 64)
    return settings


def fair_settings(base: EngineConfig) -> list[tuple[str, EngineConfig, bool]]:
    """(name, config, with the heavy tenant) of each fair-share run."""
    settings = []
    for policy in ("fair", "fcfs"):
        for with_heavy in (False, True):
            if policy == "fcfs" and not with_heavy:
                continue  # alone, every policy is the same
            # Few slots, so that the flood waits in the queue that the policy orders.
            config = replace(base, scheduling_policy=policy, max_num_seqs=min(base.max_num_seqs, FAIR_MAX_SEQS))
            settings.append((f"{policy}, light {'beside 10x heavy' if with_heavy else 'alone'}", config, with_heavy))
    return settings


def run_chunked_prefill(base: EngineConfig, corpus: TextCorpus, seed: int, budget: int, out_dir: str,
                        progress: bool, long_len: int = 2048, num_streams: int = 16,
                        stream_output_len: int = 160, thresholds: list[int] | None = None) -> list[Row]:
    requests = chunked_prefill_workload(corpus, np.random.default_rng(seed), long_len, num_streams,
                                        stream_output_len=stream_output_len)
    # Room for the long prompt and the streams, beyond the model's context if asked: timing is measured here.
    base = replace(base, max_model_len=max(base.max_model_len or 0, long_len + 64, stream_output_len + 64))
    settings = chunked_prefill_settings(base, budget, long_len, thresholds)
    streams = [r for r in requests if r.kind == "stream"]
    alone = stream_gaps(run_engine(next(iter(settings.values())), streams, f"{out_dir}/streams-alone.csv", progress))
    rows = []
    for i, (name, config) in enumerate(settings.items()):
        run = run_engine(config, requests, f"{out_dir}/chunked-prefill-{i}.csv", progress)
        rows += _rows(name, run, {"short": "ttft", "long": "ttft"}) + _stream_rows(name, run, alone)
    return rows


def run_fair(base: EngineConfig, corpus: TextCorpus, seed: int, out_dir: str, progress: bool,
             num_light: int = 16) -> list[Row]:
    rows = []
    for name, config, with_heavy in fair_settings(base):
        requests = fair_workload(corpus, np.random.default_rng(seed), with_heavy, num_light)
        run = run_engine(config, requests, f"{out_dir}/fair-{config.scheduling_policy}-{int(with_heavy)}.csv",
                         progress)
        rows += _rows(name, run, {"light": "ttft", "heavy": "ttft"} if with_heavy else {"light": "ttft"})
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| setting | requests | TTFT P50 ms | TTFT P99 ms | ITL P50 ms | ITL P99 ms | ITL max ms | ITL mean / alone |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(d: Distribution | None, p: float) -> str:
        return "" if d is None else f"{d.p(p):.0f}"

    for r in rows:
        itl_max = "" if r.itl_ms is None else f"{r.itl_ms.percentiles.get(100, 0):.0f}"
        lines.append(f"| {r.name} | {r.group} | {cell(r.ttft_ms, 50)} | {cell(r.ttft_ms, 99)} | "
                     f"{cell(r.itl_ms, 50)} | {cell(r.itl_ms, 99)} | {itl_max} | "
                     f"{'' if r.itl_vs_alone is None else f'{r.itl_vs_alone:.2f}x'} |")
    return "\n".join(lines)
