"""The API that real clients send, against a real `minivllm serve` (tool-aware template, hermes
parser): structured outputs through the official `openai` client, validated with `jsonschema`;
tool calls; unknown fields; and the exact payloads of vLLM's own benchmark client."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.test_server import ServerProcess, client, model_name, server_fixture  # noqa: F401 (fixtures)

# The same fixtures as test_server.py's, over a server with the tool-aware template and parser.
server = server_fixture("--chat-template", "chatml_tools", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")

NAME = {"type": "string", "maxLength": 20}
# The age bounded: even greedy, an unbounded integer may run past max_tokens (the grammar bounds its digits)
PERSON = {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"price": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}},
     "required": ["price", "currency"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                                  "y": {"type": "integer"}},
                                                "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "number"}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "name": NAME},
                                               "required": ["id", "name"]},
                                      "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
     "required": ["scores"]},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"level": {"enum": ["low", "medium", "high"]}, "note": NAME},
     "required": ["level"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat", "lon"]},
    {"type": "object", "properties": {"first": NAME, "last": NAME, "email": NAME}, "required": ["first", "last"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer"}, "maxItems": 2}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}, "count": {"type": "integer"},
                                      "meta": {"type": "object", "properties": {"source": NAME}, "required": ["source"]}},
     "required": ["status", "count", "meta"]},
    {"type": "object", "properties": {"weekday": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                                      "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
     "required": ["weekday", "hour"]},
    {"type": "object", "properties": {"vector": {"type": "array", "items": {"type": "number"}, "minItems": 2,
                                                 "maxItems": 2}, "label": NAME}, "required": ["vector", "label"]},
]


def test_twenty_schemas_streamed_and_not_beside_unconstrained_requests(server: ServerProcess, model_name: str) -> None:
    async def constrained(client: openai.AsyncOpenAI, i: int, schema: dict) -> tuple[str, str]:
        kwargs = dict(model=model_name, max_tokens=120, temperature=0.7, seed=1000 + i,
                      messages=[{"role": "user", "content": f"Answer in JSON: example number {i}."}],
                      response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        if i % 2:
            choice = (await client.chat.completions.create(**kwargs)).choices[0]
            return choice.message.content, choice.finish_reason
        stream = await client.chat.completions.create(**kwargs, stream=True)
        chunks = [c.choices[0] async for c in stream if c.choices]
        return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason

    async def unconstrained(client: openai.AsyncOpenAI, i: int) -> int:
        out = await client.completions.create(model=model_name, prompt=f"Story {i}:", max_tokens=30,
                                              extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(asyncio.gather(*(constrained(client, i, s) for i, s in enumerate(SCHEMAS))),
                                        asyncio.gather(*(unconstrained(client, i) for i in range(4))))

    answers, plain = asyncio.run(main())
    # Sampled at 0.7, a 135M model may write an unbounded integer's digits until max_tokens (the grammar
    # allows it): such an answer is cut, not wrong. Every finished one must hold its schema.
    finished = [(schema, text) for schema, (text, reason) in zip(SCHEMAS, answers) if reason == "stop"]
    assert len(finished) >= len(SCHEMAS) - 2, [reason for _, reason in answers]
    for schema, text in finished:
        jsonschema.validate(json.loads(text), schema)
    assert plain == [30] * 4


def test_structured_outputs_fields_on_both_endpoints(client: openai.OpenAI, model_name: str) -> None:
    chat = dict(model=model_name, messages=[{"role": "user", "content": "Pick one."}], max_tokens=20)
    assert client.chat.completions.create(**chat, extra_body={"guided_choice": ["cat", "dog"]}
                                          ).choices[0].message.content in ("cat", "dog")
    # Greedy: sampled, a document may run past max_tokens (and an unseeded draw depends on the server's history)
    obj = client.chat.completions.create(**{**chat, "max_tokens": 60, "temperature": 0},
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    cmpl = dict(model=model_name, prompt="The year is", max_tokens=10)
    year = client.completions.create(**cmpl, extra_body={"structured_outputs": {"regex": "[12][0-9]{3}"}})
    assert len(year.choices[0].text) == 4 and year.choices[0].text.isdigit()
    yes_no = client.completions.create(**cmpl, extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert yes_no.choices[0].text in ("yes", "no")
    person = client.completions.create(**{**cmpl, "max_tokens": 60, "temperature": 0},
                                       extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(person.choices[0].text), PERSON)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": NAME}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_streamed_and_not(client: openai.OpenAI, model_name: str, tool_choice) -> None:
    kwargs = dict(model=model_name, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=80,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and calls and whole.message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]

    # Streamed: the client accumulates tool_call deltas by index, as with OpenAI.
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            acc = streamed.setdefault(d.index, {"name": "", "arguments": ""})
            acc["name"] += d.function.name or ""
            acc["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_tool_results_round_trip_and_auto(client: openai.OpenAI, model_name: str) -> None:
    """A conversation with an assistant tool call (no content) and the tool's answer renders and runs;
    with tool_choice auto the answer is content, tool calls, or both, each well formed."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21})}]
    out = client.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER], max_tokens=30,
                                         temperature=0).choices[0]
    assert out.message.content or out.message.tool_calls
    for call in out.message.tool_calls or []:
        json.loads(call.function.arguments)
    none = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=10).choices[0]
    assert not none.message.tool_calls and none.finish_reason != "tool_calls"


