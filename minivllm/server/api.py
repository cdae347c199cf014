"""An OpenAI-compatible HTTP server over the engine, shaped like vLLM's: its routes.

    POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with stream=true)
    POST /tokenize, /detokenize (vLLM's: answered here, by the tokenizer, without the engine)
    GET  /v1/models, /health, /metrics
    GET  /, /dashboard (and /dashboard/...): the live view of the step loop (dashboard.py)

The server talks to an engine client (async_engine.EngineClient): by default the engine runs in its own
process (core_client.py), so that HTTP, tokenization and detokenization here never take the engine's
interpreter; `--disable-frontend-multiprocessing` runs it on a thread of this process (AsyncEngine).
Requests are validated first (protocol.py), and the engine's outputs framed as OpenAI's responses and
stream chunks (framing.py). Fields the server does not know are accepted and ignored, as vLLM does:
logged once per name, and listed per response in the `X-Ignored-Fields` header. Errors take OpenAI's
shape: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

import jinja2
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minivllm.engine.llm_engine import PromptType
from minivllm.frontend.async_engine import EngineClient, EngineDeadError, EngineRequest, QueueFullError, RequestStream
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.server.dashboard import Dashboard, add_routes
from minivllm.server.framing import (ChatFormatter, ChoiceTracker, CompletionFormatter, Formatter, stream_events,
                                     whole_choice)
from minivllm.server.http_server import HTTPServer
from minivllm.server.lora_routes import LoRARoutes, add_lora_routes
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                      DetokenizeRequest, GenerationRequest, NamedToolChoice, TokenizeRequest,
                                      ToolDefinition, engine_error, ignored_fields, parse_request)
from minivllm.server.reasoning import REASONING_PARSERS
from minivllm.server.tools import TOOL_CALL_PARSERS, ToolCallOutput

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20  # ~100x the JSON of a 32k-token prompt
GRACEFUL_SHUTDOWN_S = 30  # in-flight requests get this long to finish on SIGTERM; then they are aborted
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_logged_ignored: set[str] = set()  # unknown field names already logged (once each)


# -- the server ------------------------------------------------------------------------------------------------
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]

@dataclass
class ServerOptions:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int | None = None  # None: no limit
    chat_template: str | None = None  # replaces the model's (the text of a Jinja template)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse tool calls out of the text
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # server/reasoning.py: split a thinking model's <think> part off
    lora_modules: list[LoRARequest] = field(default_factory=list)  # adapters loaded at start (--lora-modules)

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")


@dataclass
class _Generation:
    """A validated request, ready for the engine."""

    body: GenerationRequest
    prompts: list[PromptType]
    params: SamplingParams
    formatter: Formatter
    prompt_field: str  # where a prompt error points: "prompt" or "messages"
    ignored: list[str]  # unknown request fields, named in the response
    received: float  # when the server began to read it (time.perf_counter: the engine's clock too)
    lora: LoRARequest | None = None  # the adapter the request's model names


class OpenAIServer:
    def __init__(self, engine: EngineClient, options: ServerOptions) -> None:
        self.options = options
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_num_seqs = engine.max_num_seqs
        self.metrics = ServerMetrics(options.served_model_name, lambda: self.engine.stats)
        engine.on_finished = self.metrics.observe_finished
        self.lora = LoRARoutes(engine, options.served_model_name, options.lora_modules, APIError)

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
        text = self._chat_prompt(body.messages, body.add_generation_prompt) if chat else body.prompt
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
        params = body.sampling_params(body.max_tokens, body.logprobs, await self._structured(body))
        prompts = _completion_prompts(body.prompt)
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if body.echo else None
        formatter = CompletionFormatter(self._token_text, body.logprobs, echo, params.n)
        return await self._generate(request, _Generation(body, prompts, params, formatter, "prompt",
                                                         ignored_fields(body), received, lora))

    async def chat_completions(self, request: Request) -> Response:
        received = time.perf_counter()
        body = parse_request(ChatCompletionRequest, await read_body(request))
        lora = self.lora.resolve(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = self._tool_output(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                      await self._structured(body))
        prompt = self._chat_prompt(body.messages, True, body.tools, body.chat_template_kwargs)
        formatter = ChatFormatter(self._token_text, body.top_logprobs or 0, tools, self.options.reasoning_parser)
        return await self._generate(request, _Generation(body, [prompt], params, formatter, "messages",
                                                         ignored_fields(body), received, lora))

    def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                     tools: list[ToolDefinition] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [m.template_dict() for m in messages], add_generation_prompt, self.options.chat_template,
                [t.model_dump(exclude_none=True) for t in tools] if tools else None, **(template_kwargs or {}))
        except TypeError as e:  # a chat_template_kwargs key that names one of the template's own arguments
            raise APIError(400, f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"messages: {e}", "messages") from None

    def _tool_output(self, body: ChatCompletionRequest) -> ToolCallOutput | None:
        choice = body.effective_tool_choice
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return ToolCallOutput("named", body.named_tool(choice.function.name).name)
        if choice == "auto" and not self.options.enable_auto_tool_choice:
            raise APIError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                                '--tool-call-parser (or send tool_choice "required", "none" or a named function)',
                           "tool_choice")
        return ToolCallOutput(choice)

    async def _structured(self, body: GenerationRequest) -> StructuredOutputsParams | None:
        """The request's output constraint, its grammar compiled (by the engine, off the event loop and the
        step loop) so that a grammar the library rejects is a 400 naming the field."""
        found = body.structured()
        if found is None:
            return None
        name, params = found
        try:
            await self.engine.check_structured(params)
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", name) from None
        return params

    # -- shared by both APIs -----------------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _generate(self, request: Request, gen: _Generation) -> Response:
        if gen.params.n > self.max_num_seqs:
            raise APIError(400, f"n must be <= {self.max_num_seqs} (max_num_seqs), got {gen.params.n}", "n")
        fmt = gen.formatter
        base = {"id": f"{fmt.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": gen.lora.lora_name if gen.lora else self.options.served_model_name}
        children = gen.params.fan_out()
        requests = [EngineRequest(f"{base['id']}-{p * len(children) + k}", prompt, child, gen.lora)
                    for p, prompt in enumerate(gen.prompts) for k, child in enumerate(children)]
        tracker = ChoiceTracker({r.request_id: i for i, r in enumerate(requests)}, len(children))
        try:
            stream = await self.engine.generate(requests, gen.body.priority, gen.body.user or "default")
        except ValueError as e:  # the engine's checks: the prompt's emptiness, token ids, length; stop tokens
            raise engine_error(e, gen.body, gen.prompt_field) from None
        except QueueFullError as e:
            raise APIError(503, str(e), None, "queue_full") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "engine_dead") from None
        headers = self._ignored_header(gen.ignored)
        if gen.body.stream:
            return EventSourceResponse(stream_events(stream, tracker, fmt, base, gen.body.include_usage,
                                                     len(requests), gen.received), headers=headers)
        try:
            finals = await _collect(stream, request)
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "engine_dead") from None
        if finals is None:  # the client hung up: nobody to answer
            return Response(status_code=499)
        for out in finals:
            tracker.delta(out)
        choices = [whole_choice(tracker.index_of[o.request_id], o) for o in finals]
        answer = fmt.response(base, sorted(choices, key=lambda d: d.index), tracker.usage()).model_dump()
        answer["time_breakdown_ms"] = tracker.time_breakdown_ms(gen.received, time.perf_counter())
        return JSONResponse(answer, headers=headers)

    @staticmethod
    def _ignored_header(ignored: list[str]) -> dict[str, str]:
        """Tell the client which of its fields were ignored; log each field name once per process."""
        new = [name for name in ignored if name not in _logged_ignored]
        if new:
            _logged_ignored.update(new)
            logger.warning("ignoring unknown request fields (logged once each): %s", ", ".join(new))
        return {IGNORED_FIELDS_HEADER: ", ".join(ignored)} if ignored else {}

    # -- authentication -----------------------------------------------------------------------------------------
    def check_api_key(self, credentials: Bearer) -> None:
        key = self.options.api_key
        if key is None:
            return
        if credentials is None:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'", None,
                           "invalid_api_key")
        if not secrets.compare_digest(credentials.credentials.encode(), key.encode()):
            raise APIError(401, "incorrect API key", None, "invalid_api_key")


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """A completion request may carry several prompts; each becomes its own choices."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    return list(prompt)


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(int(declared))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large(len(body))
    return bytes(body)


def _too_large(size: int) -> APIError:
    return APIError(413, f"request body is too large: {size} bytes, the limit is {MAX_BODY_BYTES}", None,
                    "request_too_large")


async def _collect(stream: RequestStream, request: Request) -> list[RequestOutput] | None:
    """The final output of every request of the group, or None if the client hangs up first (which
    aborts them)."""
    finals: list[RequestOutput] = []

    async def consume() -> None:
        async for out in stream:
            if out.finished:
                finals.append(out)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    consumer, hangup = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({consumer, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        consumer.cancel()
        hangup.cancel()
        stream.close()
    if not consumer.done() or consumer.cancelled():
        return None
    consumer.result()  # raises EngineDeadError, if that is how it ended
    return finals


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
    add_lora_routes(app, server.lora, v1)
    add_routes(app, Dashboard(options.api_key, engine.feed, title=options.served_model_name))

    add_error_handlers(app)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape (the router's app uses them too)."""
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # unknown path, method
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect) -> Response:  # hung up while sending the body
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {e!r}", None, "internal_error").response()


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
