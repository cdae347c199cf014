"""The checkpoint's own tokenizer and chat template, and incremental detokenization.

A GGUF file's tokenizer is converted by transformers (seconds: it reads the vocabulary and merges
from the file's metadata), once: the result is saved as Hugging Face files under the cache
directory, keyed by a hash of everything the conversion reads and by the converter's version, and
later runs read it from there with the Rust `tokenizers` library alone (milliseconds). transformers
itself is imported only for what needs it: the chat template and the `hf` object.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from minivllm.config import cache_dir
from minivllm.model.loader import ModelConfig, model_files_dir

# Bump when what minivllm saves for a converted tokenizer changes.
TOKENIZER_CACHE_VERSION = 1


class Tokenizer:
    def __init__(self, path: Path, config: ModelConfig) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._hf: Any = None
        if path.is_dir():  # a checkpoint directory: its files, as transformers reads them
            self.files = path
            self._hf = _auto_tokenizer(path)
            self.backend = self._hf.backend_tokenizer
            hf_eos = self._hf.eos_token_id
        else:
            from tokenizers import Tokenizer as RustTokenizer

            self.files = gguf_tokenizer_files(path)
            self.backend = RustTokenizer.from_file(str(self.files / "tokenizer.json"))
            hf_eos = self.backend.token_to_id(_special_token(self.files, "eos_token") or "")
        # As transformers calls it: no truncation, no padding, special tokens in text not split.
        self.backend.no_truncation()
        self.backend.no_padding()
        eos = set(config.eos_token_ids)
        if hf_eos is not None:
            eos.add(hf_eos)
        self.eos_token_ids = sorted(eos)
        self.vocab_size = config.vocab_size

    @property
    def hf(self) -> Any:
        """The transformers tokenizer of the same files (imported and built on first use)."""
        if self._hf is None:
            self._hf = _auto_tokenizer(self.files)
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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


_loaded: dict[Path, Tokenizer] = {}


def get_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    """The checkpoint's tokenizer, built once per process: every engine and benchmark shares it."""
    key = path.resolve()
    if key not in _loaded:
        _loaded[key] = Tokenizer(path, config)
    return _loaded[key]


def _auto_tokenizer(directory: Path | str, gguf_file: str | None = None) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)


def _special_token(files: Path, name: str) -> str | None:
    token = json.loads((files / "tokenizer_config.json").read_text()).get(name)
    return token.get("content") if isinstance(token, dict) else token  # an AddedToken is saved as a dict


def gguf_tokenizer_key(path: Path) -> str:
    """What the conversion depends on: the file's metadata and tensor table (the bytes before the
    tensor data; the tokenizer is in the metadata), and the versions of the code that converts."""
    from minivllm.model.gguf_file import GGUFFile

    digest = hashlib.sha256(GGUFFile(path).header())
    for part in (version("transformers"), version("tokenizers"), str(TOKENIZER_CACHE_VERSION)):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:32]


def gguf_tokenizer_files(path: Path) -> Path:
    """The directory of the GGUF file's tokenizer as Hugging Face files, converted on a cache miss."""
    target = cache_dir() / "tokenizers" / gguf_tokenizer_key(path)
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:  # write aside, then rename: a reader never sees half a directory
        _auto_tokenizer(*model_files_dir(path)).save_pretrained(tmp)
        tmp.rename(target)
    except OSError:
        if not (target / "tokenizer.json").is_file():  # not another process winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