def test_unknown_fields_are_ignored_and_reported(server: ServerProcess, model_name: str) -> None:
    body = {"model": model_name, "messages": [{"role": "user", "content": "Hi", "weird": 1}], "max_tokens": 2,
            "foo": "bar", "stream_options": None, "logit_bias": {"11": 1.5}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "foo, messages.0.weird"
    assert "foo" in server.log.read_text()  # logged (once)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True, "foo": 1},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "foo"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and "x-ignored-fields" not in r.headers


BAD = [
    ({"prompt": "Hi", "presence_penalty": 5}, "presence_penalty"),
    ({"prompt": "Hi", "repetition_penalty": "high"}, "repetition_penalty"),
    ({"prompt": "Hi", "logit_bias": {"comma": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"11": 1000}}, "logit_bias"),
    ({"prompt": "Hi", "best_of": 2}, "best_of"),
    ({"prompt": "Hi", "suffix": "end"}, "suffix"),
    ({"prompt": "Hi", "guided_regex": "(ab"}, "guided_regex"),
    ({"prompt": "Hi", "guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"prompt": "Hi", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"prompt": "Hi", "guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"prompt": "Hi", "allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"prompt": "Hi", "prompt_logprobs": 50}, "prompt_logprobs"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_malformed_known_fields_are_400_naming_the_field(server: ServerProcess, body: dict, field: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_tool_choice_errors(server: ServerProcess) -> None:
    chat = {"messages": ASK, "tools": [WEATHER]}
    for extra, field in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                         ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
                         ({"response_format": {"type": "json_schema"}}, "response_format")):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_echo(client: openai.OpenAI, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt="Hello there", max_tokens=3, echo=True, temperature=0)
    plain = client.completions.create(model=model_name, prompt="Hello there", max_tokens=3, temperature=0)
    assert out.choices[0].text == "Hello there" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt="Hello there", max_tokens=3, echo=True, temperature=0, stream=True) if c.choices)
    assert streamed == out.choices[0].text


def test_prompt_logprobs(client: openai.OpenAI, model_name: str) -> None:
    """vLLM's extension: each prompt token's logprob and the top ones, None for the first token."""
    out = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=2,
                                    temperature=0, extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == out.usage.prompt_tokens
    assert all(2 <= len(e) <= 3 and all(v["logprob"] <= 0 and "decoded_token" in v for v in e.values())
               for e in entries[1:])


# The request bodies of vLLM's benchmark client (vllm/benchmarks/lib/endpoint_request_func.py:
# async_request_openai_completions and async_request_openai_chat_completions), as `vllm bench serve`
# sends them with --ignore-eos and its default extra_body {"temperature": 0.0}; "MODEL" is replaced.
VLLM_BENCH_PAYLOADS = json.loads("""[
  ["/v1/completions", {"model": "MODEL", "prompt": "The quick brown fox jumps over the lazy dog.",
    "repetition_penalty": 1.0, "max_tokens": 6, "logprobs": null, "stream": true,
    "stream_options": {"include_usage": true}, "ignore_eos": true, "temperature": 0.0}],
  ["/v1/completions", {"model": "MODEL", "prompt": "Tell me about the history of Paris.",
    "repetition_penalty": 1.0, "max_tokens": 5, "logprobs": null, "stream": true,
    "stream_options": {"include_usage": true}}],
  ["/v1/chat/completions", {"model": "MODEL",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Say something nice."}]}],
    "max_completion_tokens": 6, "stream": true, "stream_options": {"include_usage": true},
    "ignore_eos": true, "temperature": 0.0}]
]""")


@pytest.mark.parametrize("path,payload", VLLM_BENCH_PAYLOADS, ids=["completions", "completions-eos", "chat"])
def test_vllm_bench_client_payloads(server: ServerProcess, model_name: str, path: str, payload: dict) -> None:
    """Every request succeeds, and the stream has what the client reads: choices with text (or
    delta.content) per token chunk, a final usage chunk, then [DONE]."""
    payload = {**payload, "model": model_name}
    events = []
    with httpx.stream("POST", server.url + path, json=payload, timeout=60,
                      headers={"x-request-id": "bench-1"}) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    token_chunks = [c for c in chunks if c["choices"]]
    assert token_chunks and chunks[-1]["usage"]["completion_tokens"] >= 1
    text_key = (lambda c: c["choices"][0]["text"]) if "prompt" in payload else \
        (lambda c: c["choices"][0]["delta"].get("content"))
    assert all(isinstance(text_key(c), str) for c in token_chunks[1:])
    if payload.get("ignore_eos"):
        assert chunks[-1]["usage"]["completion_tokens"] == payload.get("max_tokens", payload.get("max_completion_tokens"))
