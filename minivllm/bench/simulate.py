"""`minivllm bench simulate`: the real engine (LLMEngine.step, Scheduler, BlockManager, policies, the
static scheduler) on a virtual clock, with a cost model in place of the model.

Only two parts are swapped, through the engine's injection points: the runner advances the virtual
clock by the cost model's time for the step, and the sampler emits a fixed non-EOS token, so that a
request's output length is the workload's (`max_tokens` with `ignore_eos`). There is no tokenizer:
prompts are token ids and no text is made. A cluster is N such engines behind a router policy
(minivllm/router/policies.py), advanced in time order.
"""
from __future__ import annotations

import contextlib
import gc
import heapq
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

import numpy as np
from tqdm import tqdm

from minivllm.bench.compare import SystemRun, SystemSummary, replay_engine
from minivllm.bench.cost_model import CostModel, StepHistory, StepShape
from minivllm.bench.workloads import BenchRequest
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor import ModelParts
from minivllm.model.batch import BatchInputs, SamplingRow
from minivllm.model.build import num_kv_blocks
from minivllm.model.model_config import ModelConfig
from minivllm.model.sampler import SamplerOutput
from minivllm.outputs import RequestMetrics
from minivllm.router.policies import Router
from minivllm.tracing.trace import StepTracer, run_record


class VirtualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class StepNoise:
    """Draws a step's jitter: one of a calibration's quantiles of measured / fitted step time (mean 1)."""

    def __init__(self, ratios: list[float], seed: str) -> None:
        self.ratios, self.rng = ratios, random.Random(seed)

    def __call__(self) -> float:
        return self.rng.choice(self.ratios)


class CostRunner:
    """Stands in for ModelRunner: a step costs what the cost model says, on the virtual clock (with
    what it follows: the first step after the engine slept costs its wake-up too), times a drawn
    jitter where the simulation has step noise."""

    def __init__(self, cost: CostModel, clock: VirtualClock, noise: StepNoise | None) -> None:
        self.cost, self.clock, self.history, self.noise = cost, clock, StepHistory(clock), noise
        self.prepare_time = 0.0  # the engine's step breakdown reads it

    def stats(self) -> dict:
        return {}

    def execute(self, batch: BatchInputs) -> None:
        seconds = self.cost.step_time(self.history.starting(batch))
        self.clock.sleep(seconds * self.noise() if self.noise else seconds)
        self.history.ended()


class FixedTokenSampler:
    """One token that is not EOS for every sequence: lengths come from the requests' max_tokens."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.token = next(t for t in range(model_config.vocab_size) if t not in model_config.eos_token_ids)

    def __call__(self, _logits: None, rows: list[SamplingRow]) -> SamplerOutput:
        return SamplerOutput([self.token] * len(rows), [None] * len(rows))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """A simulation makes millions of short-lived objects, freed by reference counting, while the
    finished requests' metrics and the step rows pile up: the cyclic collector's passes over that
    pile cost about a sixth of the run and free nothing, so it waits until the end."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulated_engine(config: EngineConfig, model_config: ModelConfig, cost: CostModel,
                     trace_path: str | None = None, noise: StepNoise | None = None) -> tuple[LLMEngine, VirtualClock]:
    clock = VirtualClock()
    parts = ModelParts(model_config, None, CostRunner(cost, clock, noise), FixedTokenSampler(model_config),
                       num_kv_blocks(config, model_config, config.torch_dtype))
    engine = LLMEngine(config, parts=parts, clock=clock)
    engine.tracer = StepTracer(trace_path, engine.start_time, run_record(config))  # rows in memory; files with a path
    return engine, clock


def noise_for(cost: CostModel, seed: int | None, replica: int = 0) -> StepNoise | None:
    """The noise of a simulation seeded `seed` (None: none), for one of its replicas."""
    return None if seed is None else StepNoise(cost.noise, f"{seed}-{replica}")


