"""The engine for asyncio callers (the server): LLMEngine's step loop in one background thread.

LLMEngine is not thread-safe, so only the loop thread ever touches it. The event loop hands it work
as commands (add, abort) that the thread applies between steps, in the order submitted; the thread
hands each step's outputs back with `loop.call_soon_threadsafe`, into one asyncio.Queue per HTTP
request. With nothing to do the thread sleeps on a condition variable; it never spins.

    handler --add/abort--> commands --(loop thread: apply, step)--> call_soon_threadsafe --> RequestStream

It is one of the server's two engine clients (`--disable-frontend-multiprocessing`); the other,
EngineCoreClient (core_client.py), runs the engine in its own process. Both offer what EngineClient
lists, and both hand out RequestStreams.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.lora.request import LoRARequest
from minivllm.model.tokenizer import Tokenizer
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.structured_output.extension import StructuredOutputs
from minivllm.tracing.live import LiveFeed
from minivllm.tracing.trace import run_record

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue already holds `max_waiting_requests` requests."""


class EngineDeadError(RuntimeError):
    """The step loop failed or has stopped; no request can be served."""


@dataclass
class EngineRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams  # n = 1: the caller fans n > 1 out (SamplingParams.fan_out)
    lora_request: LoRARequest | None = None


class EngineClient(Protocol):
    """What the server needs of an engine, in process or behind a process boundary."""

    tokenizer: Tokenizer
    max_model_len: int
    max_num_seqs: int
    batch_invariant: bool  # the kernels' (a near-tie breaks the same way whatever shares a step)
    startup_time: dict[str, float]  # seconds per start-up phase
    stats: dict[str, Any]  # LLMEngine.get_stats(), as of the last step
    feed: LiveFeed  # the dashboard's records
    on_finished: Callable[[RequestOutput], None] | None  # told of each request that ends

    def start(self) -> None: ...
    async def shutdown(self) -> None: ...
    def check_running(self) -> None: ...
    async def generate(self, requests: list[EngineRequest], priority: int = 0,
                       tenant: str = "default") -> RequestStream: ...
    def abort(self, request_ids: list[str]) -> None: ...
    async def check_structured(self, params: StructuredOutputsParams) -> None: ...
    async def utility(self, method: str, *args: Any) -> Any: ...


def add_group(engine: LLMEngine, requests: list[EngineRequest], priority: int, tenant: str,
              max_waiting_requests: int | None, arrival_time: float | None = None) -> None:
    """Add a group of requests all or none: raises QueueFullError, or ValueError (an invalid request)."""
    waiting = engine.get_stats()["num_waiting"]
    if max_waiting_requests is not None and waiting >= max_waiting_requests:
        raise QueueFullError(f"the server is busy: {waiting} requests are already waiting "
                             f"(--max-waiting-requests {max_waiting_requests}); retry later")
    done: list[str] = []
    try:
        for r in requests:
            done.append(engine.add_request(r.request_id, r.prompt, r.params, arrival_time, priority, tenant,
                                           lora_request=r.lora_request))
    except ValueError:
        for rid in done:
            engine.abort_request(rid)
        raise


