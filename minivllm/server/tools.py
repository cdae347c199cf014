"""Tool calling on /v1/chat/completions: the request's tools, the choice of tool, and the parsers
that turn the model's text into OpenAI `tool_calls`.

The Hermes format (`--tool-call-parser hermes`): the assistant answers with text and/or one or more

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice` "auto" parses that (it needs `--enable-auto-tool-choice`); "required" and a named
function constrain the output with structured outputs instead, so they always parse: "required" to
a JSON array of {"name", "arguments"} objects, a named function to its arguments object.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

TOOL_CALL_PARSERS = ("hermes",)
SHIPPED_TEMPLATES = ("chatml_tools",)
_START, _END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file path, the name of a template shipped with minivllm, or the template itself."""
    if value is None:
        return None
    if value in SHIPPED_TEMPLATES:
        return resources.files("minivllm.server").joinpath("templates", f"{value}.jinja").read_text()
    if "{" not in value:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--chat-template: no such file {value!r} (nor a template: it has no '{{')")
        return path.read_text()
    return value


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def required_schema(tools: list[dict]) -> dict:
    """JSON schema of a non-empty list of calls to any of `tools` (each {"name", "description",
    "parameters"})."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": t.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"]} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def _call_from_json(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer. A call that is not valid JSON is left in the content."""
    if _START not in text:
        return text, []
    calls = [_call_from_json(m.group(1)) for m in _CALL.finditer(text)]
    if not calls or any(c is None for c in calls):
        return text, []
    content = text[: text.index(_START)].strip()
    return content or None, calls


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a `tool_choice: "required"` answer (a JSON array; constrained, so it parses unless
    cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    return [ToolCall(i["name"], json.dumps(i["arguments"], ensure_ascii=False)) for i in items
            if isinstance(i, dict) and "name" in i and "arguments" in i]


class HermesStream:
    """Splits a streamed answer into content deltas and whole tool calls: content streams until a
    `<tool_call>` begins; each call is sent once its `</tool_call>` has arrived (or at the end)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_calls = False
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content = ""
        if not self.in_calls:
            at = self.buffer.find(_START)
            if at < 0:
                # Hold back a tail that may be the start of "<tool_call>".
                keep = 0 if finished else held_back(self.buffer, _START)
                content, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return content, []
            content, self.buffer, self.in_calls = self.buffer[:at], self.buffer[at:], True
        calls = []
        while (end := self.buffer.find(_END)) >= 0:
            calls.append(self.buffer[: end + len(_END)])
            self.buffer = self.buffer[end + len(_END):].lstrip()
        if finished and self.buffer.strip():
            calls.append(self.buffer)
            self.buffer = ""
        parsed = [c for text in calls if (c := _call_from_json(_CALL.search(text).group(1) if _CALL.search(text)
                                                               else text)) is not None]
        self.num_calls += len(parsed)
        return content, parsed


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallOutput:
    """Turns one chat request's choices into OpenAI content and tool_calls, whole or streamed.

    mode "auto": the Hermes parser; "required": a constrained JSON array of calls; "named": the
    constrained output is the arguments of the function `name`.
    """

    def __init__(self, mode: str, name: str | None = None) -> None:
        self.mode, self.name = mode, name
        self._hermes: dict[int, HermesStream] = {}
        self._buffers: dict[int, str] = {}
        self._named: dict[int, ToolCall] = {}
        self._num_calls: dict[int, int] = {}

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "auto":
            return parse_hermes(text)
        if self.mode == "required":
            calls = parse_required(text)
            return (None, calls) if calls else (text, [])
        return None, [ToolCall(self.name, text)]

    def stream(self, index: int, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_calls deltas) for one choice's new text."""
        if self.mode == "auto":
            content, calls = self._hermes.setdefault(index, HermesStream()).feed(text, finished)
            return content, self._deltas(index, calls)
        if self.mode == "required":
            self._buffers[index] = self._buffers.get(index, "") + text
            return "", self._deltas(index, parse_required(self._buffers[index]) if finished else [])
        if index not in self._named:  # the first delta names the call, the rest extend its arguments
            call = self._named[index] = ToolCall(self.name, text)
            return "", [call.openai(0)]
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []

    def _deltas(self, index: int, calls: list[ToolCall]) -> list[dict]:
        first = self._num_calls.get(index, 0)
        self._num_calls[index] = first + len(calls)
        return [c.openai(first + k) for k, c in enumerate(calls)]

    def called(self, index: int) -> bool:
        """Whether a streamed choice has sent any tool call (its finish reason is then tool_calls)."""
        return bool(self._num_calls.get(index) or index in self._named)