def simulate_engine(config: EngineConfig, requests: list[BenchRequest], model_config: ModelConfig,
                    cost: CostModel, trace_path: str | None = None, show_progress: bool = True,
                    noise_seed: int | None = None) -> SystemRun:
    """One engine: bench compare's replay loop, on the virtual clock."""
    engine, clock = simulated_engine(config, model_config, cost, trace_path, noise_for(cost, noise_seed))
    try:
        with collector_paused():
            return replay_engine(engine, requests, config.scheduler, show_progress, sleep=clock.sleep)
    finally:
        engine.close()


def simulate_cluster(config: EngineConfig, requests: list[BenchRequest], model_config: ModelConfig,
                     cost: CostModel, num_replicas: int, routing: str, trace_dir: str | None = None,
                     show_progress: bool = True, noise_seed: int | None = None) -> SystemRun:
    """N engines behind a router. Events run in time order: an arrival is routed (on the load the
    router has booked) before any replica's step that starts later; else the replica whose next
    step starts first takes it."""
    if num_replicas == 1:
        return simulate_engine(config, requests, model_config, cost,
                               trace_dir and f"{trace_dir}/{config.scheduler}.csv", show_progress, noise_seed)
    engines = [simulated_engine(config, model_config, cost, trace_dir and f"{trace_dir}/{config.scheduler}-{i}.csv",
                                noise_for(cost, noise_seed, i))
               for i in range(num_replicas)]
    args = {"block_size": config.block_size} if routing == "prefix-aware" else {}
    router = Router.create(routing, [f"replica-{i}" for i in range(num_replicas)], **args)
    pending = sorted(requests, key=lambda r: r.arrival)
    busy: list[tuple[float, int]] = []  # (when its next step starts, replica) of replicas with work
    router_seconds = 0.0  # real time in the router's calls: how far one router core goes
    done: dict[str, RequestMetrics] = {}
    bar = tqdm(total=len(requests), desc=f"{config.scheduler} x{num_replicas}", disable=not show_progress,
               dynamic_ncols=True)
    i = 0
    with collector_paused():
        while i < len(pending) or busy:
            if busy and (i == len(pending) or busy[0][0] < pending[i].arrival):
                _, r = heapq.heappop(busy)
                engine, clock = engines[r]
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.metrics
                        start = time.perf_counter()
                        router.finished(out.request_id)
                        router_seconds += time.perf_counter() - start
                        bar.update(1)
                if engine.has_unfinished_requests():
                    heapq.heappush(busy, (clock.now, r))
                continue
            req = pending[i]
            i += 1
            start = time.perf_counter()
            r = router.route(req.request_id, req.prompt_token_ids, req.output_len)
            router_seconds += time.perf_counter() - start
            engine, clock = engines[r]
            if not engine.has_unfinished_requests():  # idle until now
                clock.now = max(clock.now, req.arrival)
                heapq.heappush(busy, (clock.now, r))
            engine.add_request(req.request_id, req.prompt_token_ids, req.sampling_params(), arrival_time=req.arrival,
                               priority=req.priority, tenant=req.tenant)
    bar.close()
    rows = []
    for engine, _ in engines:
        rows += engine.tracer.rows
        engine.close()
    rows.sort(key=lambda row: row.t_start)
    return SystemRun(config.scheduler, requests, [done[r.request_id] for r in requests], rows, 0.0, router_seconds)


@dataclass
class SloSearch:
    target_ms: float
    tried: dict[int, float]  # replicas -> P99 TTFT (ms)
    replicas: int | None  # the fewest that meet the target; None: not within the maximum


