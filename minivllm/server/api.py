"""An OpenAI-compatible HTTP server over the engine, shaped like vLLM's: its routes.

    POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with stream=true)
    POST /v1/responses, GET/DELETE /v1/responses/{id}: OpenAI's Responses API (responses.py)
    POST /v1/messages, /v1/messages/count_tokens: Anthropic's Messages API (messages.py)
    POST /tokenize, /detokenize (vLLM's: answered here, by the tokenizer, without the engine)
    GET  /v1/models, /health, /metrics
    GET  /, /dashboard (and /dashboard/...): the live view of the step loop (dashboard.py)

The server talks to an engine client (async_engine.EngineClient): by default the engine runs in its own
process (core_client.py), so that HTTP, tokenization and detokenization here never take the engine's
interpreter; `--disable-frontend-multiprocessing` runs it on a thread of this process (AsyncEngine).
Every API surface converts its request into one internal request (serving.py), validated there, and
frames the engine's outputs in its own shape (framing.py for OpenAI's chunks). Fields the server does
not know are accepted and ignored, as vLLM does: logged once per name, and listed per response in the
`X-Ignored-Fields` header. Errors take the API's shape: OpenAI's {"error": {"message", "type", "param",
"code"}}, Anthropic's under /v1/messages.
"""
from __future__ import annotations

import logging
import secrets
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minivllm.engine.llm_engine import PromptType
from minivllm.frontend.async_engine import EngineClient, EngineDeadError
from minivllm.server.dashboard import Dashboard, add_routes
from minivllm.server.framing import CompletionFormatter, stream_events
from minivllm.server.http_server import HTTPServer
from minivllm.server.lora_routes import add_lora_routes
from minivllm.server.messages import MessagesAPI, anthropic_error
from minivllm.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, ignored_fields, parse_request)
from minivllm.server.responses import ResponsesAPI
from minivllm.server.serving import Generation, ServerOptions, Serving, read_body

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 30  # in-flight requests get this long to finish on SIGTERM; then they are aborted
__all__ = ["ChatMessage", "ServerOptions", "build_app", "serve", "add_error_handlers", "read_body"]


# -- the server ------------------------------------------------------------------------------------------------
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


