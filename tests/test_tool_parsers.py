"""The tool-call parsers by family (no model): each reads back its family's template rendering of a
call, whole and streamed in any split; streamed, the name comes first and the argument fragments
concatenate to the same JSON; a broken call stays content when parsed whole."""
from __future__ import annotations

import json

import pytest

from minivllm.server.json_scan import scan_calls
from minivllm.server.response_store import ResponseStore
from minivllm.server.tool_parsers import CallDeltas, parse_tool_calls, tool_stream
from minivllm.server.tools import ToolCallOutput

PARIS = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "CET", "hours": [1, 2]}  # a list: phi4's regex in vLLM cuts at its "]"

# (parser, text as the family's chat template renders an assistant's tool calls (and as the model
#  writes them), content, calls)
RENDERED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", '
               '"hours": [1, 2]}}\n</tool_call>', "Let me check.", [("get_weather", PARIS), ("get_time", TIME)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "hours": [1, 2]}}', None,
     [("get_time", TIME)]),  # cut before its end tag: still a call
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET", "hours": [1, 2]}}', None,
     [("get_weather", PARIS), ("get_time", TIME)]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, '
                '"id": "a1b2c3d4e"}]', None, [("get_weather", PARIS)]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time'
                '{"zone": "CET", "hours": [1, 2]}', "Sure.", [("get_weather", PARIS), ("get_time", TIME)]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None,
     [("get_weather", PARIS)]),
    ("granite", '<tool_call>[{"name": "get_time", "arguments": {"zone": "CET", "hours": [1, 2]}}]', None,
     [("get_time", TIME)]),
    ("phi4_mini_json", 'functools[{"name": "get_time", "arguments": {"zone": "CET", "hours": [1, 2]}}, '
                       '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None,
     [("get_time", TIME), ("get_weather", PARIS)]),
    ("openai", '<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary '
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>',
     None, [("get_weather", PARIS)]),
    ("openai", '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.',
     "It is 4.", []),
]
PLAIN = [(parser, "It is sunny {maybe}.") for parser in ("hermes", "mistral", "granite", "phi4_mini_json")] + [
    ("llama3_json", "It is sunny; {not a call}.")]


def accumulate(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) per call of a stream of tool_calls deltas, as a client adds them up."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], ["", ""])
        call[0] += d["function"].get("name", "")
        call[1] += d["function"].get("arguments", "")
    return [tuple(calls[k]) for k in sorted(calls)]


def streamed(mode: str, parser: str, text: str, size: int, name: str | None = None) -> tuple[str, list, str, list]:
    out, content, deltas, reasoning = ToolCallOutput(mode, parser, name), "", [], ""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        c, d, r = out.stream(0, piece, k == len(pieces) - 1)
        content, reasoning = content + c, reasoning + r
        deltas += d
    return content, deltas, reasoning, accumulate(deltas)


@pytest.mark.parametrize("parser,text,content,calls", RENDERED)
def test_each_family_reads_back_its_rendering_whole_and_streamed(parser: str, text: str, content: str | None,
                                                                  calls: list) -> None:
    got_content, got_calls, _ = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for size in (1, 3, 7, len(text)):  # any split of the stream gives the same content and calls
        s_content, deltas, _, s_calls = streamed("auto", parser, text, size)
        assert (s_content.strip() or None) == content
        assert [(n, json.loads(a)) for n, a in s_calls] == calls
        for k in range(len(calls)):  # the name comes first, with the id, then only fragments
            first = next(d for d in deltas if d["index"] == k)
            assert first["function"]["name"] == calls[k][0] and first["id"] and first["type"] == "function"
            assert all("name" not in d["function"] for d in deltas if d["index"] == k and d is not first)


@pytest.mark.parametrize("parser,text", PLAIN)
def test_text_without_a_call_is_all_content(parser: str, text: str) -> None:
    assert parse_tool_calls(parser, text)[:2] == (text, [])
    for size in (1, 4):
        content, deltas, _, _ = streamed("auto", parser, text, size)
        assert content == text and deltas == []


def test_harmony_channels_go_to_reasoning_and_content() -> None:
    text = RENDERED[-1][1]
    assert parse_tool_calls("openai", text)[2] == "Easy."
    content, _, reasoning, _ = streamed("auto", "openai", text, 2)
    assert (content, reasoning) == ("It is 4.", "Easy.")


def test_a_broken_call_stays_content_whole_and_streams_as_written() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>'
    assert parse_tool_calls("hermes", text)[:2] == (text, [])
    _, _, _, calls = streamed("auto", "hermes", text, 3)  # fragments already sent cannot be taken back
    assert calls[0][0] == "get_time"
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[0][1])


def test_constrained_outputs_stream_name_first_then_fragments() -> None:
    required = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    _, _, _, calls = streamed("required", "hermes", required, 2)
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", PARIS)]
    _, deltas, _, calls = streamed("named", "hermes", json.dumps(PARIS), 4, name="get_weather")
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", PARIS)] and len(deltas) > 2


def test_scanner_keeps_the_call_objects_brace_out_of_the_arguments() -> None:
    text = '{"name": "f", "arguments": {"a": "}{", "b": [1, {"c": 2}]}}'
    for end in range(1, len(text) + 1):
        calls = scan_calls(text[:end])
        if calls and calls[0].arguments is not None:
            assert '{"a": "}{", "b": [1, {"c": 2}]}'.startswith(calls[0].arguments)
    assert json.loads(scan_calls(text)[0].arguments) == {"a": "}{", "b": [1, {"c": 2}]}


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    deltas = CallDeltas("mistral").deltas(tool_stream("mistral").feed('[TOOL_CALLS]f{"a": 1}', True).calls)
    assert len(deltas[0]["id"]) == 9 and deltas[0]["id"].isalnum()


def test_response_store_evicts_least_recently_used_by_count_and_bytes() -> None:
    store = ResponseStore(max_entries=2, max_bytes=400)
    for k in range(3):
        assert store.put({"id": f"r{k}", "output": []}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and store.get("r1") is not None  # r1 is now the most recently used
    store.put({"id": "r3", "output": []}, [])
    assert store.get("r2") is None and len(store) == 2
    assert not store.put({"id": "big", "output": ["y" * 500]}, [])  # alone over the byte bound: not kept
    store.put({"id": "r4", "output": ["z" * 360]}, [])  # the bytes evict the rest
    assert len(store) == 1 and store.bytes <= 400
    assert store.delete("r4") and store.bytes == 0 and not store.delete("r4")


@pytest.mark.parametrize("source", ["chatml_tools", "qwen2.5-coder-0.5b-instruct-q4_k_m"])
def test_hermes_reads_back_what_a_real_template_renders(source: str) -> None:
    """A template's own rendering of an assistant's calls (the shipped chatml_tools, Qwen2.5's in its GGUF),
    cut out of the conversation, parses back into the same calls."""
    from minivllm.bench.workloads import load_tokenizer
    from minivllm.model.fetch import fetch
    from minivllm.server.tools import load_chat_template

    shipped = source == "chatml_tools"
    tokenizer = load_tokenizer(None if shipped else str(fetch(source)))[0]
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}},
             {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": TIME}}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather and time?"}, {"role": "assistant", "content": "", "tool_calls": calls}],
        False, load_chat_template(source) if shipped else None)
    answer = text.rsplit("<|im_start|>assistant\n", 1)[1].split("<|im_end|>")[0]
    content, parsed, _ = parse_tool_calls("hermes", answer)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == [("get_weather", PARIS),
                                                                                        ("get_time", TIME)]
