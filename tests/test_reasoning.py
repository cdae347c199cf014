"""--reasoning-parser (server/reasoning.py): a thinking model's <think> part apart from its content, whole
and streamed (every split of the text into deltas gives the same two parts), and the server's use of it."""
from __future__ import annotations

import pytest

from minivllm.server.reasoning import ReasoningStream, split_reasoning

CASES = [  # parser, model output, (reasoning, content)
    ("qwen3", "<think>\nLet me add 2 and 2.\n</think>\n\nIt is 4.", ("\nLet me add 2 and 2.\n", "\n\nIt is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),  # enable_thinking false: no thought at all
    ("qwen3", "<think>cut short", (None, "<think>cut short")),  # never closed: all content, as vLLM's
    ("deepseek_r1", "Let me add.</think>It is 4.", ("Let me add.", "It is 4.")),  # <think> was in the prompt
    ("deepseek_r1", "<think>Let me add.</think>It is 4.", ("Let me add.", "It is 4.")),
    ("deepseek_r1", "Still thinking", ("Still thinking", None)),
]


@pytest.mark.parametrize("parser,text,expected", CASES)
def test_whole_answer(parser: str, text: str, expected: tuple) -> None:
    assert split_reasoning(parser, text) == expected


@pytest.mark.parametrize("parser,text,expected", [c for c in CASES if c[1] != "<think>cut short"])
def test_any_split_into_deltas_streams_the_same_parts(parser: str, text: str, expected: tuple) -> None:
    for cut in range(len(text) + 1):
        for step in (1, 3):
            stream, thought, content = ReasoningStream(parser), "", ""
            pieces = [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]
            for k, piece in enumerate(pieces):
                r, c = stream.feed(piece, finished=k == len(pieces) - 1)
                thought, content = thought + r, content + c
            assert (thought or None, content or None) == expected, (cut, step)


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        ReasoningStream("o1")


def test_chat_template_kwargs_and_earlier_thoughts_reach_the_template(llm) -> None:
    """chat_template_kwargs are the template's variables (Qwen3's enable_thinking); an assistant message
    sent back with `reasoning` or `reasoning_content` hands its thought to the template."""
    from minivllm.server.api import ChatMessage

    template = ("{% for m in messages %}[{{ m.role }}:{{ m.reasoning_content or '' }}|{{ m.content }}]{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    messages = [ChatMessage(role="user", content="2+2?"),
                ChatMessage(role="assistant", content="4", reasoning="adding"),
                ChatMessage(role="assistant", content="4", reasoning_content="again")]
    tokenizer = llm.engine.tokenizer
    dicts = [m.template_dict() for m in messages]
    assert tokenizer.apply_chat_template(dicts, chat_template=template, enable_thinking=False) == \
        "[user:|2+2?][assistant:adding|4][assistant:again|4]<think></think>"
    assert not tokenizer.apply_chat_template(dicts, chat_template=template).endswith("</think>")
