"""`bench serve --dataset agent --api messages|responses`: agent conversations replayed over the wire,
turn by turn, as Claude Code (Messages) or Codex CLI (Responses, stateless: the whole input each turn)
send them: a long system prompt with tool schemas, a task, then after each answer the assistant's turn
(its text and a tool call: the model's own, or one made up when it wrote none) and the tool's result,
so the context grows by --turn-len tokens of tool output a turn. Conversations run side by side (at
most --max-concurrency at once); the turns of one conversation run in order, each after the last.

Per turn it records TTFT (send -> first delta), TPOT (the rest over the output tokens after the first),
and the share of the turn's input tokens the server read from its prefix cache (the APIs' usage:
Messages' cache_read_input_tokens, Responses' input_tokens_details.cached_tokens).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from minivllm.bench.serve import ServeTarget
from minivllm.bench.workloads import TextCorpus
from minivllm.server.messages_protocol import arguments_object

APIS = ("messages", "responses")


@dataclass
class AgentSession:
    system: str
    tools: list[dict]  # {"name", "description", "schema"}
    task: str
    tool_results: list[str]  # one per later turn
    output_lens: list[int]  # max tokens per turn


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    tpot: float = 0.0
    error: str | None = None


@dataclass
class _Answer:
    """What a turn's stream brought: text, tool calls, usage, and when."""

    text: str = ""
    calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments" (JSON text)}
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    first: float | None = None


def agent_sessions(corpus: TextCorpus, num_conversations: int, turns: int, system_range: tuple[int, int],
                   turn_len: int, output_range: tuple[int, int], rng: np.random.Generator,
                   num_tools: int = 8) -> list[AgentSession]:
    sessions = []
    for _ in range(num_conversations):
        system = corpus.window(int(rng.integers(system_range[0], system_range[1] + 1)), rng)[0]
        tools = [{"name": f"tool_{k}", "description": corpus.window(40, rng)[0],
                  "schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
                 for k in range(num_tools)]
        sessions.append(AgentSession(
            system, tools, corpus.window(64, rng)[0], [corpus.window(turn_len, rng)[0] for _ in range(turns - 1)],
            [int(rng.integers(output_range[0], output_range[1] + 1)) for _ in range(turns)]))
    return sessions


class _Conversation:
    """One session's growing history in one API's shape."""

    def __init__(self, session: AgentSession, api: str) -> None:
        self.session, self.api = session, api
        if api == "messages":
            self.history: list[dict] = [{"role": "user", "content": session.task}]
        else:
            self.history = [{"type": "message", "role": "developer", "content": session.system},
                            {"type": "message", "role": "user", "content": session.task}]

    def body(self, model: str, max_tokens: int) -> dict:
        s = self.session
        if self.api == "messages":
            return {"model": model, "max_tokens": max_tokens, "stream": True, "system": s.system,
                    "messages": self.history, "tool_choice": {"type": "auto"},
                    "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]}
                              for t in s.tools]}
        return {"model": model, "max_output_tokens": max_tokens, "stream": True, "store": False,
                "input": self.history, "tool_choice": "auto",
                "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                           "parameters": t["schema"]} for t in s.tools]}

    def add(self, answer: _Answer, turn: int, tool_result: str) -> None:
        """The assistant's turn, then the result of each of its calls."""
        calls = answer.calls or [{"id": f"call_{turn}", "name": self.session.tools[turn % len(self.session.tools)]
                                  ["name"], "arguments": json.dumps({"query": "next"})}]
        if self.api == "messages":
            content = ([{"type": "text", "text": answer.text}] if answer.text else []) + [
                {"type": "tool_use", "id": c["id"], "name": c["name"], "input": arguments_object(c["arguments"])}
                for c in calls]
            self.history += [{"role": "assistant", "content": content}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c["id"], "content": tool_result} for c in calls]}]
            return
        if answer.text:
            self.history.append({"type": "message", "role": "assistant", "content": answer.text})
        for c in calls:
            self.history += [{"type": "function_call", "call_id": c["id"], "name": c["name"],
                              "arguments": c["arguments"]},
                             {"type": "function_call_output", "call_id": c["id"], "output": tool_result}]


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON data of each server-sent event (their `type` names them in both APIs)."""
    async for line in resp.content:
        if line.startswith(b"data:"):
            yield json.loads(line[5:])


def _read(event: dict, answer: _Answer) -> None:
    kind = event.get("type", "")
    if kind in ("content_block_delta", "response.output_text.delta", "response.function_call_arguments.delta",
                "response.reasoning_text.delta") and answer.first is None:
        answer.first = time.perf_counter()
    if kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
        block = event["content_block"]
        answer.calls.append({"id": block["id"], "name": block["name"], "arguments": ""})
    elif kind == "content_block_delta":
        delta = event["delta"]
        if delta["type"] == "text_delta":
            answer.text += delta["text"]
        elif delta["type"] == "input_json_delta" and answer.calls:
            answer.calls[-1]["arguments"] += delta["partial_json"]
    elif kind == "message_delta":
        usage = event["usage"]
        answer.cached_tokens = usage.get("cache_read_input_tokens", 0)
        answer.input_tokens = usage.get("input_tokens", 0) + answer.cached_tokens
        answer.output_tokens = usage.get("output_tokens", 0)
    elif kind == "response.output_item.done":
        item = event["item"]
        if item["type"] == "message":
            answer.text += "".join(p.get("text", "") for p in item["content"])
        elif item["type"] == "function_call":
            answer.calls.append({"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]})
    elif kind in ("response.completed", "response.incomplete"):
        usage = event["response"]["usage"]
        answer.input_tokens, answer.output_tokens = usage["input_tokens"], usage["output_tokens"]
        answer.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
    elif kind == "error":
        raise ValueError(json.dumps(event)[:200])


async def _turn(http: aiohttp.ClientSession, target: ServeTarget, conv: _Conversation, record: TurnRecord,
                max_tokens: int) -> _Answer | None:
    path = "/v1/messages" if conv.api == "messages" else "/v1/responses"
    answer, start = _Answer(), time.perf_counter()
    try:
        async with http.post(target.base_url + path, json=conv.body(target.model, max_tokens),
                             headers=target.headers) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
                return None
            async for event in _events(resp):
                _read(event, answer)
    except (aiohttp.ClientError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return None
    end = time.perf_counter()
    if answer.first is None:
        record.error = "the stream ended without a delta"
        return None
    record.ttft = answer.first - start
    record.tpot = (end - answer.first) / max(answer.output_tokens - 1, 1)
    record.input_tokens, record.cached_tokens = answer.input_tokens, answer.cached_tokens
    record.output_tokens = answer.output_tokens
    return answer


async def replay(target: ServeTarget, sessions: list[AgentSession], api: str,
                 max_concurrency: int | None) -> tuple[list[TurnRecord], float]:
    """Every session's turns, in order within a session; (records, duration in seconds)."""
    if api not in APIS:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    gate = asyncio.Semaphore(max_concurrency or len(sessions))
    records: list[TurnRecord] = []

    async def conversation(index: int, session: AgentSession, http: aiohttp.ClientSession) -> None:
        async with gate:
            conv = _Conversation(session, api)
            for turn, max_tokens in enumerate(session.output_lens):
                record = TurnRecord(index, turn)
                records.append(record)
                answer = await _turn(http, target, conv, record, max_tokens)
                if answer is None:
                    return  # a conversation whose turn failed cannot go on
                if turn < len(session.tool_results):
                    conv.add(answer, turn, session.tool_results[turn])

    start = time.perf_counter()
    # A fresh connection a turn: llama-server closes a kept-alive one after a streamed answer, and the
    # next turn's write on it fails (a connect is well under a millisecond here).
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(conversation(i, s, http) for i, s in enumerate(sessions)))
    return sorted(records, key=lambda r: (r.conversation, r.turn)), time.perf_counter() - start


