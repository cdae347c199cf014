"""The frontend's side of the engine-core process (core.py): starts it, feeds it, turns its outputs into
the RequestOutputs the server streams.

    generate --Add--> engine core --OutputBatch--> _read_outputs --(detokenize, stop strings)--> RequestStream

The engine process runs only the scheduler and the model; this process (the HTTP server's) keeps the
tokenizer and does everything with text: each request's incremental detokenizer and stop strings live
here (minivllm/text.py, the same code the in-process engine runs), and a request that reaches a stop
string is aborted in the engine. A step's outputs are one message of token ids (core_messages.py).

If the engine process dies, every open request fails with EngineDeadError (the server answers each with
an OpenAI error object, and /health with 503): the process's sentinel wakes the event loop at once.
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import tokenize_prompt
from minivllm.frontend.async_engine import EngineDeadError, EngineRequest, RequestStream
from minivllm.frontend.core import ERRORS, STARTUP_FAILED, run_engine_core
from minivllm.frontend.core_messages import (Abort, Add, AddRequest, OutputBatch, Ready, Reply, RequestDelta,
                                           UtilityCall, decoder, encoder)
from minivllm.lora.request import LoRARequest
from minivllm.model.loader import load_checkpoint, resolve_model_path
from minivllm.model.tokenizer import IncrementalDetokenizer, Tokenizer, get_tokenizer
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.text import cut_at_stop_string, visible_text
from minivllm.tracing.live import LiveFeed

STARTUP_TIMEOUT_S = 600  # a cold start compiles the kernels and packs the weights
SHUTDOWN_TIMEOUT_S = 30  # after SIGTERM, the engine process gets this long before it is killed
@dataclass
class _Request:
    """The frontend's state of one engine request: its text so far, and the whole output to hand out."""

    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def apply(self, d: RequestDelta, now: float) -> bool:
        """Take one step's tokens; True if this ends the request here, at a stop string the engine
        does not know of (the rest of the step's tokens are dropped, as the in-process engine does)."""
        p, last = self.params, len(d.new_token_ids) - 1
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.new_logprobs is not None and self.logprobs is None:
            self.logprobs = []
        for i, token in enumerate(d.new_token_ids):
            self.token_ids.append(token)
            if d.new_logprobs is not None:
                self.logprobs.append(d.new_logprobs[i])
                self.cumulative_logprob += d.new_logprobs[i][token]
            self.metrics.token_times.append(now)  # the frontend's guesses, until the engine's arrive
            self.metrics.first_token_time = self.metrics.first_token_time or now
            self.metrics.last_token_time = now
            text = self.detokenizer.add(token)
            if i == last and d.finish_reason == "stop":  # EOS or a stop token: checked before stop strings
                break
            if (text and p.stop_strings and len(self.token_ids) >= p.min_tokens
                    and (stop := cut_at_stop_string(self.detokenizer, p, text)) is not None):
                self.finish_reason, self.stop_reason = "stop", stop
                self.metrics.finished_time = now
                return True
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
        return False

    def output(self, request_id: str) -> RequestOutput:
        finished = self.finish_reason is not None
        text = visible_text(self.detokenizer.text, self.params, finished)
        completion = CompletionOutput(0, text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                      list(self.logprobs) if self.logprobs is not None else None,
                                      self.cumulative_logprob if self.logprobs is not None else None)
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, [completion], finished, self.metrics,
                             self.prompt_logprobs)


def _metrics(d: RequestDelta, metrics: RequestMetrics) -> None:
    """The engine's timestamps of a request (from its first or its last output) in place of the frontend's."""
    t = d.timestamps
    metrics.arrival_time, metrics.first_scheduled_time = t.arrival, t.first_scheduled
    metrics.first_token_time = t.first_token
    metrics.last_token_time = t.token_times[-1] if t.token_times else None
    metrics.finished_time = t.finished or metrics.finished_time  # ended here at a stop string: the frontend's
    metrics.num_preemptions = t.num_preemptions
    metrics.token_times = t.token_times
    metrics.num_cached_tokens = d.num_cached_tokens


