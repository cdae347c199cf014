"""The requests of the OpenAI-compatible API, validated: pydantic models of every known field, and the
errors (in OpenAI's shape) that a bad request gets.

Known fields are parsed strictly (an ill-typed value is a 400 that names the field) and validated
before anything streams, so a bad request never becomes a broken stream. Fields the server does not
know are accepted and kept aside (model_extra), to be reported as ignored.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator

from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.server.tools import required_schema


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


# The tags pydantic puts in an error's path inside a discriminated union: not part of the request's path.
_UNION_TAGS = ("message", "function_call", "function_call_output", "reasoning", "text", "image", "document",
               "tool_use", "tool_result", "thinking", "redacted_thinking")


def validation_error(e: ValidationError, prefix: str = "") -> APIError:
    """One message naming each bad field (at most three), e.g. 'messages.0.role: Input should be ...'."""
    parts, params = [], []
    for err in e.errors()[:3]:
        loc = err["loc"]
        path = prefix + ".".join(str(x) for k, x in enumerate(loc)  # a tag sits between an index and a field
                                 if not (x in _UNION_TAGS and 0 < k < len(loc) - 1 and isinstance(loc[k - 1], int)))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{path}: {msg}" if path else msg)
        params.append(path or None)
    return APIError(400, "; ".join(parts), params[0])


def engine_error(e: ValueError, request: BaseModel, default_field: str) -> APIError:
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


class GenerationRequest(_Strict):
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
            raise engine_error(e, self, "request") from None

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


class CompletionRequest(GenerationRequest):
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


class ChatCompletionRequest(GenerationRequest):
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


def parse_request(model: type[_Strict], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def parse_model(model: type[_Strict], value: Any) -> Any:
    """A request built by a converter (Messages, Responses -> chat), validated as a client's would be."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_error(e) from None


# -- the frontend's own endpoints (vLLM's fields) ------------------------------------------------------------
class TokenizeRequest(_Strict):
    """/tokenize: exactly one of prompt and messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: yes for a prompt, no for messages (a template writes them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int]
