"""A scanner of tool-call JSON as it streams in: where each top-level {"name", "arguments"} object starts,
its name once the name's string is whole, and the raw text of its arguments so far.

The raw text is a prefix of what the model wrote, so the fragments a stream sends (each the text added
since the last) concatenate to the model's own arguments: valid JSON once the object closes. The scan
stops at the value's closing brace, so the call object's own `}` never leaks into the arguments.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


@dataclass
class PartialCall:
    name: str | None  # None until the name's string is whole
    arguments: str | None  # the raw JSON so far (None: not begun, or a string to decode once whole)
    complete: bool  # the call's object has closed


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value starting at text[i]; None if it has not ended yet."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if text[i] in "{[":
        depth, in_string, j = 0, False, i
        while j < len(text):
            ch = text[j]
            if in_string:
                if ch == "\\":
                    j += 2
                    continue
                in_string = ch != '"'
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: ends where a delimiter begins
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) else None


def _skip(text: str, i: int, chars: str = _WS) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def scan_call(text: str, i: int, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[PartialCall, int | None]:
    """The call object starting at text[i] == '{' (as far as it has come), and the index past its end
    (None while open)."""
    name = arguments = None
    j = i + 1
    while True:
        j = _skip(text, j, _WS + ",")
        if j >= len(text):
            return PartialCall(name, arguments, False), None
        if text[j] == "}":
            return PartialCall(name, arguments if arguments is not None else "{}", True), j + 1
        key_end = value_end(text, j)
        if key_end is None or text[j] != '"':
            return PartialCall(name, arguments, False), None
        key = json.loads(text[j:key_end])
        j = _skip(text, key_end)
        if j >= len(text) or text[j] != ":":
            return PartialCall(name, arguments, False), None
        j = _skip(text, j + 1)
        end = value_end(text, j)
        if key == "name" and end is not None:
            value = json.loads(text[j:end])
            name = value if isinstance(value, str) else None
        elif key in arg_keys and j < len(text):
            if text[j] == '"':  # arguments as a JSON string: sent decoded, once whole
                arguments = json.loads(text[j:end]) if end is not None else None
            else:
                arguments = text[j:end] if end is not None else text[j:]
        if end is None:
            return PartialCall(name, arguments, False), None
        j = end


def scan_calls(text: str, skip: str = _WS + ",;[]") -> list[PartialCall]:
    """Every call object in `text`, objects separated by anything in `skip` (a list's brackets and
    commas, llama's `; `); scanning stops at anything else."""
    calls, i = [], 0
    while True:
        i = _skip(text, i, skip)
        if i >= len(text) or text[i] != "{":
            return calls
        call, end = scan_call(text, i)
        calls.append(call)
        if end is None:
            return calls
        i = end