class EngineCoreClient:
    """An EngineClient (async_engine.py) whose engine runs in its own process."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None,
                 lora_modules: list[LoRARequest] | None = None) -> None:
        """Start the engine process and wait until it is ready (blocking: called before the event loop);
        meanwhile this process loads the tokenizer."""
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self.error: str | None = None
        # Linux's abstract socket namespace: no file to clean up, whatever way this process ends
        name = f"minivllm-core-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        in_address, out_address = f"ipc://@{name}-input", f"ipc://@{name}-output"
        self._context = zmq.Context()
        input_socket, output_socket = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        input_socket.bind(in_address)
        output_socket.bind(out_address)
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_engine_core, name="minivllm-engine-core",
                                     args=(config, in_address, out_address, max_waiting_requests, lora_modules or []))
        self.process.start()
        path = resolve_model_path(config.model)
        self.tokenizer: Tokenizer = get_tokenizer(path, load_checkpoint(path)[0])
        try:
            ready = self._wait_ready(output_socket)
        except BaseException:
            self._context.destroy(linger=0)
            raise
        self.max_model_len, self.max_num_seqs = ready.max_model_len, ready.max_num_seqs
        self.batch_invariant, self.startup_time = ready.batch_invariant, dict(ready.startup_time)
        self.feed = LiveFeed(ready.start_time, ready.run)
        self.stats: dict[str, Any] = ready.stats  # replaced by each OutputBatch that carries them
        self.vocab_size = ready.vocab_size
        self._sync_sockets = (input_socket, output_socket)
        self._requests: dict[str, _Request] = {}
        self._aborting: dict[str, _Request] = {}  # aborted here; the engine's last output of each is still due
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False

    def _wait_ready(self, output_socket: zmq.Socket) -> Ready:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if output_socket.poll(200):
                message = decoder.decode(output_socket.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, Reply) and message.call_id == STARTUP_FAILED:
                    self.process.join()
                    raise ERRORS.get(message.error_type, RuntimeError)(message.error)
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while starting")
        self.process.kill()
        raise RuntimeError(f"the engine process was not ready after {STARTUP_TIMEOUT_S} s")

    # -- on the event loop ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._input, self._output = (zmq.asyncio.Socket.from_socket(s) for s in self._sync_sockets)
        self._reader = asyncio.ensure_future(self._read_outputs())
        self._loop.add_reader(self.process.sentinel, self._on_exit)

    async def shutdown(self) -> None:
        """Stop the engine process (SIGTERM: it aborts what is in flight and closes the engine)."""
        self._stopping = True
        self._loop.remove_reader(self.process.sentinel)
        if self.process.is_alive():
            self.process.terminate()
            await asyncio.to_thread(self.process.join, SHUTDOWN_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                await asyncio.to_thread(self.process.join)
        self._reader.cancel()
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._context.destroy(linger=0)

    def check_running(self) -> None:
        if self.error is not None or self._stopping or not self.process.is_alive():
            raise EngineDeadError(f"the engine is not running ({self.error or 'shutting down'})")

    async def generate(self, requests: list[EngineRequest], priority: int = 0,
                       tenant: str = "default") -> RequestStream:
        """Queue a group of requests, all or none. Raises ValueError (an invalid request: the engine's own
        message), QueueFullError or EngineDeadError before anything streams."""
        self.check_running()
        now = time.perf_counter()
        prompts = [tokenize_prompt(r.prompt, self.tokenizer, self.vocab_size) for r in requests]  # ValueError
        stream = RequestStream(self, [r.request_id for r in requests])
        for r, (text, token_ids) in zip(requests, prompts):
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, r.params.skip_special_tokens)
            self._requests[r.request_id] = _Request(stream, text, token_ids, r.params, detokenizer, RequestMetrics(now))
        adds = [AddRequest(r.request_id, token_ids, r.params, now, priority, tenant, r.lora_request)
                for r, (_, token_ids) in zip(requests, prompts)]
        try:
            await self._call(lambda call_id: Add(call_id, adds))
        except BaseException:  # invalid, refused, or the caller was cancelled meanwhile
            stream.close()
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._requests]
        for rid in live:  # told to on_finished (the metrics) once the engine confirms
            self._aborting[rid] = self._requests.pop(rid)
        if live and self.error is None and not self._stopping:
            self._input.send(encoder.encode(Abort(live)))

    async def check_structured(self, params: StructuredOutputsParams) -> None:
        await self.utility("compile_grammar", params)

    async def utility(self, method: str, *args: Any) -> Any:
        """Call EngineCore.utility_<method>(*args) in the engine process, between its steps; raises what
        it raised (ValueError, ...)."""
        return await self._call(lambda call_id: UtilityCall(call_id, method, list(args)))

    async def _call(self, make: Callable[[int], Any]) -> Any:
        self.check_running()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self._loop.create_future()
        try:
            await self._input.send(encoder.encode(make(call_id)))
            return await future
        finally:
            self._calls.pop(call_id, None)

    # -- outputs -------------------------------------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            message = decoder.decode(await self._output.recv(copy=False))
            if isinstance(message, OutputBatch):
                self._deliver(message)
            elif isinstance(message, Reply):
                self._reply(message)

    def _reply(self, reply: Reply) -> None:
        future = self._calls.get(reply.call_id)
        if future is None or future.done():
            return
        if reply.error is None:
            future.set_result(reply.result)
        else:
            future.set_exception(ERRORS.get(reply.error_type, RuntimeError)(reply.error))

    def _deliver(self, batch: OutputBatch) -> None:
        if batch.stats is not None:
            self.stats = batch.stats
        if batch.records:
            self.feed.publish(batch.records)
        now = time.perf_counter()
        stopped = []
        for d in batch.outputs:
            request = self._requests.get(d.request_id)
            if request is None:  # aborted by its caller, or ended here at a stop string
                self._confirm_abort(d, now)
                continue
            if request.apply(d, now):
                stopped.append(d.request_id)
            if d.timestamps is not None:
                _metrics(d, request.metrics)
            out = request.output(d.request_id)
            if out.finished:
                del self._requests[d.request_id]
                if self.on_finished:
                    self.on_finished(out)
            request.stream._put(out)
        if stopped:
            self._input.send(encoder.encode(Abort(stopped)))

    def _confirm_abort(self, d: RequestDelta, now: float) -> None:
        """The engine's last output of a request aborted here: the metrics count it."""
        request = self._aborting.get(d.request_id)
        if request is None or d.finish_reason is None:
            return
        del self._aborting[d.request_id]
        request.apply(d, now)
        if d.timestamps is not None:
            _metrics(d, request.metrics)
        if self.on_finished:
            self.on_finished(request.output(d.request_id))

    # -- the engine process's death ---------------------------------------------------------------------------
    def _on_exit(self) -> None:
        self._loop.remove_reader(self.process.sentinel)
        self.process.join(5)  # its pipes close a moment before its exit code can be read (once, at its death)
        self.error = f"the engine process exited with code {self.process.exitcode}"
        self._fail_all(EngineDeadError(self.error))

    def _fail_all(self, error: EngineDeadError) -> None:
        for stream in {r.stream for r in self._requests.values()}:
            stream._put(error)
        self._requests.clear()
        self._aborting.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)

