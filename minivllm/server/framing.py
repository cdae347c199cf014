"""OpenAI's response shapes, and the framing of the engine's outputs as them: whole responses, and the
server-sent events of a stream (one event per choice per engine step, then the usage, then [DONE]).

    RequestOutput (cumulative) --ChoiceTracker--> Delta (what a step added) --Formatter--> chunk / response
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.sse import format_sse_event
from pydantic import BaseModel, Field

from minivllm.frontend.async_engine import EngineDeadError, RequestStream
from minivllm.outputs import RequestMetrics, RequestOutput
from minivllm.server.protocol import APIError
from minivllm.server.reasoning import ReasoningStream, split_reasoning
from minivllm.server.tools import ToolCallOutput


# -- responses ----------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extension: per prompt token (None for the first), {token id: {logprob, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning: str | None = None  # with --reasoning-parser: the thought (vLLM's field) ...
    reasoning_content: str | None = None  # ... and the same under DeepSeek's name


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # {"role": "assistant"} first, then {"content": ...} and/or {"tool_calls": [...]}
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response(BaseModel):
    id: str
    object: str
    created: int
    model: str
    usage: Usage | None = None


class CompletionResponse(_Response):
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Response):
    choices: list[ChatChoice]


class ChatCompletionChunk(_Response):
    choices: list[ChatChunkChoice]


TIME_BREAKDOWN = ("frontend_queue", "engine_queue", "prefill", "decode", "detokenize_stream")


# -- from engine outputs to OpenAI choices ------------------------------------------------------------------
@dataclass
class Delta:
    """What one engine step added to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    text_offset: int  # where `text` starts in the choice's whole text
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # in the choice's first delta, when asked


@dataclass
class _ChoiceCursor:
    text_len: int = 0
    num_tokens: int = 0