def replicas_for_ttft(run_with, target_ms: float, max_replicas: int) -> SloSearch:
    """The fewest replicas whose P99 TTFT is within `target_ms`: doubling, then bisection (more
    replicas never hurt TTFT much under these routers, so the search assumes it is monotone)."""
    from minivllm.bench.compare import summarize

    tried: dict[int, float] = {}

    def meets(n: int) -> bool:
        if n not in tried:
            tried[n] = summarize(run_with(n)).serving.ttft_ms.p(99)
        return tried[n] <= target_ms

    low, high = 0, 1  # low fails (0 replicas serve nothing), high is the candidate
    while not meets(high):
        if high >= max_replicas:
            return SloSearch(target_ms, tried, None)
        low, high = high, min(2 * high, max_replicas)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if meets(mid) else (mid, high)
    return SloSearch(target_ms, dict(sorted(tried.items())), high)


def slo_text(search: SloSearch, label: str) -> str:
    lines = [f"Replicas for P99 TTFT <= {search.target_ms:g} ms ({label}):",
             *(f"  {n:>4} replicas: P99 TTFT {p99:,.0f} ms {'ok' if p99 <= search.target_ms else ''}"
               for n, p99 in search.tried.items())]
    lines.append(f"-> {search.replicas} replicas" if search.replicas else
                 f"-> not met with up to {max(search.tried)} replicas")
    return "\n".join(lines)


# -- validation: predicted against measured on this machine -------------------------------------------
@dataclass
class Validation:
    """One workload and setting: each real run's figures (their median and range are the measured
    side), the median and range of the simulations with step noise, and the simulation without noise."""
    workload: str
    setting: str
    measured_runs: dict[str, list[float]]  # each real run's figure, in the runs' order
    predicted: dict[str, float]
    predicted_range: dict[str, tuple[float, float]]
    predicted_without_noise: dict[str, float]  # each step at the model's time
    steps_vs_model: list[float]  # per real run: its steps' measured time / the model's time for them, - 1

    @property
    def measured(self) -> dict[str, float]:
        return _medians(self.measured_runs)

    @property
    def measured_range(self) -> dict[str, tuple[float, float]]:
        return _ranges(self.measured_runs)

    @property
    def errors(self) -> dict[str, float]:
        return {k: (self.predicted[k] - v) / v if v else 0.0 for k, v in self.measured.items()}

    def in_range(self, key: str) -> bool:
        low, high = self.measured_range[key]
        return low <= self.predicted[key] <= high

    def to_dict(self) -> dict:
        return asdict(self) | {"measured": self.measured, "measured_range": self.measured_range,
                               "errors": self.errors}


TOLERANCE = 0.10  # the validation's target: every cell within 10 % of the real runs' median


VALIDATED = {"throughput (tok/s)": lambda s: s.serving.total_token_throughput,
             "TTFT P50 (ms)": lambda s: s.serving.ttft_ms.p(50), "TTFT P99 (ms)": lambda s: s.serving.ttft_ms.p(99),
             "TPOT P50 (ms)": lambda s: s.serving.tpot_ms.p(50)}


# Simulations with step noise per validated setting: their median is the prediction. Medians of 21
# moved between seed sets by a few percent (compare static TTFT P50: 525-559 ms over five sets; at
# most 9 %, compare continuous TTFT P99: 462-504 ms); the 189 simulations of `--validate all` take
# about 5 s here.
NOISY_SIMULATIONS = 21


Case = tuple[str, str, EngineConfig, list[BenchRequest]]  # workload, setting, engine config, requests


@dataclass
class RealRun:
    summary: SystemSummary
    shapes: list[StepShape]  # each step's, noted as it ran
    step_seconds: float  # the steps' measured time, summed

    def steps_vs_model(self, cost: CostModel) -> float:
        """The steps' measured time against the cost model's time for those very steps, - 1: how fast
        the machine ran then, against its calibration. The model fits its calibration's steps to within
        a few percent of their total, so where this is far from 0 the machine itself ran faster or
        slower than when it was calibrated."""
        return self.step_seconds / sum(cost.step_time(shape) for shape in self.shapes) - 1


