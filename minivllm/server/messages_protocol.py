"""Anthropic's Messages requests, validated, and their conversion into the one internal chat request.

    system blocks            -> a system message
    user text / tool_result  -> user text, `tool` messages (by tool_use_id, checked against the
                                previous assistant turn's tool_use ids)
    assistant text / thinking / tool_use -> content, reasoning, tool_calls
    tool_choice auto / any / tool / none -> auto / required / a named function / none
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from minivllm.server.protocol import (APIError, ChatCompletionRequest, Int, _only, _Strict, parse_model,
                                      validation_error)

# Fields Claude Code and the SDK send that change nothing here: accepted, and named as ignored.
ACCEPTED_IGNORED = ("metadata", "context_management", "output_config", "thinking", "service_tier", "container",
                    "mcp_servers")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # prompt caching is automatic here (the prefix cache)
    citations: list | None = None


class ImageBlock(_Strict):
    type: Literal["image", "document"]
    source: dict


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str | list[TextBlock | ImageBlock] | None, _only("a string or a list of text blocks")] = None
    is_error: bool | None = None
    cache_control: dict | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(b.text if isinstance(b, TextBlock) else f"[{b.type} omitted]" for b in self.content)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


_BLOCKS = TypeAdapter(list[Block])


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant", "system"]  # Claude Code puts system notes among the turns
    content: Annotated[str | list[dict], _only("a string or a list of content blocks")]

    @model_validator(mode="after")
    def _blocks(self) -> "AnthropicMessage":
        """The blocks, each checked (one message per bad block, naming it: content.N.field)."""
        if isinstance(self.content, list):
            try:
                self.content = _BLOCKS.validate_python(self.content)
            except ValidationError as e:
                raise ValueError(validation_error(e, "content.").message) from None
        return self


class Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None  # "custom", or a server tool's type (web_search_...), which is refused
    cache_control: dict | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool", and only then')
        return self


class CountTokensRequest(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Annotated[str | list[TextBlock] | None, _only("a string or a list of text blocks")] = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict | None = None
    context_management: dict | None = None
    output_config: dict | None = None
    thinking: dict | None = None
    service_tier: str | None = None
    container: Any = None
    mcp_servers: list | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: Int | None = None


def function_tools(tools: list[Tool] | None) -> tuple[list[dict], list[str]]:
    """The request's client tools as OpenAI tools, and a note per server tool refused (a tool that
    runs on Anthropic's side: web search, code execution, ...)."""
    chat, refused = [], []
    for k, t in enumerate(tools or []):
        if t.type not in (None, "custom") or t.input_schema is None:
            refused.append(f"tools.{k} ({t.name}, type {t.type}): server tools are not run here; the model "
                           "is not told of it")
            continue
        schema = {"type": "object", **t.input_schema}
        chat.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                      "parameters": schema}})
    return chat, refused


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(b.text for b in system)


def _blocks(message: AnthropicMessage) -> list[Any]:
    return [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """The conversation as chat messages (OpenAI's shape, which the chat template reads)."""
    out: list[dict] = []
    if (system := _system_text(body.system)) is not None:
        out.append({"role": "system", "content": system})
    open_calls: set[str] = set()  # the tool_use ids of the previous assistant turn
    for m, message in enumerate(body.messages):
        if message.role == "assistant":
            out.append(_assistant(message))
            open_calls = {c["id"] for c in out[-1].get("tool_calls", [])}
            continue
        if message.role == "system":  # where it stands: the turns before it stay a cacheable prefix
            out.append({"role": "system", "content": "\n".join(b.text for b in _blocks(message)
                                                                if isinstance(b, TextBlock))})
            continue
        text: list[str] = []
        for b, block in enumerate(_blocks(message)):
            where = f"messages.{m}.content.{b}"
            if isinstance(block, ToolResultBlock):
                if block.tool_use_id not in open_calls:
                    raise APIError(400, f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: "
                                        f"{block.tool_use_id}. Each `tool_result` block must have a corresponding "
                                        "`tool_use` block in the previous message.", where)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": ("Error: " if block.is_error else "") + block.text()})
            elif isinstance(block, TextBlock):
                text.append(block.text)
            elif not isinstance(block, RedactedThinkingBlock):
                raise APIError(400, f"{where}: {block.type} blocks are not supported in a user turn here "
                                    "(the served model reads text)", where)
        if text:
            out.append({"role": "user", "content": "\n".join(text)})
        open_calls = set()
    return out


def _assistant(message: AnthropicMessage) -> dict:
    text, thought, calls = [], [], []
    for block in _blocks(message):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thought.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
    d: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        d["tool_calls"] = calls
    if thought:
        d["reasoning"] = "".join(thought)
    return d


def chat_request(body: CountTokensRequest, tools: list[dict], stream: bool = False) -> ChatCompletionRequest:
    """The internal request of a Messages request (or of a count_tokens one: no sampling)."""
    choice: Any = None
    if body.tool_choice is not None:
        t = body.tool_choice
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(t.type) or \
            {"type": "function", "function": {"name": t.name}}
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages(body), "stream": stream}
    if tools:
        chat.update(tools=tools, tool_choice=choice)
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k)
    return parse_model(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def arguments_object(arguments: str) -> dict:
    """A tool call's JSON arguments as tool_use's `input` (an object; {} for what is not one)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
