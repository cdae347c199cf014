"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, over the shared
internal chat request (serving.py), with the bounded store of response_store.py.

A stream is typed events, each with a `sequence_number` (0, 1, 2, ...): `response.created`,
`response.in_progress`, then per output item (reasoning, message, function_call) its
`response.output_item.added`, its parts and deltas (`content_index` 0 within each item: each item here
has one part), its `.done` events and `response.output_item.done`; then `response.completed`, or
`response.incomplete` (with `incomplete_details.reason`) when max_output_tokens cut it short.
No `[DONE]`: the stream ends with the response.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event

from minivllm.frontend.async_engine import EngineDeadError
from minivllm.server.protocol import APIError, parse_request
from minivllm.server.response_store import ResponseStore
from minivllm.server.responses_protocol import (ACCEPTED_IGNORED, ResponsesRequest, chat_request, conversation,
                                                function_tools)
from minivllm.server.serving import Serving, Submitted, known_ignored, read_body


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """OpenAI chat deltas -> Responses output items, each opened, filled and closed in turn, as events."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # closed items, as output_item.done sends them
        self.open: dict[str, Any] | None = None
        self.text = ""  # of the open item's one part

    @property
    def index(self) -> int:
        return len(self.items)

    def _start(self, item: dict[str, Any]) -> list[dict]:
        events = self.close()
        self.open, self.text = item, ""
        events.append({"type": "response.output_item.added", "output_index": self.index,
                       "item": {**item, "status": "in_progress"}})
        if item["type"] != "function_call":
            part = {"type": "output_text", "text": "", "annotations": []} if item["type"] == "message" else \
                {"type": "reasoning_text", "text": ""}
            events.append(self._at({"type": "response.content_part.added", "content_index": 0, "part": part}))
        return events

    def _at(self, event: dict) -> dict:
        return {**event, "item_id": self.open["id"], "output_index": self.index}

    def close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        events = []
        if item["type"] == "function_call":
            item["arguments"] = self.text
            events.append(self._at({"type": "response.function_call_arguments.done", "arguments": self.text,
                                    "name": item["name"]}))
        else:
            text_type = "output_text" if item["type"] == "message" else "reasoning_text"
            part = {"type": text_type, "text": self.text}
            if item["type"] == "message":
                part.update(annotations=[], logprobs=[])
            item["content"] = [part]
            events.append(self._at({"type": f"response.{text_type}.done", "content_index": 0, "text": self.text}))
            events.append(self._at({"type": "response.content_part.done", "content_index": 0, "part": part}))
        item["status"] = "completed"
        events.append({"type": "response.output_item.done", "output_index": self.index, "item": item})
        self.items.append(item)
        self.open = None
        return events

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if thought := delta.get("reasoning"):
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start({"id": _id("rs"), "type": "reasoning", "summary": [], "content": []})
            events.append(self._grow("response.reasoning_text.delta", thought))
        if text := delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._start({"id": _id("msg"), "type": "message", "role": "assistant", "content": []})
            events.append(self._grow("response.output_text.delta", text, logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                events += self._start({"id": _id("fc"), "type": "function_call", "call_id": call["id"],
                                       "name": call["function"]["name"], "arguments": ""})
            if fragment := call["function"].get("arguments"):
                events.append(self._grow("response.function_call_arguments.delta", fragment))
        return events

    def _grow(self, kind: str, fragment: str, **more: Any) -> dict:
        self.text += fragment
        event = self._at({"type": kind, "delta": fragment, **more})
        if self.open["type"] != "function_call":
            event["content_index"] = 0
        return event


def _assistant_turn(items: list[dict]) -> list[dict]:
    """The output items as the chat messages a following turn continues from."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            message["reasoning"] = item["content"][0]["text"]
        elif item["type"] == "message":
            message["content"] += item["content"][0]["text"]
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return [message]


class ResponsesAPI:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.store = ResponseStore(serving.options.response_store_entries, serving.options.response_store_bytes)

    async def retrieve(self, response_id: str) -> JSONResponse:
        return JSONResponse(self._stored(response_id, "response_id").response)

    async def delete(self, response_id: str) -> JSONResponse:
        self._stored(response_id, "response_id")
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def _stored(self, response_id: str, param: str) -> Any:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found (never stored, deleted, or evicted "
                                "from this server's bounded store).", param, "response_not_found")
        return entry

    async def create(self, request: Request) -> Response:
        received = time.perf_counter()
        body = parse_request(ResponsesRequest, await read_body(request))
        if body.background:
            raise APIError(400, "background responses are not served: stream, or wait for the answer", "background")
        before = self._stored(body.previous_response_id, "previous_response_id").conversation \
            if body.previous_response_id else []
        messages = before + conversation(body.input, before)
        tools, refused = function_tools(body.tools)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        chat = chat_request(body, system + messages, tools)
        ignored = known_ignored(body, ACCEPTED_IGNORED) + refused
        gen = await self.serving.chat_generation(chat, received, ignored, fit_context=True)
        sub = await self.serving.submit(gen)
        shell = self._shell(body, sub)
        if body.stream:
            return EventSourceResponse(self._events(sub, shell, body, messages), headers=sub.headers)
        answer = await sub.whole(request)
        if answer is None:
            return Response(status_code=499)
        choice, output = answer.choices[0], _Output()
        m = choice.message
        output.feed({"reasoning": m.reasoning, "content": m.content, "tool_calls": [
            {**c, "function": dict(c["function"])} for c in m.tool_calls]})
        output.close()
        response = self._finish(shell, sub, output.items, choice.finish_reason)
        self._keep(body, response, messages)
        return JSONResponse(response, headers=sub.headers)

    def _shell(self, body: ResponsesRequest, sub: Submitted) -> dict[str, Any]:
        return {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "error": None, "incomplete_details": None, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": sub.base["model"], "output": [],
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "reasoning": body.reasoning,
                "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
                "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
                "usage": None, "user": body.user, "metadata": body.metadata or {}}

    def _finish(self, shell: dict, sub: Submitted, items: list[dict], finish: str | None) -> dict[str, Any]:
        usage, done = sub.tracker.usage(), sub.tracker.last_finished
        cut = finish == "length"
        return {**shell, "status": "incomplete" if cut else "completed", "output": items,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "usage": {"input_tokens": usage.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": done.num_cached_tokens if done else 0},
                          "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage.total_tokens}}

    def _keep(self, body: ResponsesRequest, response: dict, messages: list[dict]) -> None:
        if body.store:
            self.store.put(response, messages + _assistant_turn(response["output"]))

    async def _events(self, sub: Submitted, shell: dict, body: ResponsesRequest,
                      messages: list[dict]) -> AsyncIterator[bytes]:
        number = 0

        def event(data: dict) -> bytes:
            nonlocal number
            number += 1
            return format_sse_event(event=data["type"], data_str=json.dumps({**data, "sequence_number": number - 1}))

        yield event({"type": "response.created", "response": shell})
        yield event({"type": "response.in_progress", "response": shell})
        output, finish, chunks = _Output(), None, sub.chunks()
        try:
            async for chunk in chunks:
                for choice in chunk.choices:
                    for e in output.feed(choice.delta):
                        yield event(e)
                    finish = choice.finish_reason or finish
        except EngineDeadError as e:
            yield event({"type": "error", "code": "engine_dead", "message": str(e), "param": None})
            return
        finally:
            await chunks.aclose()
        for e in output.close():
            yield event(e)
        response = self._finish(shell, sub, output.items, finish)
        self._keep(body, response, messages)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield event({"type": kind, "response": response})
