"""Tool-call parsers by model family, with vLLM's names (`--tool-call-parser NAME`). Each reads its
family's own format, whole or streamed; streamed, a call's name comes first and then fragments of its
arguments that concatenate to the model's JSON.

    hermes          <tool_call>{"name": .., "arguments": {..}}</tool_call> (Qwen2.5, Hermes 2 Pro/3)
    llama3_json     [<|python_tag|>]{"name": .., "parameters": {..}}; {..}  (the answer starts with it)
    mistral         [TOOL_CALLS] [{"name": .., "arguments": {..}}] (v3) or [TOOL_CALLS]name{..} (v11+)
    granite         <|tool_call|>[{"name": .., "arguments": {..}}] (3.0; 3.1 writes <tool_call>)
    phi4_mini_json  functools[{"name": .., "arguments": {..}}]
    openai          gpt-oss's harmony channels: analysis -> reasoning, final -> content,
                    commentary to=functions.NAME -> a call of NAME (its message is the arguments)
"""
from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field

from minivllm.server.json_scan import PartialCall, scan_calls, value_end

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "granite", "phi4_mini_json", "openai")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class Parsed:
    """What a stream's new text held: content, reasoning (harmony's analysis), and every call so far."""

    content: str = ""
    reasoning: str = ""
    calls: list[PartialCall] = field(default_factory=list)


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkerStream:
    """Content until the family's marker, then the call section (held back while a marker may be
    starting)."""

    markers: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of content sent
        self.start: int | None = None  # where the call section begins (past the marker)

    def find_start(self) -> tuple[int, int] | None:
        """(where content ends, where the section begins) once a marker has come."""
        found = [(at, at + len(m)) for m in self.markers if (at := self.text.find(m)) >= 0]
        return min(found) if found else None

    def hold(self, text: str) -> int:
        return max((held_back(text, m) for m in self.markers), default=0)

    def calls(self, section: str) -> list[PartialCall]:
        return scan_calls(section)

    def feed(self, delta: str, finished: bool) -> Parsed:
        self.text += delta
        content = ""
        if self.start is None:
            found = self.find_start()
            if found is None:
                keep = 0 if finished else self.hold(self.text[self.sent:])
                content = self.text[self.sent:len(self.text) - keep]
                self.sent += len(content)
                return Parsed(content)
            content, self.start = self.text[self.sent:found[0]], found[1]
            self.sent = found[0]
        calls = self.calls(self.text[self.start:])
        if finished and not any(c.name for c in calls):  # a marker, then no call: it was all said
            content += self.text[self.sent:]
        return Parsed(content, "", calls)


class HermesStream(MarkerStream):
    markers = ("<tool_call>",)
    _TAG = re.compile(r"</?tool_call>")

    def calls(self, section: str) -> list[PartialCall]:
        return [c for segment in self._TAG.split(section) for c in scan_calls(segment)]


class GraniteStream(MarkerStream):
    markers = ("<|tool_call|>", "<tool_call>")


class Phi4MiniStream(MarkerStream):
    markers = ("functools",)


