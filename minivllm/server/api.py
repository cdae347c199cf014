"""An OpenAI-compatible HTTP server over the engine, shaped like vLLM's.

    POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with stream=true)
    GET  /v1/models, /health, /metrics
    GET  /, /dashboard (and /dashboard/...): the live view of the step loop (dashboard.py)

Known fields are parsed strictly (an ill-typed value is a 400 that names the field) and validated
before anything streams, so a bad request never becomes a broken stream. Fields the server does not
know are accepted and ignored, as vLLM does: logged once per name, and listed per response in the
`X-Ignored-Fields` header. Errors take OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import jinja2
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minivllm.engine.async_engine import AsyncEngine, EngineDeadError, EngineRequest, QueueFullError, RequestStream
from minivllm.engine.live import LiveFeed
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.engine.trace import run_record
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.server.dashboard import Dashboard, add_routes
from minivllm.server.metrics import ServerMetrics
from minivllm.server.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from minivllm.server.tools import TOOL_CALL_PARSERS, ToolCallOutput, required_schema
from minivllm.startup import phases_text, process_age

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20  # ~100x the JSON of a 32k-token prompt
GRACEFUL_SHUTDOWN_S = 30  # in-flight requests get this long to finish on SIGTERM; then they are aborted
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_logged_ignored: set[str] = set()  # unknown field names already logged (once each)


# -- errors ---------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_error(e: ValidationError) -> APIError:
    """One message naming each bad field (at most three), e.g. 'messages.0.role: Input should be ...'."""
    parts, params = [], []
    for err in e.errors()[:3]:
        path = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{path}: {msg}" if path else msg)
        params.append(path or None)
    return APIError(400, "; ".join(parts), params[0])


def _engine_error(e: ValueError, request: BaseModel, default_field: str) -> APIError:
    """A ValueError of SamplingParams or of the engine, pointed at the request field it is about: their
    messages start with the name of what is wrong ("top_p must be ...", "prompt has 900 tokens ...")."""
    message = str(e)
    name = message.split(maxsplit=1)[0].rstrip(":").split(".")[0] if message else ""
    if name in type(request).model_fields:
        return APIError(400, message, name)
    return APIError(400, f"{default_field}: {message}", default_field)


# -- requests -----------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    # Strict: "5" is not an int and 1 is not a bool. Unknown fields are kept aside (model_extra), to
    # be reported as ignored. No inf or nan: they would reach the sampler's arithmetic.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, populate_by_name=True)


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the fields of a parsed request that the server does not know."""
    names = [prefix + k for k in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel):
                names += ignored_fields(item, f"{prefix}{name}." + (f"{i}." if isinstance(value, list) else ""))
    return names


# Every integer must fit torch's int64 (seeds, top-k and token ids become tensors in the engine thread,
# where an overflow would fail the step of every request in the batch).
Int = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]


def _only(description: str) -> WrapValidator:
    """Replace a union's per-member errors with one message saying what the field accepts."""
    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be {description}, got {type(value).__name__}") from None
    return WrapValidator(validate)


Prompt = Annotated[str | list[str] | list[int] | list[list[int]],
                   _only("a string, a list of strings, a list of token ids or a list of token-id lists")]
Stop = Annotated[str | list[str] | None, _only("a string or a list of strings")]


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_schema: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_schema, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object)


