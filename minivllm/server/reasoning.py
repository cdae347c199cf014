"""Thinking models' answers split into their reasoning and their content (--reasoning-parser).

Qwen3 and DeepSeek-R1 write their chain of thought between <think> and </think>, then the answer.
vLLM's parsers of the same names put the thought in the message's `reasoning` field (vLLM's name today;
`reasoning_content` too here, DeepSeek's, which many clients still read) and the rest in `content`:
- qwen3: the thought is there only if the answer starts with <think> (with enable_thinking false the
  template leaves it out, and everything is content);
- deepseek_r1: the template opens <think> in the prompt, so the answer starts inside the thought
  (a <think> the model writes anyway is dropped); without </think> it is all reasoning.
"""
from __future__ import annotations

from minivllm.server.tool_parsers import held_back

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None where there is none."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text, finished=True)
    if parser == "qwen3" and not stream.closed:  # an unclosed <think>: not a thought, all content
        return None, text or None
    return (reasoning or None) if stream.opened else None, content or None


class ReasoningStream:
    """One choice's text, delta by delta, as (reasoning delta, content delta). Text that may be the start
    of a tag is held back until the next delta decides it (or the answer ends)."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
        self.parser = parser
        self.opened = parser == "deepseek_r1"  # inside (or past) the thought
        self.closed = False  # past </think>
        self._held = ""
        self._undecided = True  # at the start: a <think> may come

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning = content = ""
        if self._undecided:
            stripped = text.lstrip()
            if stripped.startswith(START):
                text, self.opened, self._undecided = stripped[len(START):], True, False
            elif START.startswith(stripped) and not finished:  # "<thi" so far: wait
                self._held = text
                return "", ""
            else:
                self._undecided = False
        if self.opened and not self.closed:
            end = text.find(END)
            if end >= 0:
                reasoning, text, self.closed = text[:end], text[end + len(END):], True
            else:
                keep = 0 if finished else held_back(text, END)
                reasoning, self._held, text = text[:len(text) - keep], text[len(text) - keep:], ""
        content = text
        return reasoning, content
