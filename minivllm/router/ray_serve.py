"""`minivllm serve --data-parallel-size N --data-parallel-backend ray`: the replicas as a Ray Serve
application, behind the same OpenAI routes as `minivllm serve`.

    HTTP -> Serve's proxy -> `Ingress` (FastAPI) --handle--> `EngineReplica` x N -> `minivllm serve`

`EngineReplica` is one engine: a `minivllm serve` process on its node (replicas.py starts it, on the
cores its Ray bundle holds), to which it streams each request. Serve places, health-checks, replaces
and autoscales the replicas. Which replica takes a request is `PrefixAwareRequestRouter`'s choice: a
Serve `RequestRouter` that keeps the same book as `minivllm router` (policies.Router) and asks the same
policy, on the same routing key (router/server.RoutingKey), without any blocking call.

Every replica puts its engine's URL in Ray's key-value store, so that the ingress can merge their
/metrics and /health.
"""
# No `from __future__ import annotations`: Serve's ingress rebuilds the route methods, and FastAPI
# could then not resolve a string annotation such as "Request".
import asyncio
import os
import shlex
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from ray import serve
from ray.experimental import internal_kv
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from minivllm.distributed.ray_workers import connect_ray
from minivllm.router.policies import ROUTING_POLICIES, ReplicaLoad
from minivllm.router.replicas import start_replicas, stop_replicas
from minivllm.router.server import (PASSED_REQUEST_HEADERS, PASSED_RESPONSE_HEADERS, PROMPT_FIELDS, REPLICA_HEADER,
                                    Relabelled, RoutingKey, byte_key_book, print_line, stream_error)
from minivllm.server.api import add_error_handlers, read_body
from minivllm.server.protocol import APIError

APP_NAME = "minivllm"
URL_KEY = "minivllm/replica/"  # + the replica's id -> its engine's URL, in Ray's key-value store
SERVE_DEFAULT = "power-of-two"  # Serve's own router, for comparison: random pairs, shorter queue
SERVE_POLICIES = (*ROUTING_POLICIES, SERVE_DEFAULT)


class PrefixAwareRequestRouter(RequestRouter):
    """Serve's routing seam over minivllm's policies. The book is kept per Serve request id: booked when
    chosen (again if Serve retries the choice), released when Serve reports the request completed.
    Replicas get a fixed index when first seen, so that the policy's block owners stay valid as
    replicas come and go; one that leaves is marked down, as the HTTP router marks a failed one."""

    def initialize_state(self, routing_policy: str = "prefix-aware") -> None:
        self.book = byte_key_book(routing_policy, [])
        self.index: dict[ReplicaID, int] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("key") if pending_request is not None else None
        if not isinstance(key, RoutingKey):  # no prompt (GET /v1/models): any replica
            return [candidate_replicas]
        by_index = {}
        for replica in candidate_replicas:
            if replica.replica_id not in self.index:
                self.index[replica.replica_id] = len(self.book.replicas)
                self.book.replicas.append(ReplicaLoad(replica.replica_id.unique_id))
            by_index[self.index[replica.replica_id]] = replica
        for i, load in enumerate(self.book.replicas):
            load.up = i in by_index
        request_id = pending_request.metadata.internal_request_id
        if request_id in self.book.inflight:  # Serve asks again: the replica chosen before was full
            self.book.finished(request_id)
        i = self.book.route(request_id, key.units, key.max_tokens, key.prompt_tokens + key.max_tokens, key.salt)
        return [[by_index[i]]]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if internal_request_id in self.book.inflight:
            self.book.finished(internal_request_id)


