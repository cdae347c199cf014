"""Tool calling: the request's tools, the choice of tool, and the turning of a choice's text into
OpenAI `tool_calls`, whole or streamed, in every API (chat/completions, Responses, Messages).

`tool_choice` "auto" reads the model family's own format (tool_parsers.py; it needs
`--enable-auto-tool-choice --tool-call-parser NAME`); "required" and a named function constrain the
output with structured outputs instead, so the arguments are valid against the tool's schema by
construction: "required" to a JSON array of {"name", "arguments"} objects, a named function to its
arguments object.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from minivllm.server.json_scan import PartialCall, scan_calls
from minivllm.server.tool_parsers import (CallDeltas, HarmonyStream, MarkerStream, Parsed, ToolCall, parse_tool_calls,
                                          tool_stream)

SHIPPED_TEMPLATES = ("chatml_tools",)


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


def required_schema(tools: list[dict]) -> dict:
    """JSON schema of a non-empty list of calls to any of `tools` (each {"name", "description",
    "parameters"})."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "arguments": t.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"]} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


class _ConstrainedStream:
    """The text of a constrained answer: a JSON array of calls ("required"), or the arguments of the
    one named function."""

    def __init__(self, name: str | None) -> None:
        self.name, self.text = name, ""

    def feed(self, delta: str, finished: bool) -> Parsed:
        self.text += delta
        if self.name is None:
            return Parsed(calls=scan_calls(self.text))
        return Parsed(calls=[PartialCall(self.name, self.text, finished)])


class ToolCallOutput:
    """Turns one request's choices into content, reasoning and tool calls, whole or streamed.

    mode "auto": the family's parser; "required": a constrained JSON array of calls; "named": the
    constrained output is the arguments of the function `name`.
    """

    def __init__(self, mode: str, parser: str = "hermes", name: str | None = None) -> None:
        self.mode, self.parser, self.name = mode, parser, name
        self._streams: dict[int, MarkerStream | HarmonyStream | _ConstrainedStream] = {}
        self._deltas: dict[int, CallDeltas] = {}

    def whole(self, text: str) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, reasoning) of a whole answer."""
        if self.mode == "auto":
            return parse_tool_calls(self.parser, text)
        parsed = _ConstrainedStream(self.name).feed(text, True)
        calls = [ToolCall(c.name, c.arguments or "{}") for c in parsed.calls if c.name and c.complete]
        return (None, calls, None) if calls else (text, [], None)

    def stream(self, index: int, text: str, finished: bool) -> tuple[str, list[dict], str]:
        """(content delta, tool_calls deltas, reasoning delta) for one choice's new text."""
        if index not in self._streams:
            self._streams[index] = tool_stream(self.parser) if self.mode == "auto" else _ConstrainedStream(
                self.name if self.mode == "named" else None)
            self._deltas[index] = CallDeltas(self.parser)
        parsed = self._streams[index].feed(text, finished)
        return parsed.content, self._deltas[index].deltas(parsed.calls), parsed.reasoning

    def called(self, index: int) -> bool:
        """Whether a streamed choice has sent any tool call (its finish reason is then tool_calls)."""
        return index in self._deltas and bool(self._deltas[index].ids)
