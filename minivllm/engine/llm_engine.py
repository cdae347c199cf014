"""The engine: requests in, one scheduled forward per `step()`, RequestOutputs out.

    add_request -> Sequence(WAITING)
    step(): Scheduler.schedule -> ModelRunner.execute -> Sampler -> update (append, detokenize,
            check stops, free the blocks of finished sequences) -> RequestOutputs

Features join the step through two seams (seams.py) and are never named here: admission gates, which
the scheduler asks before a waiting request starts, and step extensions, which this loop calls around
each step. Which ones an engine has follows from its config (minivllm/features.py); callers may add
their own.

What it computes with (`ModelParts`) and its clock are injected: by default the loaded model and
`time.perf_counter`; the simulator (bench/simulate.py) passes a cost model and a virtual clock, and
runs this very step logic.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.executor import ModelParts, load_parts
from minivllm.engine.model_inputs import batch_inputs, sampling_rows
from minivllm.engine.policies import POLICIES
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.seams import AdmissionGate, StepExtension
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.static_scheduler import StaticBatchScheduler
from minivllm.features import build_features
from minivllm.model.batch import BatchInputs
from minivllm.model.tokenizer import IncrementalDetokenizer, Tokenizer
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.startup import timed
from minivllm.text import cut_at_stop_string, visible_text
from minivllm.tracing.trace import StepObserver, StepRow, StepTracer, run_record

PromptType = str | list[int] | dict[str, Any]
E = TypeVar("E", bound=StepExtension)
IDLE_WAIT_S = 0.01  # with nothing to run but work a waiting request waits for, how long a step waits for it


def tokenize_prompt(prompt: PromptType, tokenizer: Tokenizer | None, vocab_size: int) -> tuple[str | None, list[int]]:
    """A prompt's text (if it has one) and its token ids, checked; raises ValueError naming what is wrong."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: the prompt must be token ids")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        if not (all(map(isinstance, prompt, itertools.repeat(int))) and 0 <= min(prompt) and max(prompt) < vocab_size):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab_size})")
        return None, list(prompt)
    raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, parts: ModelParts | None = None,
                 clock: Callable[[], float] = time.perf_counter, detokenize: bool = True,
                 gates: list[AdmissionGate] = (), extensions: list[StepExtension] = (), **kwargs: Any) -> None:
        """`gates` and `extensions` join those the config's features bring (seams.py)."""
        self.config = config = config or EngineConfig(**kwargs)
        # False in the engine-core process: its frontend detokenizes and checks stop strings (minivllm/text.py),
        # and aborts a request that reaches one; outputs then carry token ids and no text.
        self.detokenize = detokenize
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.clock = clock
        parts = parts or load_parts(config)
        self.startup_time = dict(parts.startup_time)  # seconds per start-up phase (a shared model's load is free)
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.runner, self.sampler, num_blocks = parts.runner, parts.sampler, parts.num_blocks
        self._release = parts.release
        self.max_model_len = self._max_model_len(num_blocks)

        static = config.scheduler == "static"
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching and not static)
        policy = POLICIES[config.scheduling_policy]()
        self.scheduler = (StaticBatchScheduler(config, self.block_manager, policy, clock=clock,
                                               max_model_len=self.max_model_len)
                          if static else Scheduler(config, self.block_manager, policy, clock=clock))
        self.requests: dict[str, Sequence] = {}  # unfinished requests
        self._aborted: list[Sequence] = []  # finished by abort, reported by the next step
        self._ids = itertools.count()
        self.start_time = clock()
        self.tracer = StepTracer(config.trace_file, self.start_time, run_record(config)) if config.trace_file else None
        self.observers: list[StepObserver] = []  # told what the tracer is told (the server's live feed)
        # Seconds spent in each phase of step(): "prepare" builds the runner's inputs (model_inputs.py),
        # and the runner splits "model" into its own input preparation and the forward pass
        # (runner.prepare_time).
        self.step_time = {"schedule": 0.0, "prepare": 0.0, "model": 0.0, "sample": 0.0, "update": 0.0}
        # Counters; a feature may add its own at construction (they are reset with these after warm_up).
        self.stats = {"num_steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "padding_tokens": 0,
                      "finished_requests": 0}
        features = build_features(self, parts)
        self.gates: list[AdmissionGate] = [*features.gates, *gates]
        self.extensions: list[StepExtension] = [*features.extensions, *extensions]
        self.scheduler.gates = self.gates  # the same list: a gate added later is asked too
        self._counts_traced: dict[str, int] = {}  # the extensions' trace_counts() at the last traced step

    def _max_model_len(self, num_blocks: int) -> int:
        capacity = num_blocks * self.config.block_size
        wanted = self.config.max_model_len or self.model_config.max_position_embeddings
        if self.config.max_model_len and self.config.max_model_len > capacity:
            raise ValueError(f"max_model_len {self.config.max_model_len} needs more KV cache than the "
                             f"{num_blocks} blocks x {self.config.block_size} tokens configured")
        return min(wanted, capacity)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, tenant: str = "default",
                    **options: Any) -> str:
        """Queue a request; raises ValueError (naming the problem) for an invalid one. `options` are for
        the step extensions (each takes its own, see features.py); one nobody takes is an error."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token must fit)")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            # As vLLM's server (and the OpenAI API) answers; offline too here: a limit that can never be
            # reached is the caller's mistake, and max_tokens=None means "up to the context".
            raise ValueError(f"max_tokens is {params.max_tokens}, but the prompt has {len(token_ids)} tokens and "
                             f"max_model_len is {self.max_model_len}: at most {self.max_model_len - len(token_ids)} "
                             "new tokens fit")
        if params.n != 1:
            raise ValueError("n > 1 is served by LLM.generate and the server, which fan out; the engine takes n=1")
        vocab = self.model_config.vocab_size
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):  # the sampler indexes by them
            if any(t >= vocab for t in getattr(params, name) or []):
                raise ValueError(f"{name} must hold token ids < the vocabulary size {vocab}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none")
        eos = self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_ids
        seq = Sequence(request_id, text, token_ids, params,
                       RequestMetrics(arrival_time=self.clock() if arrival_time is None else arrival_time),
                       priority=priority, tenant=str(tenant), eos_token_ids=tuple(eos))
        if self.tokenizer and self.detokenize:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        seq.bad_words_token_ids = self._bad_words(params.bad_words or [])
        if self.model_config.long_rope(len(token_ids)):
            seq.long_rope = True
            seq.add_cache_salt(b"long rope")
        options = {k: v for k, v in options.items() if v is not None}
        for extension in self.extensions:
            extension.on_add(seq, options)
        if options:
            raise ValueError(f"unknown request options: {', '.join(sorted(options))}")
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self._notify(seq)
        return request_id

    def extension(self, kind: type[E]) -> E | None:
        """The step extension of class `kind`, if this engine has one."""
        return next((e for e in self.extensions if isinstance(e, kind)), None)

    def utility(self, method: str, *args: Any) -> Any:
        """Call `method` of the engine, else of the first extension that has it (the frontends' remote
        calls reach the features' methods this way)."""
        if not method.startswith("_"):
            for target in (self, *self.extensions):
                if callable(function := getattr(target, method, None)):
                    return function(*args)
        raise AttributeError(f"neither the engine nor its extensions have a method {method!r}")

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each bad word as tokens, alone and after a space (as vLLM does: BPE spells them differently)."""
        variants = {tuple(self.tokenizer.encode(v, add_special_tokens=False))
                    for w in words for v in (w.strip(), " " + w.strip())}
        return [list(v) for v in variants if v]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(prompt, self.tokenizer, self.model_config.vocab_size)

    def abort_request(self, request_id: str) -> None:
        """End a request in any state; a finished or unknown id is a no-op."""
        seq = self.requests.pop(str(request_id), None)
        if seq is None:
            return
        self._finish(seq, "abort")
        self._aborted.append(seq)
        self._notify(seq)

    @property
    def _observers(self) -> list[StepObserver]:
        return ([self.tracer] if self.tracer else []) + self.observers

    def _notify(self, seq: Sequence) -> None:
        for observer in self._observers:
            observer.on_request(seq, self.clock())

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        for extension in self.extensions:
            extension.on_finish(seq)

    def _wait_for_work(self) -> None:
        """Nothing could run: sleep until work a waiting request waits for is done (briefly, so that new
        commands are not held up)."""
        pending = [f for extension in self.extensions for f in extension.pending()]
        if pending:
            concurrent.futures.wait(pending, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_start = self.clock()
        for extension in self.extensions:
            extension.before_schedule()
        outputs = [self._make_output(s) for s in self._aborted]
        self._aborted = []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._wait_for_work()
            return outputs
        t_scheduled = self.clock()
        batch = batch_inputs(sched)
        # A decode always samples; a prefill chunk does once it completes the prompt.
        sampling = [s for (s, _), span in zip(sched.scheduled, batch.spans) if span.num_logits]
        drafts = sched.scheduled_spec_decode_tokens
        t_prepared = self.clock()
        logits = self.runner.execute(batch)
        t_forward = self.clock()
        rows, own_rows = sampling_rows(sampling, drafts)
        if self.extensions:
            row_of = list(zip(sampling, own_rows))
            for extension in self.extensions:
                extension.prepare_sampling(row_of)
        if logits is not None and logits.shape[0] > len(rows):  # rows past the sampling ones: prompt_logprobs
            self._score_prompts(sched, batch, logits[len(rows):])
            logits = logits[:len(rows)]
        sampled = self.sampler(logits, rows) if sampling else None
        t_sampled = self.clock()
        new_tokens, rejected = [], None
        if drafts:
            new_tokens, rejected = next(v for e in self.extensions if (v := e.verify(sampling, drafts, sampled)))
        elif sampling:
            new_tokens = [(s, [t], [lp]) for s, t, lp in zip(sampling, sampled.token_ids, sampled.logprobs)]
        self.scheduler.on_step_done(sched, rejected)
        for seq, tokens, logprobs in new_tokens:
            for token, lp in zip(tokens, logprobs):
                self._append(seq, token, lp, t_sampled)
                self.stats["generation_tokens"] += 1
                if seq.is_finished:  # at EOS, a stop token or string, or a length limit: the rest is dropped
                    break
        for extension in self.extensions:
            extension.after_step(sched, sampling, t_scheduled)
        finished = [s for s in sampling if s.status is SequenceStatus.FINISHED]
        self._count(sched, t_start, finished)
        final_only = RequestOutputKind.FINAL_ONLY
        outputs.extend(self._make_output(s) for s in sampling
                       if s.params.output_kind is not final_only or s.status is SequenceStatus.FINISHED)
        times = self.step_time
        times["schedule"] += t_scheduled - t_start
        times["prepare"] += t_prepared - t_scheduled
        times["model"] += t_forward - t_prepared
        times["sample"] += t_sampled - t_forward
        times["update"] += self.clock() - t_sampled
        return outputs

    @staticmethod
    def _score_prompts(sched: SchedulerOutput, batch: BatchInputs, logits: torch.Tensor) -> None:
        """Append prompt_logprobs from the runner's extra rows: per scheduled sequence that asks, one row
        per position of its span's prompt_logprob_positions, in the order of sched.scheduled."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        row = 0
        for (seq, _), span in zip(sched.scheduled, batch.spans):
            for p in span.prompt_logprob_positions:
                token, k = seq.prompt_token_ids[p + 1], seq.params.prompt_logprobs
                entry = {token: logp[row, token].item()}
                if k:
                    values, ids = logp[row].topk(k)
                    entry.update(zip(ids.tolist(), values.tolist()))
                seq.prompt_logprobs.append(entry)
                row += 1

    def _count(self, sched: SchedulerOutput, t_start: float, finished: list[Sequence]) -> None:
        stats = self.stats
        scheduled, decode = sched.num_scheduled_tokens, sched.num_decode_tokens
        stats["num_steps"] += 1
        stats["padding_tokens"] += sched.num_padding_tokens
        stats["prompt_tokens"] += scheduled - decode
        if observers := self._observers:
            bm, t0 = self.block_manager, self.start_time
            counts = {k: v for extension in self.extensions for k, v in extension.trace_counts().items()}
            row = StepRow(stats["num_steps"], t_start - t0, self.clock() - t0,
                          scheduled + sched.num_padding_tokens, scheduled - decode,
                          decode, sched.num_padding_tokens, self.scheduler.num_running,
                          self.scheduler.num_waiting, bm.num_used_blocks, bm.num_blocks, len(sched.preempted),
                          len(finished), **{k: v - self._counts_traced.get(k, 0) for k, v in counts.items()})
            self._counts_traced = counts
            for observer in observers:
                observer.record(row, sched, finished)

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        seq.append_token(token)
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.token_times.append(now)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        for extension in self.extensions:
            extension.on_token(seq, token)
        delta = seq.detokenizer.add(token) if seq.detokenizer else ""
        reason = self._stop_reason(seq, token, delta)
        if reason:
            self.requests.pop(seq.request_id, None)
            self._finish(seq, reason)
            self.stats["finished_requests"] += 1

    def _stop_reason(self, seq: Sequence, token: int, delta: str) -> str | None:
        p, num_output_tokens = seq.params, len(seq.output_token_ids)
        if num_output_tokens >= p.min_tokens:
            if p.stop_token_ids and token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if not p.ignore_eos and token in seq.eos_token_ids:
                return "stop"
            if delta and p.stop_strings and (stop := cut_at_stop_string(seq.detokenizer, p, delta)) is not None:
                seq.stop_reason = stop
                return "stop"
        if p.max_tokens is not None and num_output_tokens >= p.max_tokens:
            return "length"
        if len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _make_output(self, seq: Sequence) -> RequestOutput:
        text = visible_text(seq.detokenizer.text, seq.params, seq.is_finished) if seq.detokenizer else ""
        completion = CompletionOutput(0, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason,
                                      list(seq.logprobs) if seq.logprobs is not None else None,
                                      seq.cumulative_logprob if seq.logprobs is not None else None)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], seq.is_finished,
                             seq.metrics, list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None)

    def warm_up(self) -> None:
        """Run one token through the whole step, so that the first real request does not pay for
        what runs once (oneDNN's primitives, first-call setup); then forget it in the statistics."""
        with timed(self.startup_time, "warm_up"):
            self.add_request("warm-up", [self.model_config.bos_token_id or 0], SamplingParams(max_tokens=1))
            while self.has_unfinished_requests():
                self.step()
            self.stats.update(dict.fromkeys(self.stats, 0))  # in place: features count into it too
            self.reset_step_time()
            self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0

    def flush_trace(self) -> None:
        """Bring the trace files up to date (the Chrome trace is rewritten whole), if one is kept."""
        if self.tracer:
            self.tracer.flush()

    def close(self) -> None:
        """Close the extensions (each keeps or stops what it must), stop the tensor-parallel workers and
        write out the trace, if one is kept."""
        for extension in self.extensions:
            extension.close()
        if self._release is not None:
            self._release()
            self._release = None
        if self.tracer:
            self.tracer.close()
            self.tracer = None

    # -- introspection ----------------------------------------------------------------------------------
    def reset_step_time(self) -> None:
        """Start the per-phase timers afresh, to measure one stretch of steps alone."""
        self.step_time = dict.fromkeys(self.step_time, 0.0)
        self.runner.prepare_time = 0.0

    def step_time_breakdown(self) -> dict[str, float]:
        """Share of step time per phase: schedule, prepare (inputs), forward, sample, update."""
        t = dict(self.step_time)
        t["prepare"] += self.runner.prepare_time
        t["forward"] = t.pop("model") - self.runner.prepare_time
        total = sum(t.values()) or 1.0
        return {k: v / total for k, v in t.items()}

    def get_stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {**self.stats,
                "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
                "num_preemptions": self.scheduler.num_preemptions,
                "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks, "kv_cache_usage": bm.usage,
                "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits, **self.runner.stats(),
                **{k: v for extension in self.extensions for k, v in extension.stats().items()}}

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"