class EngineReplica:
    """One engine: a `minivllm serve` process on this node, with `num_threads` torch threads."""

    def __init__(self, serve_argv: list[str], num_threads: int) -> None:
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.engine = start_replicas(serve_argv, 1, host=ray.util.get_node_ip_address())[0]
        self.http = httpx.AsyncClient(base_url=self.engine.url, timeout=httpx.Timeout(None, connect=5.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        internal_kv._internal_kv_put(URL_KEY + self.name, self.engine.url)

    async def generate(self, path: str, body: bytes, headers: dict[str, str],
                       key: RoutingKey | None = None) -> AsyncIterator[Any]:
        """(status, headers), then the answer's bytes as they come; `key` is the router's."""
        upstream = await self.http.send(self.http.build_request("POST", path, content=body, headers=headers),
                                        stream=True)
        try:
            out_headers = {k: v for k, v in upstream.headers.items() if k in PASSED_RESPONSE_HEADERS}
            yield upstream.status_code, {**out_headers, REPLICA_HEADER: self.name}
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()  # an ingress whose client left cancels this: the engine aborts

    async def models(self, headers: dict[str, str]) -> tuple[int, bytes]:
        r = await self.http.get("/v1/models", headers=headers)
        return r.status_code, r.content

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine exited or is dead is replaced."""
        if self.engine.proc.poll() is not None:
            raise RuntimeError(f"the engine exited with code {self.engine.proc.poll()}")
        r = await self.http.get("/health", timeout=5.0)
        if r.status_code != 200:
            raise RuntimeError(f"the engine's /health answered {r.status_code}")

    def __del__(self) -> None:
        internal_kv._internal_kv_del(URL_KEY + self.name)
        stop_replicas([self.engine])


app = FastAPI(title="minivllm on Ray Serve")
add_error_handlers(app)


@serve.ingress(app)
class Ingress:
    """The OpenAI routes. A replica that dies before answering fails its request with a 503; one that
    dies mid-stream ends the stream with an error event and [DONE], as `minivllm router` does."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.http = httpx.AsyncClient(timeout=5.0)

    async def _generate(self, request: Request) -> Response:
        path = request.url.path
        body = await read_body(request)
        headers = {k: v for k, v in request.headers.items() if k in PASSED_REQUEST_HEADERS}
        answer = self.engine.options(stream=True).generate.remote(path, body, headers, key=RoutingKey.of(path, body))
        try:
            status, out_headers = await anext(answer)
        except Exception as e:  # the replica died, or Serve has none
            raise APIError(503, f"the replica failed: {type(e).__name__}: {e}", None, "replica_failed") from None
        if not out_headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = b"".join([chunk async for chunk in answer])
            except Exception as e:
                raise APIError(502, f"the replica failed: {type(e).__name__}", None, "replica_failed") from None
            return Response(content, status, out_headers)
        return StreamingResponse(self._relay(answer, out_headers[REPLICA_HEADER]), status, out_headers)

    @staticmethod
    async def _relay(answer: Any, replica: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in answer:
                yield chunk
        except Exception as e:
            error = APIError(502, f"replica {replica} failed mid-stream: {type(e).__name__}", None, "replica_failed")
            yield stream_error(error)

    for path in PROMPT_FIELDS:
        _generate = app.post(path)(_generate)
    del path

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in PASSED_REQUEST_HEADERS}
        status, content = await self.engine.models.remote(headers)
        return Response(content, status, media_type="application/json")

    @app.get("/health")
    async def health(self) -> JSONResponse:
        replicas = [{"replica": name, "url": url, "healthy": text is not None}
                    for (name, url), text in await self._each("/health")]
        return JSONResponse({"replicas": replicas}, status_code=200 if any(r["healthy"] for r in replicas) else 503)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        registry = CollectorRegistry()
        registry.register(Relabelled({name: text for (name, _), text in await self._each("/metrics") if text}))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def _each(self, path: str) -> list[tuple[tuple[str, str], str | None]]:
        """Every registered replica's answer to GET path (None: it did not answer 200)."""
        replicas = [(key.decode().removeprefix(URL_KEY), internal_kv._internal_kv_get(key).decode())
                    for key in internal_kv._internal_kv_list(URL_KEY)]

        async def get(name: str, url: str) -> str | None:
            try:
                r = await self.http.get(url + path)
            except httpx.ConnectError:  # its engine is gone (a killed replica never unregistered)
                internal_kv._internal_kv_del(URL_KEY + name)
                return None
            except httpx.HTTPError:
                return None
            return r.text if r.status_code == 200 else None

        answers = await asyncio.gather(*(get(name, url) for name, url in replicas))
        return list(zip(replicas, answers))


@dataclass
class ServeOptions:
    num_replicas: int = 1
    num_threads: int = 1  # per replica: its Ray bundle's CPUs and its torch threads
    routing_policy: str = "prefix-aware"
    min_replicas: int | None = None  # both set: autoscaled on ongoing requests
    max_replicas: int | None = None
    target_ongoing_requests: int = 16

    def __post_init__(self) -> None:
        if self.routing_policy not in SERVE_POLICIES:
            raise ValueError(f"routing_policy on Ray Serve must be one of {', '.join(SERVE_POLICIES)}; "
                             f"got {self.routing_policy!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("--min-replicas and --max-replicas go together")
        if self.min_replicas is not None and not 0 < self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 < --min-replicas <= --max-replicas; got {self.min_replicas} and "
                             f"{self.max_replicas}")


def build_app(serve_argv: list[str], options: ServeOptions) -> Any:
    if options.min_replicas is None:
        scaling: dict[str, Any] = {"num_replicas": options.num_replicas}
    else:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=options.min_replicas, max_replicas=options.max_replicas,
            initial_replicas=min(max(options.num_replicas, options.min_replicas), options.max_replicas),
            target_ongoing_requests=options.target_ongoing_requests)}
    if options.routing_policy != SERVE_DEFAULT:
        scaling["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAwareRequestRouter,
            request_router_kwargs={"routing_policy": options.routing_policy})
    engine = serve.deployment(EngineReplica, name="EngineReplica", ray_actor_options={"num_cpus": options.num_threads},
                              max_ongoing_requests=1024,  # the engine queues; Serve never holds one back
                              health_check_period_s=2, health_check_timeout_s=10, **scaling)
    ingress = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4096)
    return ingress.bind(engine.bind(serve_argv, options.num_threads))


def app_builder(args: dict[str, Any]) -> Any:
    """The application for a Serve config file (KubeRay's RayService: deploy/kuberay-rayservice.yaml):
    `serve_args`, the `minivllm serve` flags of each replica as one string, and ServeOptions' fields."""
    options = {k: v for k, v in args.items() if k != "serve_args"}
    return build_app(shlex.split(args.get("serve_args", "")), ServeOptions(**options))


def serve_on_ray(serve_argv: list[str], options: ServeOptions, host: str, port: int, address: str | None) -> None:
    """Run the application on the cluster at `address` (RAY_ADDRESS, else a Ray instance started here)
    until SIGTERM or Ctrl-C, then delete it."""
    connect_ray(address)
    # One proxy, on the head: nodes that share an IP (a test cluster) cannot each bind the port.
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    serve.run(build_app(serve_argv, options), name=APP_NAME, route_prefix="/")
    scaling = (f"{options.min_replicas}-{options.max_replicas} replicas, autoscaled" if options.min_replicas
               else f"{options.num_replicas} replicas")
    print_line(f"minivllm: serving {scaling} on Ray Serve ({options.routing_policy}) on http://{host}:{port}")
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, frame: received.append(number))
    while not received:
        time.sleep(0.2)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the shutdown short
        signal.signal(sig, signal.SIG_IGN)
    print_line(f"minivllm: {signal.Signals(received[0]).name}: stopping the Ray Serve application")
    serve.shutdown()  # deletes the application: each replica stops its engine

