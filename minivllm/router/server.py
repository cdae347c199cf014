"""The HTTP router: one OpenAI-compatible front over `minivllm serve` replicas that run anywhere.

    POST /v1/completions, /v1/chat/completions, /v1/messages (+/count_tokens), /v1/responses: routed by
         the policy (policies.py), streamed through. A Responses request's `prompt_cache_key` (Codex CLI
         sends its thread's id) is its routing key: a conversation's turns meet their cached prefix.
         Stored responses stay on the replica that made them (no GET /v1/responses/{id} here).
    GET  /v1/models: the first replica up answers;  /health: each replica;  /metrics: every replica's,
         each sample labelled `replica="URL"`, plus the router's own

The router sees text, not tokens (as SGLang's router does): the prefix-aware policy hashes 64-byte
blocks of the prompt's UTF-8 bytes, so the router loads no tokenizer and fronts any model.

Faults. A replica that refuses a connection, breaks one, answers 503 engine_dead, or fails a health
check (`--health-check-timeout`, every `--health-check-interval` seconds) leaves the rotation and
its in-flight exchanges are cut at once (nothing waits on a stopped process). A request that has not
started streaming to its client is then routed again to another replica; one that has ends with an
OpenAI error object and `[DONE]`. A replica that passes a health check again rejoins.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from minivllm.router.policies import ROUTING_POLICIES, NoReplicaError, Router
from minivllm.server.api import add_error_handlers, read_body
from minivllm.server.http_server import listening_url
from minivllm.server.protocol import APIError

logger = logging.getLogger(__name__)
T = TypeVar("T")

BYTES_PER_BLOCK = 64  # ~16 tokens of English text: an engine KV block
MAX_BLOCKS = 32  # a prefix match looks at the first 2 KiB
BYTES_PER_TOKEN = 4  # for the load estimate of a prompt the router does not tokenize
DEFAULT_MAX_TOKENS = {"/v1/completions": 16, "/v1/chat/completions": 256, "/v1/messages": 256,
                      "/v1/messages/count_tokens": 0, "/v1/responses": 256}
# Where each API keeps its prompt (in the order the chat template renders it), and its output bound.
_ANTHROPIC_PROMPT = ("system", "tools", "messages")
PROMPT_FIELDS = {"/v1/completions": ("prompt",), "/v1/chat/completions": ("messages",),
                 "/v1/messages": _ANTHROPIC_PROMPT, "/v1/messages/count_tokens": _ANTHROPIC_PROMPT,
                 "/v1/responses": ("instructions", "tools", "input")}
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
PASSED_REQUEST_HEADERS = ("authorization", "content-type", "x-api-key", "anthropic-version", "anthropic-beta")
PASSED_RESPONSE_HEADERS = ("content-type", "x-ignored-fields")
REPLICA_HEADER = "X-Minivllm-Replica"  # which replica answered (the last one tried)


class ReplicaFailed(Exception):
    """The replica broke the exchange or left the rotation during it."""


@dataclass
class RouterOptions:
    backends: list[str]
    routing_policy: str = "prefix-aware"
    health_check_interval: float = 1.0
    health_check_timeout: float = 5.0

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("backend: give at least one replica URL")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}; "
                             f"got {self.routing_policy!r}")
        self.backends = [b.rstrip("/") for b in self.backends]


def byte_key_book(policy: str, names: list[str]) -> Router:
    """The book of a router that keys requests by RoutingKey (blocks of bytes, not tokens)."""
    args = {"block_size": BYTES_PER_BLOCK, "max_blocks": MAX_BLOCKS} if policy == "prefix-aware" else {}
    return Router.create(policy, names, **args)


def stream_error(error: APIError) -> bytes:
    """The end of a stream whose replica failed after it began: an OpenAI error event, then [DONE]."""
    return f"\n\ndata: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()


@dataclass
class RoutingKey:
    """What the policy sees of a request: its prompt as bytes (or token ids), the load it brings, and
    the model it names as the salt of its blocks (a LoRA adapter's name keeps its prefixes apart; the
    router does not know the base model's name, so the base named and the base unnamed are two keys)."""

    units: list[int]  # only the first blocks: the policy hashes no more
    max_tokens: int
    prompt_tokens: int  # estimated
    salt: bytes | None = None

    @classmethod
    def of(cls, path: str, body: bytes) -> RoutingKey:
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):  # the replica will answer 400: any replica will do
            return cls([], 0, 0)
        fields = [request.get(name) for name in PROMPT_FIELDS[path]]
        prompt = fields[0] if len(fields) == 1 else [f for f in fields if f is not None]
        cache_key = request.get("prompt_cache_key")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            units = prompt  # token ids already
        else:
            units = list(json.dumps(prompt, ensure_ascii=False).encode())
        if isinstance(cache_key, str):  # one whole block of its own: the same key, the same replica
            units = list(hashlib.sha256(cache_key.encode()).hexdigest().encode())[:BYTES_PER_BLOCK] + units
        max_tokens = next((v for v in map(request.get, MAX_TOKENS_FIELDS) if isinstance(v, int)), None)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS[path]
        model = request.get("model")
        return cls(units[:MAX_BLOCKS * BYTES_PER_BLOCK], max_tokens,
                   len(units) if units is prompt else len(units) // BYTES_PER_TOKEN,
                   model.encode() if isinstance(model, str) else None)


