"""The engine-core process: the scheduler, the KV pool and the model, and nothing else.

    frontend --Add/Abort/UtilityCall (PUSH)--> [poll; drain; step; send] --OutputBatch (PUSH)--> frontend

One thread does everything, the process's main thread, which also built the engine: libgomp keeps an
OpenMP team per thread that starts parallel work, and with two teams on a small machine its threads
stop spinning between parallel regions (decode steps 1.8x as long on 2 cores). Between steps it drains
whatever the frontend sent; with nothing to run it blocks on the socket (a poll with a timeout), so an
idle engine uses no CPU. Outputs carry token ids: the frontend detokenizes and checks stop strings.

It exits on SIGTERM (after aborting what is in flight and closing the engine: the trace, the KV tier's
directory), when its parent process is gone, or (exit code 1) when a step fails.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.frontend.async_engine import EngineRequest, QueueFullError, add_group
from minivllm.frontend.core_messages import (Abort, Add, AddRequest, OutputBatch, Ready, Reply, RequestDelta,
                                           Timestamps, UtilityCall, decoder, encoder)
from minivllm.lora.extension import LoRAAdapters
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.extension import StructuredOutputs
from minivllm.tracing.live import LiveFeed
from minivllm.tracing.trace import run_record

STARTUP_FAILED = -1  # the call id of the Reply that says why the engine could not start
# The exceptions a Reply re-raises in the frontend as themselves (by the first of their classes named here:
# an AdapterError is a ValueError there); any other becomes a RuntimeError.
ERRORS: dict[str, type[Exception]] = {"QueueFullError": QueueFullError, "FileNotFoundError": FileNotFoundError,
                                      "ValueError": ValueError}
IDLE_POLL_MS = 500  # idle, the socket is polled this long at a time (then: is the parent still there?)
LINGER_MS = 1000
PENDING_POLL_MS = 5  # while a utility's answer is being computed elsewhere (a grammar compiling)

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str,
                 max_waiting_requests: int | None, lora_modules: list[LoRARequest]) -> None:
        self.parent_pid = os.getppid()
        self.context = zmq.Context()
        # Never block on a frontend that is gone (the loop would not notice the parent's death): outputs
        # queue without a bound, and at exit unsent ones are dropped after LINGER_MS.
        self.context.setsockopt(zmq.LINGER, LINGER_MS)
        self.input = self.context.socket(zmq.PULL)
        self.input.connect(input_address)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.connect(output_address)
        try:
            self.engine = engine = LLMEngine(config, detokenize=False)
            engine.extension(LoRAAdapters).add_loras(lora_modules)
            engine.warm_up()
        except (ValueError, FileNotFoundError) as e:  # a bad config: the frontend says so and exits
            self._send(error_reply(STARTUP_FAILED, e))
            raise SystemExit(1) from None
        self.max_waiting_requests = max_waiting_requests
        self.feed = LiveFeed(engine.start_time, run_record(config))  # re-published by the frontend
        engine.observers.append(self.feed)
        self._next_record = 0
        self._sent: dict[str, int] = {}  # request id -> output tokens already sent
        self._pending: list[tuple[int, Future]] = []  # utility calls answered once their future is done
        self.stopping = False

    def ready(self) -> Ready:
        e = self.engine
        return Ready(e.max_model_len, e.config.max_num_seqs, e.model_config.vocab_size, e.block_manager.num_blocks,
                     bool(getattr(e.runner, "batch_invariant", False)), e.startup_time, e.start_time, self.feed.run,
                     e.get_stats())

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        self._send(self.ready())
        while not self.stopping:
            busy = self.engine.has_unfinished_requests()
            timeout = 0 if busy else PENDING_POLL_MS if self._pending else IDLE_POLL_MS
            if self.input.poll(timeout):
                self._drain()
            elif os.getppid() != self.parent_pid:  # the frontend is gone: nobody to serve
                break
            self._answer_pending()
            if self.engine.has_unfinished_requests():
                self._send_outputs(self.engine.step())
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        self.engine.close()

    def _drain(self) -> None:
        while True:
            try:
                message = decoder.decode(self.input.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except msgspec.ValidationError:  # the frontend validated it first: a bug there, not here
                logger.exception("an undecodable message from the frontend, dropped")
                continue
            if isinstance(message, Add):
                self._send(self._add(message))
            elif isinstance(message, Abort):
                for rid in message.request_ids:
                    self.engine.abort_request(rid)
            elif isinstance(message, UtilityCall):
                self._call(message)

    def _add(self, message: Add) -> Reply:
        requests = [EngineRequest(r.request_id, r.prompt_token_ids, r.params, r.lora_request)
                    for r in message.requests]
        first: AddRequest = message.requests[0]
        try:
            add_group(self.engine, requests, first.priority, first.tenant, self.max_waiting_requests,
                      first.arrival_time)
        except (ValueError, QueueFullError) as e:
            return error_reply(message.call_id, e)
        return Reply(message.call_id)

    # -- utility calls ------------------------------------------------------------------------------------------
    def _call(self, call: UtilityCall) -> None:
        method = getattr(self, f"utility_{call.method}", None)
        if method is None:
            self._send(Reply(call.call_id, error=f"no utility {call.method!r}", error_type="ValueError"))
            return
        try:
            result = method(*call.args)
        except Exception as e:  # a bad argument must not stop the engine
            self._send(error_reply(call.call_id, e))
            return
        if isinstance(result, Future):
            self._pending.append((call.call_id, result))
        else:
            self._send(Reply(call.call_id, result))

    def _answer_pending(self) -> None:
        for call_id, future in [p for p in self._pending if p[1].done()]:
            self._pending.remove((call_id, future))
            error = future.exception()
            self._send(Reply(call_id) if error is None else
                       error_reply(call_id, error))

    def utility_compile_grammar(self, params: dict[str, Any]) -> Future:
        """Compile a structured-output grammar (in the compiler's pool; cached for the request that
        follows); the reply says whether the library accepted it."""
        return self.engine.extension(StructuredOutputs).compile(msgspec.convert(params, StructuredOutputsParams))

    def utility_add_lora(self, lora_request: dict[str, Any] | list[Any]) -> bool:
        """Load and register an adapter (POST /v1/load_lora_adapter); a ValueError names its problem."""
        return self.engine.extension(LoRAAdapters).add_lora(msgspec.convert(lora_request, LoRARequest))

    def utility_remove_lora(self, lora_name: str) -> bool:
        return self.engine.extension(LoRAAdapters).remove_lora(lora_name)

    # -- outputs -----------------------------------------------------------------------------------------------
    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        # The stats go with every step (a few microseconds of a step's milliseconds), so that /metrics
        # shows the pool as the last step left it.
        records = self.feed.since(self._next_record)
        self._next_record = records.next_seq
        self._send(OutputBatch([self._delta(out) for out in outputs], self.engine.get_stats(), records.records))

    def _delta(self, out: RequestOutput) -> RequestDelta:
        c, rid = out.outputs[0], out.request_id
        sent = self._sent.get(rid, 0)
        delta = RequestDelta(rid, c.token_ids[sent:], c.finish_reason, c.stop_reason,
                             c.logprobs[sent:] if c.logprobs is not None else None,
                             out.prompt_logprobs if sent == 0 else None, out.metrics.num_cached_tokens)
        if out.finished or sent == 0:  # the first too: a request the frontend ends at a stop string has them
            m = out.metrics
            delta.timestamps = Timestamps(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                          m.finished_time, m.num_preemptions, list(m.token_times))
        if out.finished:
            self._sent.pop(rid, None)
        else:
            self._sent[rid] = len(c.token_ids)
        return delta

    def _send(self, message: Any) -> None:
        self.output.send(encoder.encode(message), copy=False)


def error_reply(call_id: int, e: BaseException) -> Reply:
    kind = next((c.__name__ for c in type(e).__mro__ if c.__name__ in ERRORS), type(e).__name__)
    return Reply(call_id, error=str(e), error_type=kind)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    max_waiting_requests: int | None, lora_modules: list[LoRARequest]) -> None:
    """The process's entry point (multiprocessing, spawned by EngineCoreClient)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the frontend decides
    core = EngineCore(config, input_address, output_address, max_waiting_requests, lora_modules)

    def stop(*_: Any) -> None:
        core.stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        core.run()
    except Exception:
        logger.exception("the engine core failed")
        try:  # stop what the engine started (tensor-parallel workers, a Ray instance): os._exit skips atexit
            core.engine.close()
        except Exception:
            logger.exception("closing the failed engine")
        sys.stderr.flush()
        os._exit(1)  # the frontend fails every open request and answers /health with 503
