"""`minivllm bench latency`: one batch, as vLLM's `bench latency` runs it: --batch-size prompts of
--input-len tokens each generate --output-len tokens, all started together. Reports the batch's
latency and, once every prompt is in, the decode step: its time at this batch size and context, and
the engine's own split of it (schedule, input preparation, forward, sampling, update); with
--tensor-parallel-size, also the share of rank 0's all_reduces (in the forward) and of sending each
step's inputs to the workers (in the preparation).

Two rates come out of one batch: the decode step's (the batch decoding, nothing else) and the whole
batch's (its output tokens over its latency, prefill included). `bench serve --max-concurrency B` at
the same lengths runs the batch in waves, each prefilled before it decodes, so the whole batch's rate
is the most a server can stream there (on the 2-core machine of BENCHMARKS.md, at 12 x 64/256 tokens,
91-92 % of the decode step's)."""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass, replace

import numpy as np

from minivllm.bench.compare import warm_up
from minivllm.bench.throughput import same_outputs, spec_text
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.extension import spec_decode_stats


@dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    latencies: list[float]  # seconds per iteration: the whole batch, first prefill to last token
    decode_step_ms: float  # mean over the steps in which every sequence decodes
    decode_steps: int
    step_time_shares: dict[str, float]  # of those decode steps
    prefill_seconds: list[float]  # per iteration: until every sequence has its first token
    weight_bytes_held: int  # the model's weights as held in memory (packed quantized weights at their size)
    peak_rss_bytes: int  # of this process, at the end
    # Speculative decoding: over the measured iterations; greedy_exact: the last batch's outputs equal a
    # non-speculative run's (None: not speculative)
    spec_acceptance_rate: float | None = None
    spec_mean_accepted_length: float | None = None
    greedy_exact: bool | None = None
    # A mixture of experts: per layer, the tokens each expert took over the measured iterations ([] for a
    # dense layer); None for a dense model
    expert_load: list[list[int]] | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch_size * self.input_len * len(self.prefill_seconds) / sum(self.prefill_seconds)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch_size * 1000 / self.decode_step_ms

    @property
    def batch_output_tokens_per_s(self) -> float:
        """The whole batch's output tokens over its latency, prefill included."""
        return self.batch_size * self.output_len * len(self.latencies) / sum(self.latencies)

    def text(self) -> str:
        lat = np.array(self.latencies) * 1000
        decode = "Decode: none (one output token: the prefill's)\n" if not self.decode_steps else (
            f"Decode step: {self.decode_step_ms:.1f} ms at batch {self.batch_size} "
            f"({self.decode_tokens_per_s:.1f} output tokens/s), mean of {self.decode_steps} steps\n"
            f"Whole batch: {self.batch_output_tokens_per_s:.1f} output tokens/s, prefill included "
            f"({self.batch_output_tokens_per_s / self.decode_tokens_per_s:.1%} of the decode step's)\n"
            f"Decode step time: " + ", ".join(f"{k} {v:.1%}" for k, v in self.step_time_shares.items()) + "\n")
        return (f"Batch {self.batch_size} x {self.input_len} prompt tokens -> {self.output_len} tokens each: "
                f"latency mean {lat.mean():.0f} ms, P50 {np.percentile(lat, 50):.0f}, P90 {np.percentile(lat, 90):.0f} "
                f"({len(lat)} iterations)\n"
                f"Prefill: {self.prefill_tokens_per_s:.1f} prompt tokens/s (mean over the iterations)\n"
                + decode + f"Weights held: {self.weight_bytes_held / 1e6:.0f} MB; peak RSS {self.peak_rss_bytes / 1e6:.0f} MB"
                + ("" if self.expert_load is None else expert_skew_text(self.expert_load))
                + ("" if self.greedy_exact is None else spec_text(self.spec_acceptance_rate,
                                                                   self.spec_mean_accepted_length, self.greedy_exact)))


def run_latency(config: EngineConfig, batch_size: int, input_len: int, output_len: int,
                num_iters: int, num_iters_warmup: int, seed: int = 0) -> LatencyResult:
    engine = LLMEngine(config)
    warm_up(engine)
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    latencies, prefills, decode_seconds, decode_steps = [], [], 0.0, 0
    group = getattr(engine.runner, "group", None)  # tensor parallel: rank 0's TensorParallelGroup
    stats_before, outputs = dict(engine.stats), {}
    for i in range(num_iters_warmup + num_iters):
        if i == num_iters_warmup:  # the experts' tokens over the measured iterations, prefills included
            load_before = engine.runner.stats().get("moe_expert_tokens")
        # Random token ids, fresh each iteration so that the prefix cache cannot serve them.
        prompts = rng.integers(1000, engine.model_config.vocab_size - 1000, size=(batch_size, input_len)).tolist()
        for j, prompt in enumerate(prompts):
            engine.add_request(f"latency-{i}-{j}", prompt, params)
        start, started = time.perf_counter(), set()
        while len(started) < batch_size:  # prefill: until every request has its first token
            for o in engine.step():
                if o.outputs[0].token_ids:
                    started.add(o.request_id)
                if o.finished:
                    outputs[o.request_id] = o
        measured = i >= num_iters_warmup
        if measured and i == num_iters_warmup:
            stats_before = dict(engine.stats)
        if measured:
            engine.reset_step_time()
            if group is not None:
                group.all_reduce_time = group.send_time = 0.0
        decode_start, steps = time.perf_counter(), 0
        if measured:
            prefills.append(decode_start - start)
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step() if o.finished)
            steps += 1
        if measured:
            latencies.append(time.perf_counter() - start)
            decode_seconds += time.perf_counter() - decode_start
            decode_steps += steps
    shares = engine.step_time_breakdown()
    if group is not None:  # rank 0's waits inside the forward and the input preparation, of the step time
        step_seconds = sum(engine.step_time.values()) or 1.0
        shares |= {"of which all_reduce": group.all_reduce_time / step_seconds,
                   "of which step broadcast": group.send_time / step_seconds}
    load = engine.runner.stats().get("moe_expert_tokens")
    expert_load = None if load is None else [[b - a for a, b in zip(before, after)]
                                             for before, after in zip(load_before, load)]
    model = getattr(engine.runner, "model", None)  # tensor parallel: rank 0 holds its shard only
    held = weight_bytes_held(model) if model is not None else 0
    engine.close()
    result = LatencyResult(batch_size, input_len, output_len, latencies,
                           1000 * decode_seconds / max(decode_steps, 1), decode_steps, shares, prefills, held,
                           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, expert_load=expert_load)
    if config.speculative is not None:
        last = [outputs[f"latency-{i}-{j}"] for j in range(batch_size)]
        result = replace(result, **spec_decode_stats(engine.stats, since=stats_before), greedy_exact=same_outputs(
            config, [o.prompt_token_ids for o in last], [params] * batch_size, last))
    return result


def expert_skew_text(load: list[list[int]]) -> str:
    """The routing skew: in each sparse layer, the busiest expert's tokens over the layer's mean."""
    skews = [max(counts) * len(counts) / sum(counts) for counts in load if counts and sum(counts)]
    if not skews:
        return ""
    return (f"\nExperts: the busiest expert of a sparse layer took {float(np.median(skews)):.2f}x its layer's mean "
            f"(median over {len(skews)} layers; worst {max(skews):.2f}x); tokens per expert in --output-json")


def weight_bytes_held(model) -> int:
    """Bytes of every weight the model holds: parameters, and quantized weights as packed (each once)."""
    params = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    return sum(params.values()) + sum(w.nbytes for w in model.quantized_weights())