class RequestStream:
    """The outputs of a group of engine requests (the choices of one HTTP request), as they are made.

    Each item is a RequestOutput holding the whole state so far of one request of the group; iteration
    ends once every request of the group has finished. `close()` aborts whatever is unfinished, so a
    caller that stops listening (a client that hung up) frees the KV blocks at the next step.
    """

    def __init__(self, engine: EngineClient, request_ids: list[str]) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unfinished = set(request_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):  # the engine died: nothing is left to abort
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        if self.unfinished:
            self._engine.abort(list(self.unfinished))
            self.unfinished.clear()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests  # None: no limit
        self.on_finished: Callable[[RequestOutput], None] | None = None  # called in the loop thread
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs
        self.batch_invariant = bool(getattr(engine.runner, "batch_invariant", False))
        self.startup_time = engine.startup_time
        self.feed = LiveFeed(engine.start_time, run_record(engine.config))
        engine.observers.append(self.feed)
        # Read by other threads (metrics, health); the loop thread replaces it after every iteration.
        self.stats: dict[str, Any] = engine.get_stats()
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # request id -> its stream; event-loop thread only

    # -- called on the event loop -------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort what is still in flight, let the loop report it, and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.engine.close()

    def check_running(self) -> None:
        """Raise EngineDeadError unless the step loop is up and accepting requests."""
        if self._thread is None or not self._thread.is_alive() or self._stopping:
            raise EngineDeadError(f"the engine is not running ({self.error or 'not started, or shutting down'})")

    async def generate(self, requests: list[EngineRequest], priority: int = 0,
                       tenant: str = "default") -> RequestStream:
        """Queue a group of requests, all or none. Raises ValueError (an invalid request: the engine's
        own message), QueueFullError or EngineDeadError before anything streams."""
        self.check_running()
        stream = RequestStream(self, [r.request_id for r in requests])
        # Registered before the add is applied: outputs may arrive before this coroutine resumes.
        for r in requests:
            self._streams[r.request_id] = stream
        added = self._loop.create_future()
        self._submit(lambda: self._add(requests, priority, tenant, added))
        try:
            await added
        except BaseException:  # invalid, refused, or the caller was cancelled meanwhile
            stream.close()
            raise
        return stream

    async def utility(self, method: str, *args: Any) -> Any:
        """LLMEngine.utility(`method`, *args), run in the step thread between steps (the engine is not
        thread-safe); its exception, if any, is raised here."""
        self.check_running()
        done = self._loop.create_future()

        def call() -> None:
            try:
                result, error = self.engine.utility(method, *args), None
            except Exception as e:  # handed to the caller, as the add path does
                result, error = None, e
            self._call_in_loop(_settle, done, result, error)

        self._submit(call)
        return await done

    async def check_structured(self, params: StructuredOutputsParams) -> None:
        """Compile the grammar (in the compiler's pool, off the event loop and the step loop; cached for
        the request that follows); raises ValueError if the library rejects it."""
        grammars = self.engine.extension(StructuredOutputs)
        manager = await asyncio.to_thread(lambda: grammars.manager)
        await asyncio.wrap_future(manager.compile(params))

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in any state; unknown or finished ids are ignored."""
        for rid in request_ids:
            self._streams.pop(rid, None)

        def abort_in_loop_thread() -> None:
            for rid in request_ids:
                self.engine.abort_request(rid)

        self._submit(abort_in_loop_thread)

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted by its caller
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out)

    def _fail_all(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream._put(error)
        self._streams.clear()

    # -- the loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._iteration():
                pass
        except Exception as e:  # a bug in a step: fail every stream rather than hang them
            logger.exception("engine step loop failed")
            self.error = e
            self._call_in_loop(self._fail_all, EngineDeadError(f"engine step failed: {e!r}"))

    def _iteration(self) -> bool:
        """Apply pending commands, run one step; False once stopped."""
        with self._cond:
            while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                self._cond.wait()
            commands, self._commands = self._commands, []
            stopping = self._stopping
        for command in commands:
            command()
        if stopping:
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        self.stats = self.engine.get_stats()
        if self.on_finished:
            for out in outputs:
                if out.finished:
                    self.on_finished(out)
        if outputs:
            self._call_in_loop(self._deliver, outputs)
        return not (stopping and not self.engine.has_unfinished_requests())

    def _add(self, requests: list[EngineRequest], priority: int, tenant: str, added: asyncio.Future) -> None:
        try:
            add_group(self.engine, requests, priority, tenant, self.max_waiting_requests)
        except (ValueError, QueueFullError) as e:
            self._call_in_loop(_settle, added, None, e)
        else:
            self._call_in_loop(_settle, added, None, None)

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is left to tell
            self._loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)

