"""`minivllm bench scheduling`: the scheduler's trade-offs, measured on the real model.

chunked-prefill: 16 streams are decoding when a 2,048-token prompt arrives, and short requests
    (32-token prompts) arrive while it is prefilled. Chunked prefill (a small token budget) against
    no chunking (the whole prompt in one step): TTFT of the short requests, inter-token latency
    of the 16 streams.
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


def _request(corpus: TextCorpus, rid: str, prompt_len: int, output_len: int, arrival: float,
             rng: np.random.Generator, tenant: str = "default", kind: str = "") -> BenchRequest:
    text, ids = corpus.window(prompt_len, rng)
    return BenchRequest(rid, text, ids, output_len, arrival, kind=kind, tenant=tenant)


def chunked_prefill_workload(corpus: TextCorpus, rng: np.random.Generator, long_len: int = 2048,
                             num_streams: int = 16, num_short: int = 8) -> list[BenchRequest]:
    streams = [_request(corpus, f"stream{i}", 32, 160, 0.0, rng, kind="stream") for i in range(num_streams)]
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


def chunked_prefill_settings(base: EngineConfig, budget: int, long_len: int = 2048) -> dict[str, EngineConfig]:
    return {
        f"chunked (budget {budget})": replace(base, enable_chunked_prefill=True, max_num_batched_tokens=budget),
        # The long prompt's chunk is capped, so that short prompts share every step's budget.
        f"chunked (budget {budget}, long-prefill threshold {budget // 2})": replace(
            base, enable_chunked_prefill=True, max_num_batched_tokens=budget,
            long_prefill_token_threshold=budget // 2),
        f"not chunked (budget {long_len + 64})": replace(base, enable_chunked_prefill=False,
                                                       max_num_batched_tokens=long_len + 64),
    }


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
                        progress: bool, long_len: int = 2048, num_streams: int = 16) -> list[Row]:
    requests = chunked_prefill_workload(corpus, np.random.default_rng(seed), long_len, num_streams)
    rows = []
    for i, (name, config) in enumerate(chunked_prefill_settings(base, budget, long_len).items()):
        run = run_engine(config, requests, f"{out_dir}/chunked-prefill-{i}.csv", progress)
        rows += _rows(name, run, {"short": "ttft", "stream": "itl"})
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
    lines = ["| setting | requests | TTFT P50 ms | TTFT P99 ms | ITL P50 ms | ITL P99 ms | ITL max ms |",
             "|---|---|---|---|---|---|---|"]

    def cell(d: Distribution | None, p: float) -> str:
        return "" if d is None else f"{d.p(p):.0f}"

    for r in rows:
        itl_max = "" if r.itl_ms is None else f"{r.itl_ms.percentiles.get(100, 0):.0f}"
        lines.append(f"| {r.name} | {r.group} | {cell(r.ttft_ms, 50)} | {cell(r.ttft_ms, 99)} | "
                     f"{cell(r.itl_ms, 50)} | {cell(r.itl_ms, 99)} | {itl_max} |")
    return "\n".join(lines)
