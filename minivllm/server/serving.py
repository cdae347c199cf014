"""What every API surface of the server shares: the options, the one internal request (`Generation`),
its validation, limits and submission to the engine, and the body reader.

Chat/completions (api.py), Messages (messages.py) and Responses (responses.py) each parse their own
body, convert it into a `ChatCompletionRequest` (or a `CompletionRequest`), and hand it here: the
chat template, tool choice, structured outputs, sampling checks, the queue and engine errors are
one code path; each surface only frames the result (its own events and error shape).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
from fastapi import Request
from pydantic import BaseModel

from minivllm.engine.llm_engine import PromptType
from minivllm.frontend.async_engine import EngineClient, EngineDeadError, EngineRequest, QueueFullError, RequestStream
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.server.framing import ChatFormatter, ChoiceTracker, Formatter, stream_chunks, whole_choice
from minivllm.server.lora_routes import LoRARoutes
from minivllm.server.metrics import ServerMetrics
from minivllm.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, GenerationRequest,
                                      NamedToolChoice, ToolDefinition, engine_error, ignored_fields)
from minivllm.server.reasoning import REASONING_PARSERS
from minivllm.server.tool_parsers import NEEDS_SPECIAL_TOKENS, TOOL_CALL_PARSERS
from minivllm.server.tools import ToolCallOutput

logger = logging.getLogger(__name__)

# ~100x the JSON of a 32k-token prompt; an agent's request (a long system prompt, a dozen tool schemas and
# the conversation so far) is tens of KB to a few MB.
MAX_BODY_BYTES = 4 * 2**20
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_logged_ignored: set[str] = set()  # unknown field names already logged (once each)


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
    response_store_entries: int = 1000  # /v1/responses kept for previous_response_id (LRU)
    response_store_bytes: int = 64 * 2**20

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
class Generation:
    """The one internal request: validated, ready for the engine."""

    body: GenerationRequest
    prompts: list[PromptType]
    params: SamplingParams
    formatter: Formatter
    prompt_field: str  # where a prompt error points: "prompt" or "messages"
    ignored: list[str]  # unknown request fields, named in the response
    received: float  # when the server began to read it (time.perf_counter: the engine's clock too)
    lora: LoRARequest | None = None  # the adapter the request's model names


@dataclass
class Submitted:
    """A generation the engine has accepted: its outputs, and how to frame them."""

    gen: Generation
    stream: RequestStream
    tracker: ChoiceTracker
    base: dict[str, Any]  # id, created, model of every response and chunk
    headers: dict[str, str]

    def chunks(self) -> AsyncIterator[BaseModel]:
        return stream_chunks(self.stream, self.tracker, self.gen.formatter, self.base, len(self.tracker.index_of))

    async def whole(self, request: Request) -> BaseModel | None:
        """The whole answer (None if the client hung up first)."""
        try:
            finals = await collect(self.stream, request)
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "engine_dead") from None
        if finals is None:
            return None
        for out in finals:
            self.tracker.delta(out)
        choices = [whole_choice(self.tracker.index_of[o.request_id], o) for o in finals]
        return self.gen.formatter.response(self.base, sorted(choices, key=lambda d: d.index), self.tracker.usage())


class PromptTooLong(APIError):
    """The prompt fills the context: the text Claude Code compacts its conversation on."""

    def __init__(self, num_tokens: int, maximum: int) -> None:
        super().__init__(400, f"prompt is too long: {num_tokens} tokens > {maximum - 1} maximum", "messages",
                         "context_length_exceeded")


class Serving:
    """The engine, the tokenizer and the checks every API surface shares."""

    def __init__(self, engine: EngineClient, options: ServerOptions) -> None:
        self.options = options
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_num_seqs = engine.max_num_seqs
        self.metrics = ServerMetrics(options.served_model_name, lambda: self.engine.stats)
        engine.on_finished = self.metrics.observe_finished
        self.lora = LoRARoutes(engine, options.served_model_name, options.lora_modules, APIError)

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[ToolDefinition] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [m.template_dict() for m in messages], add_generation_prompt, self.options.chat_template,
                [t.model_dump(exclude_none=True) for t in tools] if tools else None, **(template_kwargs or {}))
        except TypeError as e:  # a chat_template_kwargs key that names one of the template's own arguments
            raise APIError(400, f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"messages: {e}", "messages") from None

    def tool_output(self, body: ChatCompletionRequest) -> ToolCallOutput | None:
        choice = body.effective_tool_choice
        parser = self.options.tool_call_parser or "hermes"
        if choice == "none":  # harmony's channels are the answer's structure, tools or not
            return ToolCallOutput("auto", parser) if parser == "openai" else None
        if isinstance(choice, NamedToolChoice):
            return ToolCallOutput("named", parser, body.named_tool(choice.function.name).name)
        if choice == "auto" and not self.options.enable_auto_tool_choice:
            raise APIError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                                '--tool-call-parser (or send tool_choice "required", "none" or a named function)',
                           "tool_choice")
        return ToolCallOutput(choice, parser)

    async def structured(self, body: GenerationRequest) -> StructuredOutputsParams | None:
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

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def chat_generation(self, body: ChatCompletionRequest, received: float, ignored: list[str],
                              fit_context: bool = False) -> Generation:
        """A chat request as the internal request. fit_context (the agent APIs, whose max_tokens is a
        ceiling, not a promise): a prompt that fills the context is PromptTooLong, and max_tokens is cut
        to what fits after the prompt."""
        lora = self.lora.resolve(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = self.tool_output(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prompt: PromptType = self.chat_prompt(body.messages, True, body.tools, body.chat_template_kwargs)
        if fit_context:
            prompt = self.tokenizer.encode(prompt)  # as the engine would, counted here once
            limit = self.engine.max_model_len
            if len(prompt) >= limit:
                raise PromptTooLong(len(prompt), limit)
            max_tokens = min(max_tokens or limit, limit - len(prompt))
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                      await self.structured(body))
        if tools is not None and tools.mode == "auto" and tools.parser in NEEDS_SPECIAL_TOKENS:
            params.skip_special_tokens = False  # the family's markers are special tokens
        formatter = ChatFormatter(self.token_text, body.top_logprobs or 0, tools, self.options.reasoning_parser)
        return Generation(body, [prompt], params, formatter, "messages", ignored, received, lora)

    async def submit(self, gen: Generation) -> Submitted:
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
        return Submitted(gen, stream, tracker, base, ignored_header(gen.ignored))


def ignored_header(ignored: list[str]) -> dict[str, str]:
    """Tell the client which of its fields were ignored; log each field name once per process."""
    new = [name for name in ignored if name not in _logged_ignored]
    if new:
        _logged_ignored.update(new)
        logger.warning("ignoring unknown request fields (logged once each): %s", ", ".join(new))
    # Headers are latin-1: a field or tool name a client wrote in another script is escaped, not a 500.
    return {IGNORED_FIELDS_HEADER: ", ".join(ignored).encode("ascii", "backslashreplace").decode()} if ignored else {}


def known_ignored(body: BaseModel, accepted: tuple[str, ...]) -> list[str]:
    """The unknown fields of a request plus those it names as accepted-and-ignored (sent by the agent
    clients, changing nothing here) that it carries; list indices folded (cache_control on every block
    is one name)."""
    names = ignored_fields(body) + [name for name in accepted if getattr(body, name, None) is not None]
    return sorted({re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in names})


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


async def collect(stream: RequestStream, request: Request) -> list[RequestOutput] | None:
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