class OpenAIServer(Serving):
    """The routes of the OpenAI API (chat/completions) and of the frontend (tokenize, models, health);
    Messages and Responses are their own files, over the same Serving."""

    # -- endpoints -------------------------------------------------------------------------------------------
    async def health(self) -> Response:
        try:
            self.engine.check_running()
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "engine_dead") from None
        return Response(status_code=200)

    async def metrics_endpoint(self) -> Response:
        content, content_type = self.metrics.render()
        return Response(content, media_type=content_type)

    async def models(self) -> JSONResponse:
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [{
            "id": self.options.served_model_name, "object": "model", "created": created,
            "owned_by": "minivllm", "max_model_len": self.engine.max_model_len},
            *self.lora.model_cards(created)]})

    async def tokenize(self, request: Request) -> JSONResponse:
        body = parse_request(TokenizeRequest, await read_body(request))
        self.lora.resolve(body.model)
        chat = body.messages is not None
        text = self.chat_prompt(body.messages, body.add_generation_prompt) if chat else body.prompt
        # vLLM's defaults: a template writes its special tokens itself; a plain prompt gets the tokenizer's
        add_special = (not chat) if body.add_special_tokens is None else body.add_special_tokens
        tokens = self.tokenizer.encode(text, add_special_tokens=add_special)
        answer = {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            answer["token_strs"] = [self.tokenizer.backend.id_to_token(t) for t in tokens]
        return JSONResponse(answer)

    async def detokenize(self, request: Request) -> JSONResponse:
        body = parse_request(DetokenizeRequest, await read_body(request))
        self.lora.resolve(body.model)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    async def completions(self, request: Request) -> Response:
        received = time.perf_counter()
        body = parse_request(CompletionRequest, await read_body(request))
        lora = self.lora.resolve(body.model)
        if body.suffix:
            raise APIError(400, "suffix: fill-in-the-middle is not supported: the served model has no FIM "
                                "template (prefix/suffix/middle tokens)", "suffix", "unsupported")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported; prompt_logprobs gives the prompt's", "echo",
                           "unsupported")
        params = body.sampling_params(body.max_tokens, body.logprobs, await self.structured(body))
        prompts = _completion_prompts(body.prompt)
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if body.echo else None
        formatter = CompletionFormatter(self.token_text, body.logprobs, echo, params.n)
        return await self._answer(request, Generation(body, prompts, params, formatter, "prompt",
                                                      ignored_fields(body), received, lora))

    async def chat_completions(self, request: Request) -> Response:
        received = time.perf_counter()
        body = parse_request(ChatCompletionRequest, await read_body(request))
        return await self._answer(request, await self.chat_generation(body, received, ignored_fields(body)))

    async def _answer(self, request: Request, gen: Generation) -> Response:
        """OpenAI's framing: server-sent chunks then [DONE], or the whole response."""
        sub = await self.submit(gen)
        if gen.body.stream:
            return EventSourceResponse(stream_events(sub.chunks(), sub.tracker, gen.formatter, sub.base,
                                                     gen.body.include_usage, gen.received), headers=sub.headers)
        answer = await sub.whole(request)
        if answer is None:  # the client hung up: nobody to answer
            return Response(status_code=499)
        body = answer.model_dump()
        body["time_breakdown_ms"] = sub.tracker.time_breakdown_ms(gen.received, time.perf_counter())
        return JSONResponse(body, headers=sub.headers)

    # -- authentication -----------------------------------------------------------------------------------------
    def check_api_key(self, credentials: Bearer, x_api_key: Annotated[str | None, Header()] = None) -> None:
        """The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key)."""
        key = self.options.api_key
        if key is None:
            return
        sent = credentials.credentials if credentials is not None else x_api_key
        if sent is None:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key')",
                           None, "invalid_api_key")
        if not secrets.compare_digest(sent.encode(), key.encode()):
            raise APIError(401, "incorrect API key", None, "invalid_api_key")


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """A completion request may carry several prompts; each becomes its own choices."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    return list(prompt)


# -- the app -----------------------------------------------------------------------------------------------------
def build_app(engine: EngineClient, options: ServerOptions) -> FastAPI:
    server = OpenAIServer(engine, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await server.engine.shutdown()

    app = FastAPI(title="minivllm", lifespan=lifespan)
    v1 = [Depends(server.check_api_key)]
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_endpoint)
    app.get("/v1/models", dependencies=v1)(server.models)
    app.post("/v1/completions", dependencies=v1)(server.completions)
    app.post("/v1/chat/completions", dependencies=v1)(server.chat_completions)
    app.post("/tokenize", dependencies=v1)(server.tokenize)
    app.post("/detokenize", dependencies=v1)(server.detokenize)
    messages, responses = MessagesAPI(server), ResponsesAPI(server)
    app.post("/v1/messages", dependencies=v1)(messages.create)
    app.post("/v1/messages/count_tokens", dependencies=v1)(messages.count_tokens)
    app.post("/v1/responses", dependencies=v1)(responses.create)
    app.get("/v1/responses/{response_id}", dependencies=v1)(responses.retrieve)
    app.delete("/v1/responses/{response_id}", dependencies=v1)(responses.delete)
    add_lora_routes(app, server.lora, v1)
    add_routes(app, Dashboard(options.api_key, engine.feed, title=options.served_model_name))

    add_error_handlers(app)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error in its API's shape: Anthropic's under /v1/messages, OpenAI's elsewhere (the router's
    app uses them too)."""
    def shaped(request: Request, e: APIError) -> JSONResponse:
        if request.url.path.startswith("/v1/messages"):
            return anthropic_error(e)
        return e.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return shaped(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # unknown path, method
        return shaped(request, APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect) -> Response:  # hung up while sending the body
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return shaped(request, APIError(500, f"internal server error: {e!r}", None, "internal_error"))


def serve(engine: EngineClient, options: ServerOptions, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until SIGTERM or Ctrl-C, then stop accepting, let in-flight requests finish (aborting
    those still running after GRACEFUL_SHUTDOWN_S), and return."""
    app = build_app(engine, options)
    print("minivllm: batch-invariant kernels: " + (
        "yes (the same request gets the same logits whatever shares its steps)" if engine.batch_invariant
        else "no (torch kernels: a near-tie may break differently as the batch changes)"), flush=True)
    server = HTTPServer(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S),
                        options.served_model_name, engine.startup_time)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; by then all is
    # done, so let it pass and exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