class _GenerationRequest(_Strict):
    model: str | None = None
    n: Int = 1
    best_of: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    seed: Int | None = None
    stop: Stop = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    priority: Int = 0
    user: str | None = None  # the tenant of the fair scheduling policy
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias
    bad_words: list[str] | None = None
    allowed_token_ids: list[Int] | None = None
    prompt_logprobs: Int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names for structured_outputs.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        try:
            logit_bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias: keys must be token ids", "logit_bias") from None
        try:
            return SamplingParams(
                n=self.n, best_of=self.best_of, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=logit_bias or None, bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
                ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=structured)
        except ValueError as e:
            raise _engine_error(e, self, "request") from None

    def structured(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field it came from, the constraint) of whichever structured-output field is set."""
        given = {"structured_outputs": self.structured_outputs.params if self.structured_outputs else None,
                 "guided_json": lambda: StructuredOutputsParams(json=self.guided_json),
                 "guided_regex": lambda: StructuredOutputsParams(regex=self.guided_regex),
                 "guided_choice": lambda: StructuredOutputsParams(choice=self.guided_choice),
                 "guided_grammar": lambda: StructuredOutputsParams(grammar=self.guided_grammar),
                 **self._more_structured()}
        given = {name: make for name, make in given.items() if make is not None and
                 (name in ("structured_outputs", "response_format", "tool_choice") or getattr(self, name) is not None)}
        if len(given) > 1:
            raise APIError(400, f"{' and '.join(given)} each constrain the output: send one", list(given)[1])
        for name, make in given.items():
            try:
                return name, make()
            except ValueError as e:
                raise APIError(400, f"{name}: {e}", name) from None
        return None

    def _more_structured(self) -> dict[str, Callable[[], StructuredOutputsParams] | None]:
        return {}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    max_tokens: Int | None = 16  # OpenAI's default for completions
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, _only("a string or a list of {type: 'text', text} parts")] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls (its content may be empty)
    tool_call_id: str | None = None  # a tool result: the call it answers
    reasoning: str | None = None  # an assistant's earlier thought, as a reasoning parser returned it
    reasoning_content: str | None = None  # the same under DeepSeek's name

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        # An assistant message that carries tool_calls may have none; every other message needs one.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role} message")
        return self

    def template_dict(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        # Chat templates know system, user and assistant; OpenAI's developer role is the new system.
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:  # templates expect the arguments as an object
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if (thought := self.reasoning_content or self.reasoning) is not None:
            d["reasoning_content"] = thought  # the name thinking models' templates read
        return d


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None  # deprecated by OpenAI for max_completion_tokens; both work
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # several calls may come back either way
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the template, e.g. {"enable_thinking": false}

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" with tools, "none" without."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    def _more_structured(self) -> dict[str, Callable[[], StructuredOutputsParams] | None]:
        more: dict[str, Callable[[], StructuredOutputsParams] | None] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            more["response_format"] = lambda: StructuredOutputsParams(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "response_format: type json_schema needs a json_schema", "response_format")
            more["response_format"] = lambda: StructuredOutputsParams(json=fmt.json_schema.json_schema)
        choice = self.effective_tool_choice
        if choice == "required":
            tools = [t.function.model_dump() for t in self.tools]
            more["tool_choice"] = lambda: StructuredOutputsParams(json=required_schema(tools))
        elif isinstance(choice, NamedToolChoice):
            tool = self.named_tool(choice.function.name)
            more["tool_choice"] = lambda: StructuredOutputsParams(json=tool.parameters or {"type": "object"})
        return more

    def named_tool(self, name: str) -> FunctionDefinition:
        for t in self.tools or []:
            if t.function.name == name:
                return t.function
        raise APIError(400, f"tool_choice: no tool named {name!r} in tools", "tool_choice")


def _parse(model: type[_Strict], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None


# -- responses ----------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extension: per prompt token (None for the first), {token id: {logprob, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning: str | None = None  # with --reasoning-parser: the thought (vLLM's field) ...
    reasoning_content: str | None = None  # ... and the same under DeepSeek's name


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # {"role": "assistant"} first, then {"content": ...} and/or {"tool_calls": [...]}
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response(BaseModel):
    id: str
    object: str
    created: int
    model: str
    usage: Usage | None = None


class CompletionResponse(_Response):
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Response):
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    choices: list[ChatChunkChoice]


# -- from engine outputs to OpenAI choices ------------------------------------------------------------------
@dataclass
class Delta:
    """What one engine step added to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    text_offset: int  # where `text` starts in the choice's whole text
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # in the choice's first delta, when asked