class Llama3JsonStream(MarkerStream):
    """A call only where the answer begins with one: later braces are prose or code."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.decided = False  # past the beginning: no call can start any more

    def find_start(self) -> tuple[int, int] | None:
        if self.decided:
            return None
        stripped = self.text.lstrip()
        at = len(self.text) - len(stripped)
        if stripped.startswith(self.TAG):
            return at, at + len(self.TAG)
        if stripped.startswith("{"):
            return at, at
        self.decided = bool(stripped) and not self.TAG.startswith(stripped)
        return None

    def hold(self, text: str) -> int:
        return 0 if self.decided else len(text)


class MistralStream(MarkerStream):
    markers = ("[TOOL_CALLS]",)

    def calls(self, section: str) -> list[PartialCall]:
        if section.lstrip()[:1] in ("[", "{", ""):
            return scan_calls(section)
        calls = []  # v11+: [TOOL_CALLS]name{args} repeated
        for segment in section.split("[TOOL_CALLS]"):
            brace = segment.find("{")
            if brace < 0:
                break
            end = value_end(segment, brace)
            calls.append(PartialCall(segment[:brace].strip(), segment[brace:end], end is not None))
        return calls


class HarmonyStream:
    """gpt-oss's channels (the text keeps its special tokens): each message is a header, <|message|>,
    then a body up to <|end|>, <|call|> or <|return|>."""

    _ENDS = ("<|end|>", "<|call|>", "<|return|>")
    _RECIPIENT = re.compile(r"to=functions\.([\w.-]+)")

    def __init__(self) -> None:
        self.text = ""
        self.sent: dict[int, int] = {}  # message number -> body characters sent

    def feed(self, delta: str, finished: bool) -> Parsed:
        self.text += delta
        out = Parsed()
        for number, (header, body, closed) in enumerate(self._messages()):
            channel = re.search(r"<\|channel\|>(\w+)", header)
            recipient = self._RECIPIENT.search(header)
            keep = 0 if closed or finished else max(held_back(body, e) for e in self._ENDS)
            if recipient:
                out.calls.append(PartialCall(recipient.group(1), body[:len(body) - keep], closed))
                continue
            new = body[self.sent.get(number, 0):len(body) - keep]
            self.sent[number] = self.sent.get(number, 0) + len(new)
            if channel and channel.group(1) == "analysis":
                out.reasoning += new
            else:  # final, or a commentary preamble to the user
                out.content += new
        return out

    def _messages(self) -> list[tuple[str, str, bool]]:
        found = []
        for part in self.text.split("<|start|>"):
            header, sep, body = part.partition("<|message|>")
            if not sep:
                continue
            ends = [at for e in self._ENDS if (at := body.find(e)) >= 0]
            found.append((header, body[:min(ends)] if ends else body, bool(ends)))
        return found


_STREAMS = {"hermes": HermesStream, "llama3_json": Llama3JsonStream, "mistral": MistralStream,
            "granite": GraniteStream, "phi4_mini_json": Phi4MiniStream, "openai": HarmonyStream}
# Families whose markers are special tokens, which the detokenizer would otherwise drop.
NEEDS_SPECIAL_TOKENS = ("llama3_json", "mistral", "granite", "openai")


def tool_stream(parser: str) -> MarkerStream | HarmonyStream:
    if parser not in _STREAMS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {parser!r}")
    return _STREAMS[parser]()


def _call_id(parser: str) -> str:
    if parser == "mistral":  # mistral's templates check for 9 alphanumerics
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class CallDeltas:
    """Cumulative partial calls -> OpenAI tool_calls deltas: the first names the call (with its id),
    later ones carry only what its arguments added."""

    def __init__(self, parser: str = "hermes") -> None:
        self.parser = parser
        self.ids: list[str] = []
        self.sent: list[int] = []  # characters of arguments sent, per call

    def deltas(self, calls: list[PartialCall]) -> list[dict]:
        out = []
        for k, call in enumerate(calls):
            if call.name is None:
                break
            delta: dict = {"index": k, "function": {}}
            if k == len(self.ids):
                self.ids.append(_call_id(self.parser))
                self.sent.append(0)
                delta.update(id=self.ids[k], type="function")
                delta["function"]["name"] = call.name
            new = (call.arguments or "")[self.sent[k]:]
            if new:
                delta["function"]["arguments"] = new
                self.sent[k] += len(new)
            if delta["function"] or "id" in delta:
                if "id" in delta:
                    delta["function"].setdefault("arguments", "")
                out.append(delta)
        return out


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, calls, reasoning) of a whole answer. If any call is not whole valid JSON, the calls'
    text stays content (a model that broke its format said something, not a call)."""
    parsed = tool_stream(parser).feed(text, finished=True)
    calls = []
    for call in parsed.calls:
        try:
            arguments = json.dumps(json.loads(call.arguments or ""), ensure_ascii=False)
        except json.JSONDecodeError:
            return text, [], parsed.reasoning or None
        if call.name is None:
            return text, [], parsed.reasoning or None
        calls.append(ToolCall(call.name, arguments, _call_id(parser)))
    content = parsed.content.strip() if calls else parsed.content
    return content or None, calls, parsed.reasoning or None