@dataclass
class ChoiceTracker:
    """Turns the engine's cumulative outputs of a group of requests into per-choice deltas and usage."""

    index_of: dict[str, int]  # engine request id -> choice index
    n: int  # choices per prompt: prompt tokens count once per prompt
    cursors: dict[int, _ChoiceCursor] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt number -> its length
    last_finished: RequestMetrics | None = None  # of the choice that finished last

    def delta(self, out: RequestOutput) -> Delta | None:
        index, c = self.index_of[out.request_id], out.outputs[0]
        cur = self.cursors.setdefault(index, _ChoiceCursor())
        self.prompt_tokens[index // self.n] = len(out.prompt_token_ids)
        new_tokens = c.token_ids[cur.num_tokens:]
        if not new_tokens and not out.finished:
            return None
        d = Delta(index, c.text[cur.text_len:], new_tokens,
                  c.logprobs[cur.num_tokens:] if c.logprobs is not None else None, cur.text_len,
                  c.finish_reason, c.stop_reason, out.prompt_logprobs if cur.num_tokens == 0 else None)
        cur.text_len, cur.num_tokens = len(c.text), len(c.token_ids)
        if out.finished:
            self.last_finished = out.metrics
        return d

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.num_tokens for c in self.cursors.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def time_breakdown_ms(self, received: float, done: float) -> dict[str, float | None]:
        """Where the request's time went (milliseconds; None for a phase it never reached), by the
        engine's timestamps of the choice that finished last: from the server receiving it to its arrival
        at the engine client (parsing, the chat template, tokenizing), from there to its first step (the
        hop to the engine's process, waiting in its queue), the prefill (to the first token), the decode
        (to the last), and from the last token to the last chunk written (detokenizing, framing, sending)."""
        m = self.last_finished
        marks = [received, *((m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time)
                             if m else (None,) * 4), done]
        return {name: None if a is None or b is None else round((b - a) * 1000, 3)
                for name, a, b in zip(TIME_BREAKDOWN, marks, marks[1:])}


def whole_choice(index: int, out: RequestOutput) -> Delta:
    c = out.outputs[0]
    return Delta(index, c.text, c.token_ids, c.logprobs, 0, c.finish_reason, c.stop_reason, out.prompt_logprobs)


class Formatter(ABC):
    """What differs between the two APIs: names, and how a choice and a stream chunk look."""

    object: str
    chunk_object: str
    id_prefix: str

    def __init__(self, token_text: Callable[[int], str], top_logprobs: int | None) -> None:
        self.token_text = token_text
        self.top_logprobs = top_logprobs  # how many alternatives per token were asked for, None: none

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[: self.top_logprobs]

    def stream_start(self, base: dict[str, Any], num_choices: int) -> list[BaseModel]:
        """Chunks sent before any token."""
        return []

    @abstractmethod
    def response(self, base: dict[str, Any], choices: list[Delta], usage: Usage) -> BaseModel:
        """The whole answer of a non-streamed request."""

    @abstractmethod
    def chunk(self, base: dict[str, Any], d: Delta | None, usage: Usage | None = None) -> BaseModel | None:
        """One stream event: a choice's delta, or (d=None) the usage; None: nothing to send yet."""


class CompletionFormatter(Formatter):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, token_text: Callable[[int], str], top_logprobs: int | None,
                 echo: list[str] | None = None, n: int = 1) -> None:
        super().__init__(token_text, top_logprobs)
        self.echo, self.n = echo, n  # echo: each prompt's text, put before its choices' first text
        self._echoed: set[int] = set()

    def _text(self, d: Delta) -> str:
        if self.echo is None or d.index in self._echoed:
            return d.text
        self._echoed.add(d.index)
        return self.echo[d.index // self.n] + d.text

    def _logprobs(self, d: Delta) -> CompletionLogprobs | None:
        if d.logprobs is None:
            return None
        tokens = [self.token_text(t) for t in d.token_ids]
        offsets = [d.text_offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[e[t] for t, e in zip(d.token_ids, d.logprobs)],
            top_logprobs=[{self.token_text(k): v for k, v in self._top(e)} for e in d.logprobs], text_offset=offsets)

    def choice(self, d: Delta) -> CompletionChoice:
        prompt_logprobs = None if d.prompt_logprobs is None else [
            None if e is None else {str(t): {"logprob": v, "decoded_token": self.token_text(t)} for t, v in e.items()}
            for e in d.prompt_logprobs]
        return CompletionChoice(index=d.index, text=self._text(d), logprobs=self._logprobs(d),
                                finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                                prompt_logprobs=prompt_logprobs)

    def response(self, base: dict[str, Any], choices: list[Delta], usage: Usage) -> BaseModel:
        return CompletionResponse(**base, object=self.object, choices=[self.choice(d) for d in choices], usage=usage)

    def chunk(self, base: dict[str, Any], d: Delta | None, usage: Usage | None = None) -> BaseModel:
        return CompletionResponse(**base, object=self.chunk_object, choices=[self.choice(d)] if d else [],
                                  usage=usage)


class ChatFormatter(Formatter):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, token_text: Callable[[int], str], top_logprobs: int | None,
                 tools: ToolCallOutput | None = None, reasoning_parser: str | None = None) -> None:
        super().__init__(token_text, top_logprobs)
        self.tools = tools  # None: the text is all content
        self.reasoning_parser = reasoning_parser  # None: no thought is split off
        self._thoughts: dict[int, ReasoningStream] = {}

    def _logprobs(self, d: Delta) -> ChatLogprobs | None:
        if d.logprobs is None:
            return None

        def top(token: int, logprob: float) -> TopLogprob:
            text = self.token_text(token)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return ChatLogprobs(content=[
            TokenLogprob(**top(t, e[t]).model_dump(), top_logprobs=[top(k, v) for k, v in self._top(e)])
            for t, e in zip(d.token_ids, d.logprobs)])

    def response(self, base: dict[str, Any], choices: list[Delta], usage: Usage) -> BaseModel:
        return ChatCompletionResponse(**base, object=self.object, usage=usage,
                                      choices=[self._choice(d) for d in choices])

    def _choice(self, d: Delta) -> ChatChoice:
        thought, text = split_reasoning(self.reasoning_parser, d.text) if self.reasoning_parser else (None, d.text)
        content, calls, parsed_thought = self.tools.whole(text or "") if self.tools else (text, [], None)
        thought = thought or parsed_thought
        message = ChatResponseMessage(content=content, tool_calls=[c.openai() for c in calls], reasoning=thought,
                                      reasoning_content=thought)
        return ChatChoice(index=d.index, message=message, logprobs=self._logprobs(d),
                          finish_reason=_tool_finish(d.finish_reason, bool(calls)), stop_reason=d.stop_reason)

    def stream_start(self, base: dict[str, Any], num_choices: int) -> list[BaseModel]:
        return [ChatCompletionChunk(**base, object=self.chunk_object,
                                    choices=[ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
                for i in range(num_choices)]

    def chunk(self, base: dict[str, Any], d: Delta | None, usage: Usage | None = None) -> BaseModel | None:
        choices = [self._chunk_choice(d)] if d else []
        if d and choices[0] is None:
            return None
        return ChatCompletionChunk(**base, object=self.chunk_object, choices=choices, usage=usage)

    def _chunk_choice(self, d: Delta) -> ChatChunkChoice | None:
        finish, text, thought = d.finish_reason, d.text, ""
        if self.reasoning_parser:
            stream = self._thoughts.setdefault(d.index, ReasoningStream(self.reasoning_parser))
            thought, text = stream.feed(d.text, finish is not None)
        if self.tools is None:
            delta: dict[str, Any] = {"content": text} if text or not thought else {}
        else:  # tool calls are held back until they parse: a step may have nothing to send
            content, calls, parsed_thought = self.tools.stream(d.index, text, d.finish_reason is not None)
            thought += parsed_thought
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls
            finish = _tool_finish(finish, self.tools.called(d.index))
        if thought:
            delta.update(reasoning=thought, reasoning_content=thought)
        if not delta and finish is None and (self.tools or self.reasoning_parser):
            return None
        return ChatChunkChoice(index=d.index, delta=delta, logprobs=self._logprobs(d), finish_reason=finish,
                               stop_reason=d.stop_reason)


def _tool_finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for an answer that ended by calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def sse_event(chunk: BaseModel) -> bytes:
    return format_sse_event(data_str=chunk.model_dump_json())


async def stream_chunks(stream: RequestStream, tracker: ChoiceTracker, fmt: Formatter, base: dict[str, Any],
                        num_choices: int) -> AsyncIterator[BaseModel]:
    """The chunks of a streamed request: one per choice per engine step (raises EngineDeadError if the
    engine dies meanwhile). Closing this (a client that hung up) aborts the requests."""
    try:
        for chunk in fmt.stream_start(base, num_choices):
            yield chunk
        async for out in stream:
            if (d := tracker.delta(out)) is not None and (chunk := fmt.chunk(base, d)) is not None:
                yield chunk
    finally:
        stream.close()


async def stream_events(chunks: AsyncIterator[BaseModel], tracker: ChoiceTracker, fmt: Formatter,
                        base: dict[str, Any], include_usage: bool, received: float) -> AsyncIterator[bytes]:
    """OpenAI's stream: the chunks, then the usage (and the time breakdown), then [DONE]; if the engine
    dies meanwhile, an error object before [DONE]."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
        if include_usage:
            last = fmt.chunk(base, None, tracker.usage()).model_dump()
            last["time_breakdown_ms"] = tracker.time_breakdown_ms(received, time.perf_counter())
            yield format_sse_event(data_str=json.dumps(last, separators=(",", ":")))
    except EngineDeadError as e:
        yield format_sse_event(data_str=json.dumps(APIError(503, str(e), None, "engine_dead").body()))
    finally:
        await chunks.aclose()
    yield format_sse_event(data_str="[DONE]")