def measure(cases: list[Case], out_dir: str, show_progress: bool, repeats: int = 1,
            before_round: Callable[[], None] | None = None) -> list[list[RealRun]]:
    """Each case's `repeats` real runs. The repeats go round the cases (every case once, then again),
    so that a slow spell of the machine, which lasts tens of seconds here, slows one run of several
    cases rather than every run of one; `before_round` runs before each round (a round of
    calibration, when the profile is measured in the same sitting)."""
    reals: list[list[RealRun]] = [[] for _ in cases]
    for r in range(repeats):
        if before_round:
            before_round()
        for i, (_, _, config, requests) in enumerate(cases):
            reals[i].append(_real_run(config, requests, f"{out_dir}/measured-{i}{f'-{r}' if r else ''}.csv",
                                      show_progress))
    return reals


def predict(cases: list[Case], reals: list[list[RealRun]], model_config: ModelConfig, cost: CostModel,
            out_dir: str, show_progress: bool) -> list[Validation]:
    """Each case simulated NOISY_SIMULATIONS times with step noise (seeds 0, 1, ...) and once without,
    beside its real runs.

    Medians meet medians. One real run on a shared 2-core machine moves by 10-20 %, so the measured
    figure is the median of several. Its steps jitter too, and near capacity a queue feels the spread,
    not only the mean: a model that gives each step its mean time predicts shorter queues than the
    machine has. So the prediction is the median of simulations whose steps spread as calibration
    measured them."""
    from minivllm.bench.compare import summarize

    results = []
    for i, ((workload, setting, config, requests), runs) in enumerate(zip(cases, reals)):
        plain = summarize(simulate_engine(config, requests, model_config, cost, f"{out_dir}/predicted-{i}.csv",
                                          show_progress))
        sims = [summarize(simulate_engine(config, requests, model_config, cost, None, False, seed))
                for seed in range(NOISY_SIMULATIONS)]
        measured = {k: [f(run.summary) for run in runs] for k, f in VALIDATED.items()}
        predictions = {k: [f(summary) for summary in sims] for k, f in VALIDATED.items()}
        results.append(Validation(workload, setting, measured, _medians(predictions), _ranges(predictions),
                                  {k: f(plain) for k, f in VALIDATED.items()},
                                  [run.steps_vs_model(cost) for run in runs]))
    return results