@dataclass
class _ChoiceCursor:
    text_len: int = 0
    num_tokens: int = 0


@dataclass
class ChoiceTracker:
    """Turns the engine's cumulative outputs of a group of requests into per-choice deltas and usage."""

    index_of: dict[str, int]  # engine request id -> choice index
    n: int  # choices per prompt: prompt tokens count once per prompt
    cursors: dict[int, _ChoiceCursor] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt number -> its length

    def delta(self, out: RequestOutput) -> Delta | None:
        index, c = self.index_of[out.request_id], out.outputs[0]
        cur = self.cursors.setdefault(index, _ChoiceCursor())
        self.prompt_tokens[index // self.n] = len(out.prompt_token_ids)
        new_tokens = c.token_ids[cur.num_tokens:]
        if not new_tokens and not out.finished:
            return None
        d = Delta(index, c.text[cur.text_len:], new_tokens,
                  c.logprobs[cur.num_tokens:] if c.logprobs is not None else None, cur.text_len,
                  c.finish_reason, c.stop_reason, out.prompt_logprobs if cur.num_tokens == 0 else None)
        cur.text_len, cur.num_tokens = len(c.text), len(c.token_ids)
        return d

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.num_tokens for c in self.cursors.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _whole(index: int, out: RequestOutput) -> Delta:
    c = out.outputs[0]
    return Delta(index, c.text, c.token_ids, c.logprobs, 0, c.finish_reason, c.stop_reason, out.prompt_logprobs)


class _Formatter(ABC):
    """What differs between the two APIs: names, and how a choice and a stream chunk look."""

    object: str
    chunk_object: str
    id_prefix: str

    def __init__(self, token_text: Callable[[int], str], top_logprobs: int | None) -> None:
        self.token_text = token_text
        self.top_logprobs = top_logprobs  # how many alternatives per token were asked for, None: none

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[: self.top_logprobs]

    def stream_start(self, base: dict[str, Any], num_choices: int) -> list[BaseModel]:
        """Chunks sent before any token."""
        return []

    @abstractmethod
    def response(self, base: dict[str, Any], choices: list[Delta], usage: Usage) -> BaseModel:
        """The whole answer of a non-streamed request."""

    @abstractmethod
    def chunk(self, base: dict[str, Any], d: Delta | None, usage: Usage | None = None) -> BaseModel | None:
        """One stream event: a choice's delta, or (d=None) the usage; None: nothing to send yet."""


class _CompletionFormatter(_Formatter):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, token_text: Callable[[int], str], top_logprobs: int | None,
                 echo: list[str] | None = None, n: int = 1) -> None:
        super().__init__(token_text, top_logprobs)
        self.echo, self.n = echo, n  # echo: each prompt's text, put before its choices' first text
        self._echoed: set[int] = set()

    def _text(self, d: Delta) -> str:
        if self.echo is None or d.index in self._echoed:
            return d.text
        self._echoed.add(d.index)
        return self.echo[d.index // self.n] + d.text

    def _logprobs(self, d: Delta) -> CompletionLogprobs | None:
        if d.logprobs is None:
            return None
        tokens = [self.token_text(t) for t in d.token_ids]
        offsets = [d.text_offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[e[t] for t, e in zip(d.token_ids, d.logprobs)],
            top_logprobs=[{self.token_text(k): v for k, v in self._top(e)} for e in d.logprobs], text_offset=offsets)

    def choice(self, d: Delta) -> CompletionChoice:
        prompt_logprobs = None if d.prompt_logprobs is None else [
            None if e is None else {str(t): {"logprob": v, "decoded_token": self.token_text(t)} for t, v in e.items()}
            for e in d.prompt_logprobs]
        return CompletionChoice(index=d.index, text=self._text(d), logprobs=self._logprobs(d),
                                finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                                prompt_logprobs=prompt_logprobs)

    def response(self, base: dict[str, Any], choices: list[Delta], usage: Usage) -> BaseModel:
        return CompletionResponse(**base, object=self.object, choices=[self.choice(d) for d in choices], usage=usage)

    def chunk(self, base: dict[str, Any], d: Delta | None, usage: Usage | None = None) -> BaseModel:
        return CompletionResponse(**base, object=self.chunk_object, choices=[self.choice(d)] if d else [],
                                  usage=usage)


class _ChatFormatter(_Formatter):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, token_text: Callable[[int], str], top_logprobs: int | None,
                 tools: ToolCallOutput | None = None, reasoning_parser: str | None = None) -> None:
        super().__init__(token_text, top_logprobs)
        self.tools = tools  # None: the text is all content
        self.reasoning_parser = reasoning_parser  # None: no thought is split off
        self._thoughts: dict[int, ReasoningStream] = {}

    def _logprobs(self, d: Delta) -> ChatLogprobs | None:
        if d.logprobs is None:
            return None

        def top(token: int, logprob: float) -> TopLogprob:
            text = self.token_text(token)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return ChatLogprobs(content=[
            TokenLogprob(**top(t, e[t]).model_dump(), top_logprobs=[top(k, v) for k, v in self._top(e)])
            for t, e in zip(d.token_ids, d.logprobs)])

    def response(self, base: dict[str, Any], choices: list[Delta], usage: Usage) -> BaseModel:
        return ChatCompletionResponse(**base, object=self.object, usage=usage,
                                      choices=[self._choice(d) for d in choices])

    def _choice(self, d: Delta) -> ChatChoice:
        thought, text = split_reasoning(self.reasoning_parser, d.text) if self.reasoning_parser else (None, d.text)
        content, calls = self.tools.whole(text or "") if self.tools else (text, [])
        message = ChatResponseMessage(content=content, tool_calls=[c.openai() for c in calls], reasoning=thought,
                                      reasoning_content=thought)
        return ChatChoice(index=d.index, message=message, logprobs=self._logprobs(d),
                          finish_reason=_tool_finish(d.finish_reason, bool(calls)), stop_reason=d.stop_reason)

    def stream_start(self, base: dict[str, Any], num_choices: int) -> list[BaseModel]:
        return [ChatCompletionChunk(**base, object=self.chunk_object,
                                    choices=[ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
                for i in range(num_choices)]

    def chunk(self, base: dict[str, Any], d: Delta | None, usage: Usage | None = None) -> BaseModel | None:
        choices = [self._chunk_choice(d)] if d else []
        if d and choices[0] is None:
            return None
        return ChatCompletionChunk(**base, object=self.chunk_object, choices=choices, usage=usage)

    def _chunk_choice(self, d: Delta) -> ChatChunkChoice | None:
        finish, text, thought = d.finish_reason, d.text, ""
        if self.reasoning_parser:
            stream = self._thoughts.setdefault(d.index, ReasoningStream(self.reasoning_parser))
            thought, text = stream.feed(d.text, finish is not None)
        if self.tools is None:
            delta: dict[str, Any] = {"content": text} if text or not thought else {}
        else:  # tool calls are held back until they parse: a step may have nothing to send
            content, calls = self.tools.stream(d.index, text, d.finish_reason is not None)
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls
            finish = _tool_finish(finish, self.tools.called(d.index))
        if thought:
            delta.update(reasoning=thought, reasoning_content=thought)
        if not delta and finish is None and (self.tools or self.reasoning_parser):
            return None
        return ChatChunkChoice(index=d.index, delta=delta, logprobs=self._logprobs(d), finish_reason=finish,
                               stop_reason=d.stop_reason)


def _tool_finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for an answer that ended by calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


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

    body: _GenerationRequest
    prompts: list[PromptType]
    params: SamplingParams
    formatter: _Formatter
    prompt_field: str  # where a prompt error points: "prompt" or "messages"
    ignored: list[str]  # unknown request fields, named in the response


class OpenAIServer:
    def __init__(self, engine: LLMEngine, options: ServerOptions) -> None:
        self.options = options
        self.tokenizer = engine.tokenizer
        self.max_num_seqs = engine.config.max_num_seqs
        self.metrics = ServerMetrics(options.served_model_name, lambda: self.engine.stats)
        self.engine = AsyncEngine(engine, options.max_waiting_requests, self.metrics.observe_finished)

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
        return JSONResponse({"object": "list", "data": [{
            "id": self.options.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "minivllm", "max_model_len": self.engine.engine.max_model_len}]})

    async def completions(self, request: Request) -> Response:
        body = _parse(CompletionRequest, await read_body(request))
        self._check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix: fill-in-the-middle is not supported: the served model has no FIM "
                                "template (prefix/suffix/middle tokens)", "suffix", "unsupported")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported; prompt_logprobs gives the prompt's", "echo",
                           "unsupported")
        params = body.sampling_params(body.max_tokens, body.logprobs, await self._structured(body))
        prompts = _completion_prompts(body.prompt)
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if body.echo else None
        formatter = _CompletionFormatter(self._token_text, body.logprobs, echo, params.n)
        return await self._generate(request, _Generation(body, prompts, params, formatter, "prompt",
                                                         ignored_fields(body)))

    async def chat_completions(self, request: Request) -> Response:
        body = _parse(ChatCompletionRequest, await read_body(request))
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = self._tool_output(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                      await self._structured(body))
        try:
            prompt = self.tokenizer.apply_chat_template(
                [m.template_dict() for m in body.messages], chat_template=self.options.chat_template,
                tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                **(body.chat_template_kwargs or {}))
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        formatter = _ChatFormatter(self._token_text, body.top_logprobs or 0, tools, self.options.reasoning_parser)
        return await self._generate(request, _Generation(body, [prompt], params, formatter, "messages",
                                                         ignored_fields(body)))

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

    async def _structured(self, body: _GenerationRequest) -> StructuredOutputsParams | None:
        """The request's output constraint, its grammar compiled (off the event loop and the step loop,
        in the compiler's pool) so that a grammar the library rejects is a 400 naming the field."""
        found = body.structured()
        if found is None:
            return None
        name, params = found
        manager = await asyncio.to_thread(lambda: self.engine.engine.structured_output)
        try:
            await asyncio.wrap_future(manager.compile(params))
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", name) from None
        return params

    # -- shared by both APIs -----------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.options.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.options.served_model_name}`", "model", "model_not_found")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _generate(self, request: Request, gen: _Generation) -> Response:
        if gen.params.n > self.max_num_seqs:
            raise APIError(400, f"n must be <= {self.max_num_seqs} (max_num_seqs), got {gen.params.n}", "n")
        fmt = gen.formatter
        base = {"id": f"{fmt.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.options.served_model_name}
        children = gen.params.fan_out()
        requests = [EngineRequest(f"{base['id']}-{p * len(children) + k}", prompt, child)
                    for p, prompt in enumerate(gen.prompts) for k, child in enumerate(children)]
        tracker = ChoiceTracker({r.request_id: i for i, r in enumerate(requests)}, len(children))
        try:
            stream = await self.engine.generate(requests, gen.body.priority, gen.body.user or "default")
        except ValueError as e:  # the engine's checks: the prompt's emptiness, token ids, length; stop tokens
            raise _engine_error(e, gen.body, gen.prompt_field) from None
        except QueueFullError as e:
            raise APIError(503, str(e), None, "queue_full") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "engine_dead") from None
        headers = self._ignored_header(gen.ignored)
        if gen.body.stream:
            return EventSourceResponse(self._sse(stream, tracker, fmt, base, gen.body.include_usage, len(requests)),
                                       headers=headers)
        try:
            finals = await _collect(stream, request)
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "engine_dead") from None
        if finals is None:  # the client hung up: nobody to answer
            return Response(status_code=499)
        for out in finals:
            tracker.delta(out)
        choices = [_whole(tracker.index_of[o.request_id], o) for o in finals]
        return JSONResponse(fmt.response(base, sorted(choices, key=lambda d: d.index), tracker.usage()).model_dump(),
                            headers=headers)

    @staticmethod
    def _ignored_header(ignored: list[str]) -> dict[str, str]:
        """Tell the client which of its fields were ignored; log each field name once per process."""
        new = [name for name in ignored if name not in _logged_ignored]
        if new:
            _logged_ignored.update(new)
            logger.warning("ignoring unknown request fields (logged once each): %s", ", ".join(new))
        return {IGNORED_FIELDS_HEADER: ", ".join(ignored)} if ignored else {}

    @staticmethod
    async def _sse(stream: RequestStream, tracker: ChoiceTracker, fmt: _Formatter, base: dict[str, Any],
                   include_usage: bool, num_choices: int) -> AsyncIterator[bytes]:
        """One event per choice per engine step; a client that hangs up cancels this, which aborts."""
        try:
            for chunk in fmt.stream_start(base, num_choices):
                yield _event(chunk)
            async for out in stream:
                if (d := tracker.delta(out)) is not None and (chunk := fmt.chunk(base, d)) is not None:
                    yield _event(chunk)
            if include_usage:
                yield _event(fmt.chunk(base, None, tracker.usage()))
        except EngineDeadError as e:
            yield format_sse_event(data_str=json.dumps(APIError(503, str(e), None, "engine_dead").body()))
        finally:
            stream.close()
        yield format_sse_event(data_str="[DONE]")

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


