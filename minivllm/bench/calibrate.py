"""`minivllm bench calibrate`: time real engine steps of known shapes on this machine and model, and
fit the simulator's linear cost model (cost_model.LinearCost) to them.

A probe is a batch of requests. Arriving together, its steps sweep prefill chunks, then decodes over
a context that grows every step; a static-batching probe, of drawn lengths, pads its prompts and then
keeps its finished members' slots computing beside the live ones. Arriving one every few steps
(`stagger`), with lengths drawn below the probe's, its steps mix prefill chunks of several sizes with
decodes at spread-out contexts: the steps that serving traffic runs, which batches that arrive
together never show. What is timed is the whole `LLMEngine.step()` (schedule, inputs, forward,
sampling, update), which is what a step costs a served request. The fit's error is reported on the
steps it was fitted to and, more honestly, on each probe's steps predicted by a fit to the others.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

import numpy as np
from tqdm import tqdm

from minivllm.bench.cost_model import (INTERFERED, WAKE_AFTER_S, FitError, LinearCost, StepHistory, StepShape,
                                       fit_linear, held_out_error, step_noise)
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.batch import BatchInputs
from minivllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class Probe:
    num_seqs: int
    prompt_len: int
    output_len: int
    static: bool = False  # static batching: prompt and output lengths drawn, padded
    stagger: int = 0  # > 0: one request every `stagger` steps, lengths drawn in [1/4, 1] of the probe's
    max_num_batched_tokens: int | None = None  # a budget of its own: chunks beside decodes at long contexts
    idle: float = 0.0  # > 0: each request alone, after the engine sat idle up to this long; lengths drawn


# (sequences, prompt tokens, output tokens): prefill sizes from a few tokens to a full budget, decode
# batches from 1 to 64 at short and long contexts (the small ones, which serving at a low rate runs
# most, over many steps), static batches whose finished members pad the decode steps, then staggered
# arrivals (mixed steps), then requests that each meet an idle engine (a light load's steps).
GRIDS = {
    "default": [Probe(1, 16, 24), Probe(1, 512, 24), Probe(1, 2000, 8), Probe(4, 256, 48), Probe(8, 64, 64),
                Probe(16, 128, 64), Probe(32, 32, 48), Probe(64, 16, 32), Probe(16, 1000, 32), Probe(64, 200, 24),
                Probe(2, 384, 128), Probe(6, 96, 128),
                Probe(8, 200, 48, static=True), Probe(4, 480, 32, static=True), Probe(10, 300, 160, static=True),
                Probe(24, 96, 64, static=True),
                Probe(24, 128, 64, stagger=3), Probe(16, 512, 160, stagger=8), Probe(40, 256, 96, stagger=2),
                Probe(12, 1024, 64, stagger=6, max_num_batched_tokens=256),
                Probe(8, 1536, 48, stagger=4, max_num_batched_tokens=128),
                Probe(16, 256, 8, idle=0.5)],
    "tiny": [Probe(1, 16, 4), Probe(4, 64, 6), Probe(3, 40, 4, static=True),
             Probe(4, 48, 6, stagger=2, max_num_batched_tokens=16), Probe(3, 32, 3, idle=0.05)],
}


# Run before timing, so that one-time setup is not a step's cost. The default grid's is a batch of
# prefills and decodes: with one 16-token request as the warm-up (2026-11-30), the first probes ran
# 20-37 % slower on the first pass over the grid than on the second.
WARM_UPS = {"default": Probe(8, 256, 8), "tiny": Probe(1, 16, 2)}


class ShapeRecorder:
    """Wraps the engine's runner to note the shape of each step it runs, with what it follows."""

    def __init__(self, runner) -> None:
        self.runner, self.history = runner, StepHistory(time.perf_counter)
        self.shapes: list[StepShape] = []

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, batch: BatchInputs):
        self.shapes.append(self.history.starting(batch))
        try:
            return self.runner.execute(batch)
        finally:
            self.history.ended()


