"""The APIs agents speak, through the official clients against a real `minivllm serve` (one server for
the module): Anthropic's Messages (`anthropic`: messages.create, messages.stream, count_tokens) and
OpenAI's Responses (`openai`: responses.create, responses.stream, and the Agents SDK's Runner with a
function tool); and bad input, answered in each API's own error shape while the server goes on."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_server import (ABORTED, API_KEY, MAX_MODEL_LEN, ServerProcess, gated_server,  # noqa: F401 (fixtures)
                               model_name, server_fixture, wait_idle)

server = server_fixture("--chat-template", "chatml_tools", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": WEATHER_SCHEMA, "strict": True}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HUGE = 40 * 2**20


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


# -- Messages ----------------------------------------------------------------------------------------------------
def test_messages_create_and_count_tokens(claude: anthropic.Anthropic, model_name: str) -> None:
    system = [{"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}]
    m = claude.messages.create(model=model_name, max_tokens=8, system=system, messages=ASK)
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 8
    counted = claude.messages.count_tokens(model=model_name, system=system, messages=ASK).input_tokens
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    beta = httpx.post(f"{claude.base_url}/v1/messages/count_tokens?beta=true",
                      json={"model": model_name, "system": system, "messages": ASK}, timeout=60)
    assert beta.json() == {"input_tokens": counted}
    stopped = claude.messages.create(model=model_name, max_tokens=30, messages=ASK,
                                     stop_sequences=[" "])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " ")


def test_messages_stream_with_a_tool_and_a_tool_result_round_trip(claude: anthropic.Anthropic, model_name: str) -> None:
    with claude.messages.stream(model=model_name, max_tokens=40, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == final.content[0].input
    call = final.content[0]
    assert (call.type, call.name, final.stop_reason) == ("tool_use", "get_weather", "tool_use")
    jsonschema.validate(call.input, WEATHER_SCHEMA)  # valid by construction: the grammar
    answer = claude.messages.create(model=model_name, max_tokens=8, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                                                {"type": "tool_use", "id": call.id, "name": call.name,
                                                 "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}])
    assert answer.content and answer.usage.cache_read_input_tokens > 0  # the conversation's prefix was cached


def test_messages_stream_blocks_are_contiguous_with_a_ping(claude: anthropic.Anthropic, server: ServerProcess,
                                                           model_name: str) -> None:
    with claude.messages.stream(model=model_name, max_tokens=12, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text and final.usage.output_tokens == 12
    body = {"model": model_name, "max_tokens": 4, "messages": ASK, "stream": True,
            "context_management": {"edits": []}, "output_config": {}, "metadata": {"user_id": "u"}, "caf\u00e9": 1}
    with httpx.stream("POST", f"{server.url}/v1/messages?beta=true", json=body, timeout=60) as r:
        raw = r.read().decode()
        ignored = r.headers["x-ignored-fields"]
    assert {"context_management", "output_config", "metadata", "caf\\xe9"} <= set(ignored.split(", "))
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and "[DONE]" not in raw


def test_prompt_too_long_is_the_text_claude_code_compacts_on(claude: anthropic.Anthropic, model_name: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model_name, max_tokens=8, messages=[{"role": "user", "content": "hi " * 2000}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert f"tokens > {MAX_MODEL_LEN - 1} maximum" in e.value.body["error"]["message"]
    assert e.value.body["error"]["message"].startswith("prompt is too long: ")


@pytest.mark.parametrize("messages,says", [
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}],
     "corresponding `tool_use`"),
    ([{"role": "user", "content": [{"type": "hologram", "text": "x"}]}], "hologram"),
    ([{"role": "robot", "content": "x"}], "role"),
])
def test_messages_bad_input_is_anthropic_shaped(server: ServerProcess, model_name: str, messages: list,
                                                says: str) -> None:
    r = httpx.post(f"{server.url}/v1/messages", json={"model": model_name, "max_tokens": 4, "messages": messages},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert says in r.json()["error"]["message"]


def test_huge_bodies_and_unknown_models_in_each_apis_shape(server: ServerProcess, claude: anthropic.Anthropic,
                                                           model_name: str) -> None:
    huge = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * HUGE + b'"}]}'
    r = httpx.post(f"{server.url}/v1/messages", content=huge, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(f"{server.url}/v1/responses", content=huge, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert claude.messages.create(model=model_name, max_tokens=2, messages=ASK).content  # still serving


LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 600}}, "required": ["story"]}


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"max_tokens": 800, "messages": ASK, "tool_choice": {"type": "tool", "name": "tell"},
                      "tools": [{"name": "tell", "input_schema": LONG}]}),
    ("/v1/responses", {"max_output_tokens": 800, "input": "Tell a story.", "tool_choice": {"type": "function", "name": "tell"},
                       "tools": [{"type": "function", "name": "tell", "parameters": LONG}]}),
])
def test_a_dropped_stream_is_aborted_and_frees_its_blocks(server: ServerProcess, model_name: str, path: str,
                                                          body: dict) -> None:
    """The tool's schema makes the answer long; the client hangs up after a few events."""
    before = wait_idle(server.url)
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + path,
                                                       json={"model": model_name, "stream": True, **body}) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line.startswith("data: ") and 'delta"' in line  # content_block_delta, *.arguments.delta
            if deltas == 3:
                break
    after = wait_idle(server.url)
    assert after.get(ABORTED, 0) == before.get(ABORTED, 0) + 1
    assert after["minivllm:kv_cache_usage_perc"] == 0
    assert after["minivllm:generation_tokens_total"] - before["minivllm:generation_tokens_total"] < 600


