"""`minivllm bench calibrate`: time real engine steps of known shapes on this machine and model, and
fit the simulator's linear cost model (cost_model.LinearCost) to them.

Each probe is a batch of requests that arrive together: its steps sweep prefill chunks, then
decodes over a context that grows every step. A static-batching probe adds padding. What is timed
is the whole `LLMEngine.step()` (schedule, inputs, forward, sampling, update), which is what a step
costs a served request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from tqdm import tqdm

from minivllm.bench.cost_model import LinearCost, StepShape, fit_linear
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.scheduler import SchedulerOutput
from minivllm.sampling_params import SamplingParams


@dataclass
class Probe:
    num_seqs: int
    prompt_len: int
    output_len: int
    static: bool = False  # static batching: prompts of mixed lengths, padded


# (sequences, prompt tokens, output tokens): prefill sizes from a few tokens to a full budget, decode
# batches from 1 to 64 at short and long contexts.
GRIDS = {
    "default": [Probe(1, 16, 24), Probe(1, 512, 24), Probe(1, 2000, 8), Probe(4, 256, 48), Probe(8, 64, 64),
                Probe(16, 128, 64), Probe(32, 32, 48), Probe(64, 16, 32), Probe(16, 1000, 32), Probe(64, 200, 24),
                Probe(8, 200, 48, static=True)],
    "tiny": [Probe(1, 16, 4), Probe(4, 64, 6), Probe(3, 40, 4, static=True)],
}


class ShapeRecorder:
    """Wraps the engine's runner to note the shape of each step it runs."""

    def __init__(self, runner) -> None:
        self.runner, self.shape = runner, None

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, sched: SchedulerOutput):
        self.shape = StepShape.of(sched)
        return self.runner.execute(sched)


def run_probe(engine: LLMEngine, probe: Probe, rng: np.random.Generator) -> tuple[list[StepShape], list[float]]:
    vocab = engine.model_config.vocab_size
    for i in range(probe.num_seqs):
        # Static probes mix lengths so that the batch pads; the rest are exactly probe.prompt_len.
        n = int(rng.integers(probe.prompt_len // 4, probe.prompt_len + 1)) if probe.static else probe.prompt_len
        engine.add_request(f"probe-{i}", rng.integers(0, vocab, n).tolist(),
                           SamplingParams(max_tokens=probe.output_len, temperature=0.0, ignore_eos=True))
    recorder = ShapeRecorder(engine.runner)
    engine.runner = recorder
    shapes, seconds = [], []
    try:
        while engine.has_unfinished_requests():
            recorder.shape = None
            start = time.perf_counter()
            engine.step()
            if recorder.shape is not None:
                shapes.append(recorder.shape)
                seconds.append(time.perf_counter() - start)
    finally:
        engine.runner = recorder.runner
    return shapes, seconds


def calibrate(config: EngineConfig, grid: str, repeats: int, show_progress: bool) -> tuple[LinearCost, float, int]:
    """(the fitted cost model, its median relative error on the measured steps, steps measured)."""
    probes = GRIDS[grid]
    budget = max(config.max_num_batched_tokens, max(p.prompt_len for p in probes))
    engines = {static: LLMEngine(replace(config, scheduler="static" if static else "continuous",
                                         static_batch_size=max(p.num_seqs for p in probes),
                                         max_num_batched_tokens=budget, enable_prefix_caching=False))
               for static in {p.static for p in probes}}
    rng = np.random.default_rng(0)
    for engine in engines.values():  # warm-up: one-time setup is not a step's cost
        run_probe(engine, Probe(1, 16, 2), rng)
    shapes, seconds = [], []
    for probe in tqdm(probes * repeats, desc="calibrating", disable=not show_progress):
        s, t = run_probe(engines[probe.static], probe, rng)
        shapes += s
        seconds += t
    coefficients, error = fit_linear(shapes, seconds)
    engine = next(iter(engines.values()))
    label = (f"calibrated: {config.model or 'SmolLM2-135M-Instruct (default GGUF)'} on {engine.device_name}, "
             f"{str(engine.dtype).removeprefix('torch.')}")
    for engine in engines.values():
        engine.close()
    return LinearCost(coefficients, label), error, len(shapes)