def _requests(probe: Probe, vocab: int, rng: np.random.Generator) -> list[tuple[list[int], SamplingParams]]:
    """Static, staggered and idle probes draw lengths (so that a batch pads, and contexts and prefills
    spread); the rest are exactly the probe's."""
    drawn = probe.static or probe.stagger or probe.idle
    requests = []
    for _ in range(probe.num_seqs):
        n = int(rng.integers(probe.prompt_len // 4, probe.prompt_len + 1)) if drawn else probe.prompt_len
        out = int(rng.integers(max(1, probe.output_len // 4), probe.output_len + 1)) if drawn else probe.output_len
        requests.append((rng.integers(0, vocab, n).tolist(),
                         SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True,
                                        output_kind=RequestOutputKind.FINAL_ONLY)))
    return requests


def _num_arriving(probe: Probe, engine: LLMEngine, step: int, num_pending: int) -> int:
    """How many of the probe's pending requests arrive before this step."""
    idle = not engine.has_unfinished_requests()
    if probe.idle:  # one at a time, each to an idle engine
        return int(idle)
    if probe.stagger:  # one every `stagger` steps, and one at once when the engine would idle
        return int(step % probe.stagger == 0 or idle)
    return num_pending  # all at once


def run_probe(engine: LLMEngine, probe: Probe, rng: np.random.Generator) -> tuple[list[StepShape], list[float]]:
    pending = _requests(probe, engine.model_config.vocab_size, rng)
    recorder = ShapeRecorder(engine.runner)
    engine.runner = recorder
    seconds = []
    step = 0
    try:
        while pending or engine.has_unfinished_requests():
            arriving = min(len(pending), _num_arriving(probe, engine, step, len(pending)))
            if probe.idle and arriving:
                time.sleep(float(rng.uniform(2 * WAKE_AFTER_S, probe.idle)))
            for _ in range(arriving):
                prompt, params = pending.pop(0)
                engine.add_request(f"probe-{len(pending)}", prompt, params)
            step += 1
            num_recorded = len(recorder.shapes)
            start = time.perf_counter()
            engine.step()
            if len(recorder.shapes) > num_recorded:  # a step that ran the model (one with nothing to run does not)
                seconds.append(time.perf_counter() - start)
    finally:
        engine.runner = recorder.runner
    return recorder.shapes, seconds


@dataclass
class Calibration:
    cost: LinearCost
    fit_error: FitError  # on the steps it was fitted to
    held_out_error: FitError  # each probe's steps, predicted by a fit to the other probes
    steps: list[tuple[int, StepShape, float]]  # (probe, shape, seconds) of every measured step
    num_interfered: int  # steps left out of the fit and its errors: slowed by something else

    def steps_dict(self) -> dict:
        """The measured steps, columns and rows, so that a profile can be refitted or checked later."""
        names = [f.name for f in fields(StepShape)]
        return {"columns": ["probe", *names, "seconds"],
                "rows": [[p, *(getattr(s, n) for n in names), t] for p, s, t in self.steps]}


class Calibrator:
    """Runs the grid's probes, a round (every probe once) at a time, and fits the profile to all the
    rounds run. `bench simulate --validate` can put its real runs between the rounds, so that the
    machine's drift over a sitting falls on the calibration and on the runs alike."""

    def __init__(self, config: EngineConfig, grid: str) -> None:
        self.config, self.probes = config, GRIDS[grid]
        self.budget = max(config.max_num_batched_tokens, max(p.prompt_len for p in self.probes))
        self.engines = {static: LLMEngine(replace(config, scheduler="static" if static else "continuous",
                                                  static_batch_size=max(p.num_seqs for p in self.probes),
                                                  max_num_batched_tokens=self.budget))
                        for static in {p.static for p in self.probes}}
        self.rng = np.random.default_rng(0)
        for engine in self.engines.values():
            run_probe(engine, WARM_UPS[grid], self.rng)
        self.groups = [([], []) for _ in self.probes]  # per probe (its rounds together): shapes, seconds

    def run_round(self, show_progress: bool) -> None:
        for probe, (shapes, seconds) in tqdm(list(zip(self.probes, self.groups)), desc="calibrating",
                                             disable=not show_progress):
            engine = self.engines[probe.static]
            # The scheduler reads its budget every step: a probe with a budget of its own swaps it in.
            engine.scheduler.config = replace(engine.config,
                                              max_num_batched_tokens=probe.max_num_batched_tokens or self.budget)
            s, t = run_probe(engine, probe, self.rng)
            shapes.extend(s)
            seconds.extend(t)

    def finish(self) -> Calibration:
        """The fit to every round, its errors and its noise; the engines are closed."""
        groups = self.groups
        shapes = [s for g in groups for s in g[0]]
        seconds = [t for g in groups for t in g[1]]
        engine = next(iter(self.engines.values()))
        cost = LinearCost(fit_linear(shapes, seconds),
                          f"calibrated: {self.config.model or 'SmolLM2-135M-Instruct (default GGUF)'} on "
                          f"{engine.device_name}, {str(engine.dtype).removeprefix('torch.')}")
        for engine in self.engines.values():
            engine.close()
        # The errors are on the steps the fit kept: a step slowed by something else is no shape's cost.
        clean = []
        for g in groups:
            kept = [(s, t) for s, t in zip(*g) if t <= INTERFERED * cost.step_time(s)]
            clean.append(([s for s, _ in kept], [t for _, t in kept]))
        kept_shapes, kept_seconds = [s for g in clean for s in g[0]], [t for g in clean for t in g[1]]
        fitted = [cost.step_time(s) for s in kept_shapes]
        cost.noise = step_noise(fitted, kept_seconds)
        return Calibration(cost, FitError.of(fitted, kept_seconds), held_out_error([g for g in clean if g[0]]),
                           [(i, s, t) for i, g in enumerate(groups) for s, t in zip(*g)],
                           len(seconds) - len(kept_seconds))


def calibrate(config: EngineConfig, grid: str, repeats: int, show_progress: bool) -> Calibration:
    calibrator = Calibrator(config, grid)
    for _ in range(repeats):
        calibrator.run_round(show_progress)
    return calibrator.finish()