def per_turn(records: list[TurnRecord]) -> list[dict]:
    """By turn number: requests, mean TTFT and TPOT (ms), input tokens, and the cached share of them."""
    rows = []
    for turn in sorted({r.turn for r in records}):
        ok = [r for r in records if r.turn == turn and r.error is None]
        inputs = sum(r.input_tokens for r in ok)
        rows.append({"turn": turn + 1, "requests": len(ok),
                     "failed": sum(1 for r in records if r.turn == turn and r.error is not None),
                     "mean_input_tokens": inputs / len(ok) if ok else 0.0,
                     "mean_ttft_ms": 1000 * sum(r.ttft for r in ok) / len(ok) if ok else None,
                     "mean_tpot_ms": 1000 * sum(r.tpot for r in ok) / len(ok) if ok else None,
                     "cached_share": sum(r.cached_tokens for r in ok) / inputs if inputs else None})
    return rows


def per_turn_text(rows: list[dict]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [f"{'turn':>4} {'requests':>8} {'failed':>6} {'input tok':>9} {'TTFT ms':>9} {'TPOT ms':>8} {'cached':>7}"]
    for r in rows:
        cached = "-" if r["cached_share"] is None else f"{r['cached_share']:.1%}"
        lines.append(f"{r['turn']:>4} {r['requests']:>8} {r['failed']:>6} {r['mean_input_tokens']:>9.0f} "
                     f"{ms(r['mean_ttft_ms']):>9} {ms(r['mean_tpot_ms']):>8} {cached:>7}")
    return "\n".join(lines)