def perfect_prediction(results: list[Validation], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """What a prediction equal to each cell's true median would score against real runs as spread as
    these: each setting's runs drawn again (as many, with replacement), each cell's median of the draw
    set against the median of all its runs. Returns the cells within TOLERANCE, on average over the
    draws, and the share of draws with every cell within. On a noisy machine a cell's median of a few
    runs moves by more than the tolerance, and no model can meet it more often than this. A generous
    bound: the runs at hand stand in for every run the machine could make."""
    rng = np.random.default_rng(seed)
    met = np.zeros(resamples, dtype=int)
    for v in results:
        runs = np.array([v.measured_runs[k] for k in VALIDATED]).T  # runs x metrics
        medians = np.median(runs[rng.integers(0, len(runs), (resamples, len(runs)))], axis=1)
        met += (np.abs(medians / np.median(runs, axis=0) - 1) <= TOLERANCE).sum(axis=1)
    return float(met.mean()), float(np.mean(met == len(results) * len(VALIDATED)))


def _medians(values: dict[str, list[float]]) -> dict[str, float]:
    return {k: float(np.median(v)) for k, v in values.items()}


def _ranges(values: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    return {k: (min(v), max(v)) for k, v in values.items()}


def _real_run(config: EngineConfig, requests: list[BenchRequest], trace_path: str, show_progress: bool) -> RealRun:
    from minivllm.bench.calibrate import ShapeRecorder
    from minivllm.bench.compare import run_engine, summarize

    recorders: list[ShapeRecorder] = []

    def record(runner) -> ShapeRecorder:
        recorders.append(ShapeRecorder(runner))
        return recorders[-1]

    run = run_engine(config, requests, trace_path, show_progress, wrap_runner=record)
    return RealRun(summarize(run), recorders[0].shapes, sum(row.t_end - row.t_start for row in run.rows))


def validation_table(results: list[Validation], perfect: tuple[float, float]) -> str:
    """Markdown: measured / predicted (error) per cell, with the simulations' range; with several real
    runs, their range, and a * where the prediction lies inside it, and what a perfect prediction
    would score (`perfect`, from perfect_prediction); then how the real runs' steps compared with the
    model's time for them."""
    ranged = any(lo != hi for v in results for lo, hi in v.measured_range.values())
    head = " | ".join(f"{k} measured{' [range]' if ranged else ''} / predicted [range] (error)" for k in VALIDATED)
    lines = [f"| workload | setting | {head} | real steps vs model |", "|---|---|" + "---:|" * (len(VALIDATED) + 1)]
    for v in results:
        cells = []
        for k in VALIDATED:
            lo, hi = v.measured_range[k]
            spread = f" [{lo:,.1f}-{hi:,.1f}]" if ranged else ""
            star = "*" if ranged and v.in_range(k) else ""
            plo, phi = v.predicted_range[k]
            cells.append(f"{v.measured[k]:,.1f}{spread} / {v.predicted[k]:,.1f} [{plo:,.1f}-{phi:,.1f}] "
                         f"({v.errors[k]:+.0%}){star}")
        steps = v.steps_vs_model
        cells.append(f"{np.median(steps):+.0%}" + (f" [{min(steps):+.0%}..{max(steps):+.0%}]" if len(steps) > 1 else ""))
        lines.append(f"| {v.workload} | {v.setting} | {' | '.join(cells)} |")
    errors = [abs(e) for v in results for e in v.errors.values()]
    within = sum(e <= TOLERANCE for e in errors)
    lines.append(f"\nLargest error: {max(errors, default=0.0):.0%}; {within} of {len(errors)} cells within 10 % "
                 "(target: all)")
    if ranged:
        cells, every = perfect
        lines.append(f"a perfect prediction, against runs as spread as these: {cells:.1f} cells within 10 % on "
                     f"average, all of them in {every:.0%} of draws (the real runs drawn again)")
    lines.append(f"predicted: the median of {NOISY_SIMULATIONS} simulations with step noise [their range]")
    if ranged:
        lines.append("*: the prediction lies within the real runs' range")
    lines.append("real steps vs model: each real run's steps took this much more (+) or less (-) time than the "
                 "model gives for the same steps: the machine's speed then, against its calibration")
    return "\n".join(lines)


def validation_cases(base: EngineConfig, compare_requests: list[BenchRequest], corpus, seed: int,
                     which: list[str]) -> list[Case]:
    """bench compare's workload (static and continuous), the fixed workload (all at once), and
    bench scheduling's two scenarios with their settings."""
    from minivllm.bench.scheduling import (chunked_prefill_settings, chunked_prefill_workload, fair_settings,
                                           fair_workload)
    from minivllm.bench.workloads import FIXED, random_requests

    cases = []
    if "compare" in which:
        cases += [("compare", s, replace(base, scheduler=s), compare_requests) for s in ("static", "continuous")]
    if "fixed" in which:
        fixed = random_requests(corpus, FIXED["num_prompts"], FIXED["input_len_range"], FIXED["output_len_range"],
                                np.random.default_rng(FIXED["seed"]))
        cases.append(("fixed", "continuous, all at once", base, fixed))
    if "chunked-prefill" in which:
        requests = chunked_prefill_workload(corpus, np.random.default_rng(seed))
        cases += [("chunked-prefill", name, c, requests) for name, c in chunked_prefill_settings(base, 256).items()]
    if "fair" in which:
        cases += [("fair", name, c, fair_workload(corpus, np.random.default_rng(seed), heavy))
                  for name, c, heavy in fair_settings(base)]
    return cases