@dataclass
class ReplicaState:
    """The live side of a replica: cut_off is set when it leaves the rotation."""

    url: str
    cut_off: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""


class RouterServer:
    def __init__(self, options: RouterOptions) -> None:
        self.options = options
        self.book = byte_key_book(options.routing_policy, options.backends)
        self.replicas = [ReplicaState(url) for url in options.backends]
        self.retries = 0
        self.http: httpx.AsyncClient | None = None

    # -- rotation -------------------------------------------------------------------------------------------
    def take_out(self, i: int, reason: str) -> None:
        if self.book.replicas[i].up:
            logger.warning("replica %s leaves the rotation: %s", self.replicas[i].url, reason)
            print_line(f"minivllm: router: replica {self.replicas[i].url} out of rotation: {reason}")
        self.book.replicas[i].up = False
        self.replicas[i].reason = reason
        self.replicas[i].cut_off.set()

    def bring_back(self, i: int) -> None:
        if not self.book.replicas[i].up:
            print_line(f"minivllm: router: replica {self.replicas[i].url} back in rotation")
            self.replicas[i].cut_off = asyncio.Event()
            self.replicas[i].reason = ""
        self.book.replicas[i].up = True

    async def health_checks(self) -> None:
        while True:
            await asyncio.gather(*(self.check(i) for i in range(len(self.replicas))))
            await asyncio.sleep(self.options.health_check_interval)

    async def check(self, i: int) -> None:
        try:
            r = await self.http.get(f"{self.replicas[i].url}/health", timeout=self.options.health_check_timeout)
        except httpx.HTTPError as e:
            self.take_out(i, f"health check failed: {e!r}")
            return
        if r.status_code == 200:
            self.bring_back(i)
        else:
            self.take_out(i, f"health check answered {r.status_code}")

    async def guarded(self, i: int, work: Awaitable[T]) -> T:
        """`work`, unless replica i leaves the rotation first (then ReplicaFailed: nobody waits on it)."""
        task = await _unless(work, self.replicas[i].cut_off.wait())
        if task is None:
            raise ReplicaFailed(self.replicas[i].reason)
        try:
            return task.result()
        except httpx.TransportError as e:  # refused, reset, closed mid-answer
            self.take_out(i, repr(e))
            raise ReplicaFailed(repr(e)) from None

    # -- generation ---------------------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        path = request.url.path
        body = await read_body(request)  # the replicas' size limit, before parsing anything
        key = RoutingKey.of(path, body)
        headers = {k: v for k, v in request.headers.items() if k in PASSED_REQUEST_HEADERS}
        while True:
            request_id = uuid.uuid4().hex
            try:
                i = self.book.route(request_id, key.units, key.max_tokens, key.prompt_tokens + key.max_tokens,
                                    key.salt)
            except NoReplicaError:
                raise APIError(503, "no replica is up: " + "; ".join(
                    f"{r.url}: {r.reason}" for r in self.replicas), None, "no_replica") from None
            try:
                response = await self.exchange(i, request_id, path, body, headers, request)
            except ReplicaFailed:  # nothing reached the client yet: another replica takes it
                self.book.finished(request_id)
                self.retries += 1
                continue
            except BaseException:
                self.book.finished(request_id)
                raise
            if not isinstance(response, StreamingResponse):
                self.book.finished(request_id)
            return response

    async def exchange(self, i: int, request_id: str, path: str, body: bytes, headers: dict[str, str],
                       client: Request) -> Response:
        url = self.replicas[i].url
        upstream = await self.guarded(i, self.http.send(
            self.http.build_request("POST", url + path, content=body, headers=headers), stream=True))
        try:
            if upstream.status_code == 503 and b"engine_dead" in await self.guarded(i, upstream.aread()):
                self.take_out(i, "engine dead")
                raise ReplicaFailed("engine dead")
            out_headers = {k: v for k, v in upstream.headers.items() if k in PASSED_RESPONSE_HEADERS}
            out_headers[REPLICA_HEADER] = url
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                content = await self.guarded(i, self.until_client_leaves(upstream.aread(), client))
                return Response(content, upstream.status_code, out_headers)
            chunks = upstream.aiter_raw()
            first = await self.guarded(i, _next(chunks))  # until the first bytes the request may move
            if first is None:
                self.take_out(i, "closed a stream before its first event")
                raise ReplicaFailed("closed a stream before its first event")
        except BaseException:
            await upstream.aclose()
            raise
        return StreamingResponse(self.relay(i, request_id, upstream, first, chunks), upstream.status_code,
                                 out_headers)

    @staticmethod
    async def until_client_leaves(work: Awaitable[T], client: Request) -> T:
        """A non-streamed answer is awaited only while its client is there (the replica aborts otherwise)."""
        async def hung_up() -> None:
            while (await client.receive())["type"] != "http.disconnect":
                pass

        task = await _unless(work, hung_up())
        if task is None:
            return b""  # nobody to answer
        return task.result()

    async def relay(self, i: int, request_id: str, upstream: httpx.Response, first: bytes,
                    chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            yield first
            while True:
                try:
                    chunk = await self.guarded(i, _next(chunks))
                except ReplicaFailed as e:
                    error = APIError(502, f"replica {self.replicas[i].url} failed mid-stream: {e}", None,
                                     "replica_failed")
                    yield stream_error(error)
                    return
                if chunk is None:
                    return
                yield chunk
        finally:
            self.book.finished(request_id)
            await upstream.aclose()  # a client that hung up: the replica sees it and aborts

    # -- the rest -------------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in PASSED_REQUEST_HEADERS}
        for i, r in enumerate(self.replicas):
            if self.book.replicas[i].up:
                try:
                    up = await self.guarded(i, self.http.get(f"{r.url}/v1/models", headers=headers))
                except ReplicaFailed:
                    continue
                return Response(up.content, up.status_code, media_type="application/json")
        raise APIError(503, "no replica is up", None, "no_replica")

    async def health(self) -> JSONResponse:
        replicas = [{"url": r.url, "healthy": load.up, "reason": r.reason or None,
                     "outstanding_requests": load.outstanding_requests}
                    for r, load in zip(self.replicas, self.book.replicas)]
        return JSONResponse({"replicas": replicas}, status_code=200 if any(x["healthy"] for x in replicas) else 503)

    async def metrics(self) -> Response:
        texts = await asyncio.gather(*(self.scrape(i) for i in range(len(self.replicas))))
        registry = CollectorRegistry()
        registry.register(Relabelled(dict(zip(self.options.backends, texts)), self.book, self.retries))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def scrape(self, i: int) -> str:
        if not self.book.replicas[i].up:
            return ""
        try:
            r = await self.guarded(i, self.http.get(f"{self.replicas[i].url}/metrics",
                                                    timeout=self.options.health_check_timeout))
            return r.text
        except ReplicaFailed:
            return ""


async def _unless(work: Awaitable[T], stop: Awaitable[Any]) -> asyncio.Future[T] | None:
    """Await `work` unless `stop` completes first (then `work` is cancelled and None returned);
    the finished task otherwise, whose result() gives the value or raises."""
    task, stopper = asyncio.ensure_future(work), asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
    return task if task.done() and not task.cancelled() else None


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    """The next chunk, None at the end (StopAsyncIteration does not cross a task)."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


class Relabelled:
    """Every replica's metric families merged by name, each sample labelled with its replica; and the
    router's own gauges when it is given its book."""

    def __init__(self, texts: dict[str, str], book: Router | None = None, retries: int = 0) -> None:
        self.texts, self.book, self.retries = texts, book, retries

    def collect(self) -> Any:
        families: dict[str, Metric] = {}
        for replica, text in self.texts.items():
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                                   for s in family.samples]
        yield from families.values()
        if self.book is None:
            return
        up = GaugeMetricFamily("minivllm:router_replica_up", "1 while the replica is in rotation.", labels=["replica"])
        load = GaugeMetricFamily("minivllm:router_outstanding_requests", "Requests sent and not finished.",
                                 labels=["replica"])
        for r in self.book.replicas:
            up.add_metric([r.name], float(r.up))
            load.add_metric([r.name], r.outstanding_requests)
        yield up
        yield load
        retries = GaugeMetricFamily("minivllm:router_retries", "Requests routed again after a replica failed.")
        retries.add_metric([], self.retries)
        yield retries