def _event(chunk: BaseModel) -> bytes:
    return format_sse_event(data_str=chunk.model_dump_json())


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
def build_app(engine: LLMEngine, options: ServerOptions) -> FastAPI:
    server = OpenAIServer(engine, options)
    feed = LiveFeed(engine.start_time, run_record(engine.config))
    engine.observers.append(feed)

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
    add_routes(app, Dashboard(options.api_key, feed, title=options.served_model_name))

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


def listening_url(server: uvicorn.Server) -> str:
    """The address a started server listens on (the real port, with --port 0)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, model_name: str, startup_time: dict[str, float]) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.startup_time = startup_time  # the engine's start-up phases, reported once ready

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # the port is bound: now the address (and the real port, with --port 0) is known
            print(f"minivllm: serving {self.model_name} on {listening_url(self)}", flush=True)
            self._print_ready()

    def _print_ready(self) -> None:
        phases = dict(self.startup_time)
        total = process_age()
        if total is not None and "import" in phases:  # what is left is the server's own start
            phases["server"] = max(0.0, total - sum(phases.values()))
        else:
            total = sum(phases.values())
        print(f"minivllm: ready in {total:.2f} s ({phases_text(phases)})", flush=True)

    async def shutdown(self, sockets: list | None = None) -> None:
        self.config.app.state.dashboard.close()  # its event streams never end by themselves
        await super().shutdown(sockets)


def serve(engine: LLMEngine, options: ServerOptions, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until SIGTERM or Ctrl-C, then stop accepting, let in-flight requests finish (aborting
    those still running after GRACEFUL_SHUTDOWN_S), and return."""
    app = build_app(engine, options)
    print("minivllm: batch-invariant kernels: " + (
        "yes (the same request gets the same logits whatever shares its steps)" if engine.runner.batch_invariant
        else "no (torch kernels: a near-tie may break differently as the batch changes)"), flush=True)
    server = _Server(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S),
                     options.served_model_name, engine.startup_time)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; by then all is
    # done, so let it pass and exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
