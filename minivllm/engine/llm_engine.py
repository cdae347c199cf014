"""The engine: requests in, one scheduled forward per `step()`, RequestOutputs out.

    add_request -> Sequence(WAITING)
    step(): Scheduler.schedule -> ModelRunner.execute -> Sampler -> update (append, detokenize,
            check stops, free the blocks of finished sequences) -> RequestOutputs
            [-> with speculative decoding: verify the drafts, roll back the rejected tokens' K/V,
             propose the next drafts]

What it computes with (`ModelParts`) and its clock are injected: by default the loaded model and
`time.perf_counter`; the simulator (bench/simulate.py) passes a cost model and a virtual clock, and
runs this very step logic.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.executor import ModelParts, load_parts
from minivllm.engine.kv_tier import tier_stats
from minivllm.engine.policies import POLICIES
from minivllm.engine.model_inputs import batch_inputs, sampling_rows
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.spec_decode import PROPOSERS
from minivllm.engine.static_scheduler import StaticBatchScheduler
from minivllm.engine.structured_output import StructuredOutputManager
from minivllm.engine.text import cut_at_stop_string, visible_text
from minivllm.engine.trace import StepObserver, StepRow, StepTracer, run_record
from minivllm.lora.manager import LoadedAdapter, LoRAManager
from minivllm.lora.request import LoRARequest
from minivllm.model.batch import BatchInputs
from minivllm.model.tokenizer import IncrementalDetokenizer, Tokenizer
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.startup import timed

PromptType = str | list[int] | dict[str, Any]
IDLE_WAIT_S = 0.01  # with nothing to run but grammars compiling or KV tier reads, how long a step waits for one

logger = logging.getLogger(__name__)


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
                 clock: Callable[[], float] = time.perf_counter, detokenize: bool = True, **kwargs: Any) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        # False in the engine-core process: its frontend detokenizes and checks stop strings (engine/text.py),
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
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching and not static,
                                          parts.kv_tier)
        policy = POLICIES[config.scheduling_policy]()
        self.scheduler = (StaticBatchScheduler(config, self.block_manager, policy, clock=clock,
                                               max_model_len=self.max_model_len)
                          if static else Scheduler(config, self.block_manager, policy, clock=clock))
        self.requests: dict[str, Sequence] = {}  # unfinished requests
        self.lora_manager = (LoRAManager(self.runner.model, config.max_loras, config.max_cpu_loras,
                                         config.max_lora_rank) if config.enable_lora else None)
        spec = config.speculative
        self.proposer = PROPOSERS[spec.method](spec) if spec else None
        if spec and not getattr(self.runner, "batch_invariant", False):
            logger.warning("speculative decoding is not exact here: the torch kernels (no compiler, CUDA or "
                           "MINIVLLM_NO_KERNELS) are not batch-invariant, so a verified chunk's logits may differ "
                           "by rounding from a plain decode's and a greedy output from the non-speculative one")
        self._structured_output: StructuredOutputManager | None = None  # made on first use
        self._structured_output_lock = threading.Lock()
        self._aborted: list[Sequence] = []  # finished by abort, reported by the next step
        self._compiling: list[Sequence] = []  # requests whose grammar may still be compiling
        self._ids = itertools.count()
        self.start_time = clock()
        self.tracer = StepTracer(config.trace_file, self.start_time, run_record(config)) if config.trace_file else None
        self.observers: list[StepObserver] = []  # told what the tracer is told (the server's live feed)
        # Seconds spent in each phase of step(): "prepare" builds the runner's inputs (model_inputs.py),
        # and the runner splits "model" into its own input preparation and the forward pass
        # (runner.prepare_time).
        self.step_time = {"schedule": 0.0, "prepare": 0.0, "model": 0.0, "sample": 0.0, "update": 0.0}
        self.stats = {"num_steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "padding_tokens": 0,
                      "finished_requests": 0,
                      # vLLM's: drafts verified, their tokens, and of those the ones accepted
                      "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                      "spec_decode_num_accepted_tokens": 0}
        self._counts_traced = (0,) * 5  # _spec_and_tier_counts() at the last step told to the observers

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
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request (under a LoRA adapter if `lora_request` names one: loaded now if need be);
        raises ValueError (naming the problem) for an invalid one."""
        params = params or SamplingParams()
        adapter = self._lora_adapter(lora_request) if lora_request is not None else None
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
        if adapter is not None:
            seq.lora, seq.cache_salt = adapter, adapter.cache_salt
        if params.structured_outputs is not None:
            seq.grammar_future = self.structured_output.compile(params.structured_outputs)
            self._compiling.append(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self._notify(seq)
        return request_id

    # -- LoRA adapters (lora/) ----------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter; raises ValueError naming what is wrong with it (a rank above
        max_lora_rank, modules the model lacks, shapes that do not fit, an unreadable file)."""
        self._lora_adapter(lora_request)
        return True

    def add_loras(self, lora_requests: list[LoRARequest]) -> None:
        """The adapters a server starts with (--lora-modules); a bad one stops the start, named."""
        for lora_request in lora_requests:
            self.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter (requests running under it finish under it); False if unknown."""
        return self.lora_manager is not None and self.lora_manager.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.lora_manager.list() if self.lora_manager is not None else []

    def _lora_adapter(self, lora_request: LoRARequest) -> LoadedAdapter:
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need the engine started with enable_lora (--enable-lora)")
        return self.lora_manager.add(lora_request)

    @property
    def structured_output(self) -> StructuredOutputManager:
        """The grammar compiler, made on first use (its vocabulary index takes a fraction of a second)."""
        with self._structured_output_lock:
            if self._structured_output is None:
                self._structured_output = StructuredOutputManager(
                    self.tokenizer.hf, self.model_config.vocab_size, self.tokenizer.eos_token_ids)
            return self._structured_output

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
        seq.grammar = seq.grammar_future = None  # release the parse state
        if self.proposer:
            self.proposer.on_finish(seq)

    def _start_grammars(self) -> None:
        """Give each request whose grammar has compiled its parse state, so that it can be scheduled;
        a grammar that failed (the server and LLM check first, so rarely) aborts its request."""
        self._compiling = [s for s in self._compiling if s.waiting_for_grammar]  # aborted ones drop out
        for seq in [s for s in self._compiling if s.grammar_future.done()]:
            self._compiling.remove(seq)
            try:
                seq.grammar = self.structured_output.grammar(seq.grammar_future.result())
            except ValueError:
                logger.exception("request %s: grammar failed to compile", seq.request_id)
                self.abort_request(seq.request_id)

    def _wait_for_work(self) -> None:
        """Nothing could run: sleep until a grammar is compiled or a KV tier read is done (briefly, so new
        commands are not held up)."""
        pending = [s.grammar_future for s in self._compiling if s.waiting_for_grammar]
        if self.block_manager.tier is not None:
            pending += self.block_manager.tier.pending_reads()
        if pending:
            concurrent.futures.wait(pending, timeout=IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_start = self.clock()
        if self._compiling:
            self._start_grammars()
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
        rows = sampling_rows(sampling, drafts, self.model_config.vocab_size)
        if logits is not None and logits.shape[0] > len(rows):  # rows past the sampling ones: prompt_logprobs
            self._score_prompts(sched, batch, logits[len(rows):])
            logits = logits[:len(rows)]
        sampled = self.sampler(logits, rows) if sampling else None
        t_sampled = self.clock()
        new_tokens, rejected = [], None
        if drafts:
            new_tokens, rejected = self._verify(sampling, drafts, sampled.token_ids, sampled.logprobs)
        elif sampling:
            new_tokens = [(s, [t], [lp]) for s, t, lp in zip(sampling, sampled.token_ids, sampled.logprobs)]
        self.scheduler.on_step_done(sched, rejected)
        for seq, tokens, logprobs in new_tokens:
            for token, lp in zip(tokens, logprobs):
                self._append(seq, token, lp, t_sampled)
                self.stats["generation_tokens"] += 1
                if seq.is_finished:  # at EOS, a stop token or string, or a length limit: the rest is dropped
                    break
        if self.proposer:
            self._propose(sampling)
            self.scheduler.step_cost.observe(sched.num_scheduled_tokens, self.clock() - t_scheduled)
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

    # -- speculative decoding ---------------------------------------------------------------------------
    def _verify(self, sampling: list[Sequence], drafts: dict[str, list[int]], tokens: list[int],
                logprobs: list) -> tuple[list[tuple[Sequence, list[int], list]], dict[str, int]]:
        """Per sequence, the tokens it gets: the sampled ones up to and including the first that differs
        from its draft (a draft token is accepted iff it is what the target sampled there, so the
        tokens are those plain decoding would give); and per request the draft tokens rejected."""
        new_tokens, rejected, row, stats = [], {}, 0, self.stats
        for seq in sampling:
            draft = drafts.get(seq.request_id, [])
            sampled = tokens[row:row + len(draft) + 1]
            accepted = 0
            while accepted < len(draft) and sampled[accepted] == draft[accepted]:
                accepted += 1
            new_tokens.append((seq, sampled[:accepted + 1], logprobs[row:row + accepted + 1]))
            row += len(draft) + 1
            if draft:
                rejected[seq.request_id] = len(draft) - accepted
                seq.num_spec_verified += min(accepted + 1, len(draft))
                seq.num_spec_accepted += accepted
                stats["spec_decode_num_drafts"] += 1
                stats["spec_decode_num_draft_tokens"] += len(draft)
                stats["spec_decode_num_accepted_tokens"] += accepted
        return new_tokens, rejected

    def _propose(self, sampled: list[Sequence]) -> None:
        """Draft the next tokens of each sequence that just sampled, as long as the scheduler says pays,
        and never past max_tokens or max_model_len (every draft token accepted, plus the bonus one)."""
        for seq in sampled:
            k = 0 if seq.is_finished else self.scheduler.draft_length(seq)
            if k:
                room = self.max_model_len - seq.num_tokens
                if seq.params.max_tokens is not None:
                    room = min(room, seq.params.max_tokens - seq.num_output_tokens)
                k = min(k, room - 1)
            seq.spec_token_ids = self.proposer.propose(seq, k) if k > 0 else []

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
            counts = self._spec_and_tier_counts()
            row = StepRow(stats["num_steps"], t_start - t0, self.clock() - t0,
                          scheduled + sched.num_padding_tokens, scheduled - decode,
                          decode, sched.num_padding_tokens, self.scheduler.num_running,
                          self.scheduler.num_waiting, bm.num_used_blocks, bm.num_blocks, len(sched.preempted),
                          len(finished), *(now - before for now, before in zip(counts, self._counts_traced)))
            self._counts_traced = counts
            for observer in observers:
                observer.record(row, sched, finished)

    def _spec_and_tier_counts(self) -> tuple[int, ...]:
        """The counters behind StepRow's last five columns, so far."""
        stats, tier = self.stats, self.block_manager.tier
        return (stats["spec_decode_num_drafts"], stats["spec_decode_num_draft_tokens"],
                stats["spec_decode_num_accepted_tokens"], tier.stats.kv_offload_ram_hits if tier else 0,
                tier.stats.kv_offload_disk_hits if tier else 0)

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
        if seq.grammar is not None and not seq.grammar.accept(token) and token not in seq.eos_token_ids:
            logger.warning("request %s: token %d is outside its grammar", seq.request_id, token)
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
            self.stats = dict.fromkeys(self.stats, 0)
            self.reset_step_time()
            self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0

    def flush_trace(self) -> None:
        """Bring the trace files up to date (the Chrome trace is rewritten whole), if one is kept."""
        if self.tracer:
            self.tracer.flush()

    def close(self) -> None:
        """Write out the trace, if one is kept, and the prefix blocks still in the pool to the KV tier's
        directory, if there is one; stop the grammar compiler and tensor-parallel workers."""
        if (tier := self.block_manager.tier) is not None:
            bm = self.block_manager
            tier.persist((h, bm.block_tokens[b], b) for h, b in bm.cached.items())
        if self._release is not None:
            self._release()
            self._release = None
        if self._structured_output is not None:
            self._structured_output.close()
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
                "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
                **tier_stats(bm.tier),
                **self.spec_decode_stats()}

    def spec_decode_stats(self, since: dict[str, Any] | None = None) -> dict[str, float | None]:
        """Acceptance rate (accepted of the draft tokens verified) and mean accepted length (tokens a
        verify step yields: the accepted ones plus the one sampled after them), as vLLM reports them;
        over the steps after the `stats` snapshot `since`, if given."""
        drafts, tokens, accepted = (self.stats[k] - (since or {}).get(k, 0) for k in (
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
        return {"spec_acceptance_rate": accepted / tokens if tokens else None,
                "spec_mean_accepted_length": 1 + accepted / drafts if drafts else None}

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"