def build_router_app(options: RouterOptions) -> FastAPI:
    server = RouterServer(options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # No overall timeout: a long generation is fine while its replica passes health checks.
        server.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=options.health_check_timeout),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        checks = asyncio.create_task(server.health_checks())
        yield
        checks.cancel()
        await server.http.aclose()

    app = FastAPI(title="minivllm router", lifespan=lifespan)
    app.state.router = server
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    app.get("/v1/models")(server.models)
    for path in PROMPT_FIELDS:
        app.post(path)(server.generate)

    add_error_handlers(app)
    return app


def print_line(text: str) -> None:
    """Print a line in one write: the front's threads (the replicas' output relays, the event loop) print
    side by side, and print()'s separate write of the newline let another line in before it."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class _RouterServer(uvicorn.Server):
    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            router = self.config.app.state.router
            print_line(f"minivllm: serving {len(router.replicas)} replica(s) ({router.options.routing_policy}) "
                       f"on {listening_url(self)}")


def run_router(options: RouterOptions, host: str, port: int) -> None:
    """Serve until SIGTERM or Ctrl-C; in-flight requests get uvicorn's graceful shutdown."""
    server = _RouterServer(uvicorn.Config(build_router_app(options), host=host, port=port,
                                          timeout_graceful_shutdown=30))
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal after its graceful shutdown
        signal.signal(sig, lambda *_: None)
    server.run()
