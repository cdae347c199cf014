"""OpenAI's Responses requests, validated, and their conversion into the one internal chat request.

    instructions                 -> a system message (not carried over by previous_response_id)
    message items                -> messages (developer -> system, as the templates know it)
    reasoning items              -> the next assistant message's reasoning
    function_call items          -> an assistant message's tool_calls
    function_call_output items   -> `tool` messages (checked against the calls made before)
    text.format json_schema      -> structured outputs; tools + tool_choice as chat's
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError, model_validator

from minivllm.server.protocol import (APIError, ChatCompletionRequest, Int, _only, _Strict, parse_model,
                                      validation_error)

# Fields the Agents SDK and Codex CLI send that change nothing here: accepted, and named as ignored.
# (prompt_cache_key needs no steering: one engine, one prefix cache.)
ACCEPTED_IGNORED = ("include", "prompt_cache_key", "client_metadata", "metadata", "truncation", "service_tier",
                    "safety_identifier", "max_tool_calls", "reasoning", "parallel_tool_calls", "background")


class ContentPart(_Strict):
    type: Literal["input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"]
    text: str | None = None
    refusal: str | None = None
    annotations: list | None = None
    logprobs: list | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str | list[ContentPart], _only("a string or a list of input_text/output_text parts")]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or p.refusal or "" for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[str | list[ContentPart], _only("a string or a list of text parts")]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text or "" for p in self.output)


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None
    encrypted_content: str | None = None  # another server's: nothing here can read it
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text or "" for p in (self.content or self.summary))


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")],
                      Discriminator(_item_type, custom_error_type="invalid_item",
                                    custom_error_message="unknown item type: input items here are message, "
                                                         "function_call, function_call_output and reasoning")]


_ITEMS = TypeAdapter(list[InputItem])


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: Annotated[str | list[dict], _only("a string or a list of input items")]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    seed: Int | None = None
    text: TextConfig | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["auto", "required", "none"] | dict | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    user: str | None = None
    include: list | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict | None = None
    metadata: dict | None = None
    truncation: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: Int | None = None
    reasoning: dict | None = None
    parallel_tool_calls: bool | None = None
    background: bool | None = None

    @model_validator(mode="after")
    def _items(self) -> "ResponsesRequest":
        """The items, each checked (one message per bad item, naming it: input.N.field)."""
        if not self.input:
            raise ValueError("input must not be empty")
        if isinstance(self.input, list):
            try:
                self.input = _ITEMS.validate_python(self.input)
            except ValidationError as e:
                raise ValueError(validation_error(e, "input.").message) from None
        return self


def function_tools(tools: list[dict] | None) -> tuple[list[dict], list[str]]:
    """The request's function tools as chat tools, and a note per other tool refused (web search, file
    search, a shell, ...: nothing here runs them)."""
    chat, refused = [], []
    for k, t in enumerate(tools or []):
        if t.get("type") != "function" or not isinstance(t.get("name"), str):
            refused.append(f"tools.{k} ({t.get('name') or t.get('type')}): only function tools are served; "
                           "the model is not told of this one")
            continue
        chat.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description"),
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
    return chat, refused


def conversation(items: str | list[Any], before: list[dict]) -> list[dict]:
    """The chat messages of a request's input items, after `before` (a stored conversation)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    calls = {c["id"] for m in before for c in m.get("tool_calls", [])}
    thought: list[str] = []

    def assistant() -> dict:  # the open assistant message that calls and thoughts join
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for k, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            thought.append(item.text())
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            out.append({"role": item.role, "content": item.text()})
            continue
        if isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(400, f"input.{k}: no tool call found for function call output with call_id "
                                    f"{item.call_id}", f"input.{k}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            continue
        message = assistant()
        if thought:
            message["reasoning"] = "".join(thought)
            thought = []
        if isinstance(item, MessageItem):
            message["content"] += item.text()
        else:
            calls.add(item.call_id)
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    return out


def tool_choice(choice: str | dict | None) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice: only auto, required, none and {type: function, name} are served",
                   "tool_choice")


def chat_request(body: ResponsesRequest, messages: list[dict], tools: list[dict]) -> ChatCompletionRequest:
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "user": body.user}
    if tools:
        chat.update(tools=tools, tool_choice=tool_choice(body.tool_choice))
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format: type json_schema needs a schema", "text.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return parse_model(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})
