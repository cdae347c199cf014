"""The checkpoint's own tokenizer and chat template, and incremental detokenization."""
from __future__ import annotations

import os
from pathlib import Path

from minivllm.model.loader import ModelConfig, model_files_dir


class Tokenizer:
    def __init__(self, path: Path, config: ModelConfig) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        directory, gguf_file = model_files_dir(path)
        self.hf = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        self.backend = self.hf.backend_tokenizer  # the Rust tokenizer: decode without Python overhead
        eos = set(config.eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.add(self.hf.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.vocab_size = config.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The prompt of a conversation, by the model's template or `chat_template` (which may render
        `tools`: OpenAI tool definitions)."""
        if not (chat_template or self.hf.chat_template):
            raise ValueError("this model has no chat template; use completions instead")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, tools=tools)


class IncrementalDetokenizer:
    """Turns tokens into text one at a time without ever emitting half a UTF-8 character.

    A few prompt tokens are kept as context, because many tokenizers decode a token differently at
    the start of a string (a leading space dropped, say).
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-self.CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes ('' while a character is incomplete)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta
