"""`minivllm bench throughput`: offline throughput, every request submitted at once, through
minivllm or (`--backend hf`) through Hugging Face transformers `generate` in static batches."""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass, replace

import numpy as np
from tqdm import tqdm

from minivllm.bench.compare import warm_up
from minivllm.bench.hf_backend import HFGenerator
from minivllm.bench.workloads import BenchRequest, build_workload
from minivllm.config import EngineConfig
from minivllm.llm import LLM
from minivllm.model.model_config import ModelConfig
from minivllm.model.tokenizer import Tokenizer
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.spec_decode.extension import spec_decode_stats
from minivllm.structured_output.extension import StructuredOutputs

# What --structured-output-ratio's requests must write: a JSON list of 4 or more records, so that
# the grammar is live for the whole output (they end at EOS once the list closes, or at output_len).
BENCH_SCHEMA = {"type": "array", "minItems": 4, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16}, "tags": {
        "type": "array", "items": {"enum": ["red", "green", "blue"]}}}, "required": ["id", "name", "tags"]}}


@dataclass
class ThroughputResult:
    backend: str
    num_requests: int
    elapsed: float  # seconds, from the first request submitted to the last finished
    total_input_tokens: int
    total_output_tokens: int
    peak_rss_gib: float  # the process's peak resident memory, weights and KV pool included
    step_time_shares: dict[str, float] | None = None  # minivllm only: share of step time per phase
    mean_ttft_ms: float | None = None  # minivllm only: all requests arrive at once, so queueing counts
    num_structured: int = 0  # requests constrained by a JSON schema (--structured-output-ratio)
    structured_output_tokens: int = 0
    # Speculative decoding (--speculative-config): acceptance, and whether every output equalled a
    # non-speculative run's, token for token (checked after the timed run; None: not speculative)
    spec_acceptance_rate: float | None = None
    spec_mean_accepted_length: float | None = None
    greedy_exact: bool | None = None

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed

    @property
    def input_tokens_per_s(self) -> float:
        return self.total_input_tokens / self.elapsed

    @property
    def output_tokens_per_s(self) -> float:
        return self.total_output_tokens / self.elapsed

    @property
    def total_tokens_per_s(self) -> float:
        return (self.total_input_tokens + self.total_output_tokens) / self.elapsed

    def to_dict(self) -> dict:
        return {**vars(self), "requests_per_s": self.requests_per_s, "input_tokens_per_s": self.input_tokens_per_s,
                "output_tokens_per_s": self.output_tokens_per_s, "total_tokens_per_s": self.total_tokens_per_s}

    def text(self) -> str:
        return (f"Throughput ({self.backend}): {self.requests_per_s:.2f} requests/s, "
                f"{self.total_tokens_per_s:.1f} total tokens/s, {self.input_tokens_per_s:.1f} input tokens/s, "
                f"{self.output_tokens_per_s:.1f} output tokens/s\n"
                f"{self.num_requests} requests, {self.total_input_tokens} input + {self.total_output_tokens} "
                f"output tokens in {self.elapsed:.2f} s; peak RSS {self.peak_rss_gib:.2f} GiB"
                + ("" if self.mean_ttft_ms is None else f"; mean TTFT {self.mean_ttft_ms:.0f} ms")
                + ("" if not self.num_structured else f"\n{self.num_structured} requests constrained by a JSON "
                   f"schema ({self.structured_output_tokens} of the output tokens)")
                + ("" if self.greedy_exact is None else spec_text(self.spec_acceptance_rate,
                                                                   self.spec_mean_accepted_length, self.greedy_exact))
                + ("" if not self.step_time_shares else "\nStep time: " + ", ".join(
                    f"{k} {v:.1%}" for k, v in self.step_time_shares.items())))


def spec_text(acceptance_rate: float | None, mean_accepted_length: float | None, greedy_exact: bool) -> str:
    rate = "no drafts" if acceptance_rate is None else (
        f"acceptance rate {acceptance_rate:.1%}, mean accepted length {mean_accepted_length:.2f}")
    return (f"\nSpeculative decoding: {rate}; outputs {'equal' if greedy_exact else 'NOT equal'} to a "
            "non-speculative run's")


def same_outputs(config: EngineConfig, prompts: list, params: list[SamplingParams], outs: list) -> bool:
    """Whether a non-speculative engine gives these requests the same tokens as `outs` (greedy or seeded
    requests: speculative decoding promises equality where the kernels are batch-invariant)."""
    plain = LLM(**{**vars(config), "speculative_config": None})
    reference = plain.generate(prompts, params, use_tqdm=False)
    plain.engine.close()
    return all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, reference))


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def structured_params(requests: list[BenchRequest], ratio: float) -> list[SamplingParams]:
    """Each request's parameters; a `ratio` share of them, spread evenly, constrained by BENCH_SCHEMA
    (and ended by EOS when their JSON closes, since the grammar then allows nothing else)."""
    constrained = StructuredOutputsParams(json=BENCH_SCHEMA)
    return [replace(r.sampling_params(), ignore_eos=False, structured_outputs=constrained)
            if int((i + 1) * ratio) > int(i * ratio) else r.sampling_params() for i, r in enumerate(requests)]


def run_minivllm(config: EngineConfig, spec: dict, show_progress: bool = True, structured_output_ratio: float = 0.0,
                 temperature: float = 0.0) -> tuple[ThroughputResult, list[BenchRequest], ModelConfig]:
    llm = LLM(**vars(config))
    requests = build_workload(spec, llm.engine.tokenizer, np.random.default_rng(spec["seed"]))
    params = structured_params(requests, structured_output_ratio)
    if temperature > 0:  # seeded: speculative decoding promises these the same tokens too
        params = [replace(p, temperature=temperature, seed=spec["seed"] + i) for i, p in enumerate(params)]
    if structured_output_ratio:  # compile the grammar before the clock starts, as a server's cache would have it
        llm.engine.extension(StructuredOutputs).compile(StructuredOutputsParams(json=BENCH_SCHEMA)).result()
    warm_up(llm.engine)
    llm.engine.reset_step_time()  # measure the workload alone
    before = dict(llm.engine.stats)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=show_progress)
    elapsed = time.perf_counter() - start
    structured = [o for o, p in zip(outs, params) if p.structured_outputs is not None]
    result = ThroughputResult("minivllm", len(outs), elapsed, sum(len(o.prompt_token_ids) for o in outs),
                              sum(len(o.outputs[0].token_ids) for o in outs), peak_rss_gib(),
                              llm.engine.step_time_breakdown(), 1000 * float(np.mean([o.metrics.ttft for o in outs])),
                              len(structured), sum(len(o.outputs[0].token_ids) for o in structured))
    if config.speculative is not None:
        spec = spec_decode_stats(llm.engine.stats, since=before)
        llm.engine.close()
        result = replace(result, **spec, greedy_exact=same_outputs(config, prompts, params, outs))
    return result, requests, llm.engine.model_config


def run_hf(config: EngineConfig, spec: dict, batch_size: int, tokenizer: Tokenizer, show_progress: bool = True
           ) -> tuple[ThroughputResult, list[BenchRequest]]:
    """The same requests, `batch_size` at a time in the workload's order, through `generate`."""
    requests = build_workload(spec, tokenizer, np.random.default_rng(spec["seed"]))
    generator = HFGenerator(config.model, config.torch_dtype, config.torch_device, tokenizer)
    generator.warm_up()
    bar = tqdm(total=len(requests), desc="Processed prompts (hf)", disable=not show_progress, dynamic_ncols=True)
    output_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        run = generator.run_batch(requests[i:i + batch_size])
        # A member's output is its first output_len tokens; the batch's steps beyond them are waste.
        output_tokens += sum(min(r.output_len, len(run.step_times)) for r in run.requests)
        bar.update(len(run.requests))
    elapsed = time.perf_counter() - start
    bar.close()
    return ThroughputResult("hf", len(requests), elapsed, sum(r.prompt_len for r in requests), output_tokens,
                            peak_rss_gib()), requests