def test_anthropic_keys_and_a_full_queue_in_anthropics_shape(gated_server: ServerProcess) -> None:
    """--api-key as Anthropic's clients send it (x-api-key); a full waiting queue is overloaded_error."""
    url = gated_server.url
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(model="m", messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    claude = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)
    name = httpx.get(f"{url}/v1/models", headers={"x-api-key": API_KEY}).json()["data"][0]["id"]
    assert claude.messages.count_tokens(model=name, messages=ASK).input_tokens > 0
    body = {"prompt": "Count to a thousand:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers={"x-api-key": API_KEY}) as http:  # max_num_seqs 1, max_waiting 1
        with http.stream("POST", f"{url}/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection, which aborts
            next(line for line in lines if line.startswith("data: "))
            with http.stream("POST", f"{url}/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200
                with pytest.raises(anthropic.APIStatusError) as e:
                    claude.messages.create(model=name, max_tokens=1, messages=ASK)
    assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"


# -- Responses ---------------------------------------------------------------------------------------------------
def test_responses_create_store_previous_id_get_delete(oai: openai.OpenAI, model_name: str) -> None:
    first = oai.responses.create(model=model_name, instructions="Answer briefly.", input="Name a color.",
                                 max_output_tokens=6, temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    second = oai.responses.create(model=model_name, input="And another?", previous_response_id=first.id,
                                  max_output_tokens=4, prompt_cache_key="k", include=[], store=False)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 2  # rebuilt
    assert second.usage.input_tokens_details.cached_tokens > 0  # ... over the cached prefix
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(second.id)  # store false: not kept
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model_name, input="x", previous_response_id=first.id)
    assert e.value.body["code"] == "response_not_found"


class Answer(BaseModel):
    city: str = Field(max_length=12)  # bounded: an open string lets a small model ramble to max_output_tokens


def test_responses_stream_structured_then_incomplete(oai: openai.OpenAI, model_name: str) -> None:
    with oai.responses.stream(model=model_name, input="Which city is the capital of France?",
                              text_format=Answer, max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert all(e.content_index == 0 for e in events if hasattr(e, "content_index"))
    assert isinstance(final.output_parsed, Answer)
    with oai.responses.stream(model=model_name, input="Tell a story.", max_output_tokens=3) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


def test_responses_function_call_streamed_then_its_output(oai: openai.OpenAI, model_name: str,
                                                          server: ServerProcess) -> None:
    tools = [{"type": "web_search"}, FUNCTION]  # the web search is refused alone, not the request
    with oai.responses.stream(model=model_name, input="Weather in Paris?", tools=tools, max_output_tokens=40,
                              tool_choice={"type": "function", "name": "get_weather"}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    after = oai.responses.create(model=model_name, previous_response_id=final.id, max_output_tokens=4, tools=tools,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert after.output
    r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": model_name, "input": "hi", "max_output_tokens": 2, "tools": tools, "tool_choice": "none"})
    assert r.status_code == 200 and "tools.0 (web_search)" in r.headers["x-ignored-fields"]


@pytest.mark.parametrize("body,says", [
    ({"input": [{"type": "message", "content": "no role"}]}, "role"),
    ({"input": [{"type": "hologram"}]}, "unknown item type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "call_9"),
    ({"input": "x", "tool_choice": {"type": "mcp"}, "tools": [FUNCTION]}, "tool_choice"),
])
def test_responses_bad_input_is_openai_shaped(server: ServerProcess, model_name: str, body: dict, says: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": model_name, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and says in r.json()["error"]["message"]


def test_agents_sdk_runner_calls_a_function_tool(server: ServerProcess, model_name: str) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"18 C in {city}"

    model = agents.OpenAIResponsesModel(model_name, openai.AsyncOpenAI(base_url=f"{server.url}/v1",
                                                                       api_key="unused", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=40),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(asked) == 1 and result.final_output == f"18 C in {asked[0]}"


def test_a_client_that_hangs_up_during_a_long_prefill_closes_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pings wait on the next chunk in a task of their own; closing the stream there must still close the
    engine's stream (which aborts the request), not fail with 'generator already running'."""
    import asyncio

    from minivllm.server import messages

    monkeypatch.setattr(messages, "PING_INTERVAL_S", 0.01)
    closed: list[bool] = []

    async def prefilling():
        try:
            await asyncio.sleep(60)
            yield "never"
        finally:
            closed.append(True)

    async def hang_up() -> list:
        stream, got = messages._with_pings(prefilling()), []
        got.append(await anext(stream))
        got.append(await anext(stream))
        await stream.aclose()
        return got

    assert asyncio.run(hang_up()) == [None, None] and closed == [True]


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_bench_replays_agent_turns_over_the_api(server: ServerProcess, model_name: str, api: str) -> None:
    """bench serve --dataset agent --api ...: each later turn re-sends the conversation with the tool's
    result, so it grows, and its prefix is read from the cache."""
    import asyncio

    import numpy as np

    from minivllm.bench.agent_turns import agent_sessions, per_turn, replay
    from minivllm.bench.serve import ServeTarget
    from minivllm.bench.workloads import TextCorpus, load_tokenizer

    rng = np.random.default_rng(0)
    sessions = agent_sessions(TextCorpus(load_tokenizer(None)[0]), 2, 2, (100, 120), 24, (3, 4), rng, num_tools=1)
    records, _ = asyncio.run(replay(ServeTarget(server.url, model_name), sessions, api, max_concurrency=2))
    assert [r.error for r in records] == [None] * 4
    rows = per_turn(records)
    assert [r["turn"] for r in rows] == [1, 2] and all(r["requests"] == 2 for r in rows)
    assert rows[0]["mean_input_tokens"] < rows[1]["mean_input_tokens"]
    assert rows[1]["cached_share"] > 0.5 and all(r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0 for r in rows)


def _sse(events: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for e in events:
        lines = dict(line.split(": ", 1) for line in e.decode().strip().splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_a_thought_then_text_then_a_call_make_contiguous_anthropic_blocks() -> None:
    """What a reasoning parser and a tool parser give, framed: a thinking block closed by its signature,
    then text, then a tool_use whose input arrives as fragments; indices 0, 1, 2."""
    from minivllm.server.messages import _Blocks

    blocks = _Blocks()
    deltas = [{"reasoning": "Think"}, {"reasoning": "ing."}, {"content": "Calling."},
              {"tool_calls": [{"index": 0, "id": "t1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]
    events = _sse([e for d in deltas for e in blocks.feed(d)] + blocks.close())
    starts = [(data["index"], data["content_block"]["type"]) for kind, data in events if kind == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    kinds = [data["delta"]["type"] for kind, data in events if kind == "content_block_delta"]
    assert kinds == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta", "input_json_delta",
                     "input_json_delta"]
    assert [data["index"] for kind, data in events if kind == "content_block_stop"] == [0, 1, 2]


def test_responses_items_each_count_content_from_zero() -> None:
    from minivllm.server.responses import _Output

    out = _Output()
    events = [e for d in [{"reasoning": "Hm."}, {"content": "Hi"}, {"content": "!"},
                          {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}]}]
              for e in out.feed(d)] + out.close()
    assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call"]
    assert {e["content_index"] for e in events if "content_index" in e} == {0}
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [i["id"] for i in out.items]  # the same ids in added, done and the response
    assert out.items[1]["content"][0]["text"] == "Hi!" and out.items[2]["arguments"] == "{}"
