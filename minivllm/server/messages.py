"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens (also with ?beta=true,
as Claude Code sends them), over the shared internal chat request (serving.py).

A stream is Anthropic's: `message_start`, a `ping`, then per content block `content_block_start`,
its deltas (`thinking_delta` then `signature_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, with indices 0, 1, 2, ... in order; then `message_delta` (stop reason, usage)
and `message_stop`. While the prompt prefills, a `ping` every PING_INTERVAL_S keeps idle timeouts
away. Errors take Anthropic's shape, {"type": "error", "error": {"type", "message"}}, before the
stream and as an `error` event within it.
"""
from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel

from minivllm.frontend.async_engine import EngineDeadError
from minivllm.server.messages_protocol import (ACCEPTED_IGNORED, CountTokensRequest, MessagesRequest,
                                               arguments_object, chat_request, function_tools, json_text)
from minivllm.server.protocol import APIError, parse_request
from minivllm.server.serving import Serving, Submitted, ignored_header, known_ignored, read_body

PING_INTERVAL_S = 2.0
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def anthropic_error(e: APIError) -> JSONResponse:
    return JSONResponse(_error_body(e), status_code=e.status)


def _error_body(e: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}, "request_id": f"req_{uuid.uuid4().hex}"}


def _event(kind: str, **data: Any) -> bytes:
    return format_sse_event(event=kind, data_str=json_text({"type": kind, **data}))


def stop_reason(finish: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of an OpenAI finish reason."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class MessagesAPI:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def count_tokens(self, request: Request) -> JSONResponse:
        body = parse_request(CountTokensRequest, await read_body(request))
        self.serving.lora.resolve(body.model)
        tools, refused = function_tools(body.tools)
        chat = chat_request(body, tools)
        prompt = self.serving.chat_prompt(chat.messages, True, chat.tools)
        headers = ignored_header(known_ignored(body, ACCEPTED_IGNORED) + refused)
        return JSONResponse({"input_tokens": len(self.serving.tokenizer.encode(prompt))}, headers=headers)

    async def create(self, request: Request) -> Response:
        received = time.perf_counter()
        body = parse_request(MessagesRequest, await read_body(request))
        tools, refused = function_tools(body.tools)
        chat = chat_request(body, tools, body.stream)
        ignored = known_ignored(body, ACCEPTED_IGNORED) + refused
        gen = await self.serving.chat_generation(chat, received, ignored, fit_context=True)
        sub = await self.serving.submit(gen)
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return EventSourceResponse(self._events(sub, message_id), headers=sub.headers)
        answer = await sub.whole(request)
        if answer is None:
            return Response(status_code=499)
        return JSONResponse(self._message(sub, message_id, answer.choices[0]), headers=sub.headers)

    def _usage(self, sub: Submitted) -> dict[str, int]:
        usage, done = sub.tracker.usage(), sub.tracker.last_finished
        cached = done.num_cached_tokens if done else 0
        return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def _message(self, sub: Submitted, message_id: str, choice: Any) -> dict[str, Any]:
        m = choice.message
        content: list[dict] = []
        if m.reasoning:
            content.append({"type": "thinking", "thinking": m.reasoning, "signature": _signature()})
        if m.content:
            content.append({"type": "text", "text": m.content})
        for call in m.tool_calls:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": arguments_object(call["function"]["arguments"])})
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
        return {"id": message_id, "type": "message", "role": "assistant", "model": sub.base["model"],
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": self._usage(sub)}

    async def _events(self, sub: Submitted, message_id: str) -> AsyncIterator[bytes]:
        blocks = _Blocks()
        start = {"id": message_id, "type": "message", "role": "assistant", "model": sub.base["model"], "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(sub.gen.prompts[0]), "output_tokens": 0}}
        yield _event("message_start", message=start)
        yield _event("ping")
        chunks = _with_pings(sub.chunks())
        finish = stop = None
        try:
            async for chunk in chunks:
                if chunk is None:
                    yield _event("ping")
                    continue
                for choice in chunk.choices:
                    for event in blocks.feed(choice.delta):
                        yield event
                    if choice.finish_reason is not None:
                        finish, stop = choice.finish_reason, choice.stop_reason
        except EngineDeadError as e:
            yield _event("error", error=_error_body(APIError(503, str(e)))["error"])
            return
        finally:
            await chunks.aclose()
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(finish, stop)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=self._usage(sub))
        yield _event("message_stop")


async def _with_pings(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[BaseModel | None]:
    """The chunks, with a None each PING_INTERVAL_S that passes without one (a long prefill). Closing
    this closes `chunks` (which aborts the request), also while a chunk is awaited."""
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(chunks))
            while not (await asyncio.wait({step}, timeout=PING_INTERVAL_S))[0]:
                yield None
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        if step is not None and not step.done():
            step.cancel()  # its CancelledError closes `chunks` from within
            await asyncio.wait({step})
        await chunks.aclose()


class _Blocks:
    """OpenAI chat deltas -> Anthropic content blocks, opened and closed in order (indices 0, 1, ...)."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "thinking", "text", "tool_use"

    def _start(self, kind: str, block: dict) -> list[bytes]:
        events = self.close()
        self.open = kind
        return events + [_event("content_block_start", index=self.count, content_block=block)]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # Claude Code renders a thought only once it has a signature
            events.append(self._delta({"type": "signature_delta", "signature": _signature()}))
        events.append(_event("content_block_stop", index=self.count))
        self.open, self.count = None, self.count + 1
        return events

    def _delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", index=self.count, delta=delta)

    def feed(self, delta: dict) -> list[bytes]:
        events: list[bytes] = []
        if thought := delta.get("reasoning"):
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": thought}))
        if text := delta.get("content"):
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                events += self._start("tool_use", {"type": "tool_use", "id": call["id"],
                                                   "name": call["function"]["name"], "input": {}})
            if fragment := call["function"].get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return events


def _signature() -> str:
    """An opaque thinking signature (nothing checks it here; clients want one)."""
    return secrets.token_hex(16)
