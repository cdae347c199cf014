"""The checkpoint's own tokenizer and chat template, and incremental detokenization.

A GGUF file's tokenizer is converted by transformers (seconds: it reads the vocabulary and merges
from the file's metadata), once: the result is saved as Hugging Face files under the cache
directory, keyed by a hash of everything the conversion reads and by the converter's version, and
later runs read it from there with the Rust `tokenizers` library alone (milliseconds). The chat
template is rendered with jinja2 as transformers renders it; transformers itself is imported only
for the `hf` object (grammars, the HF benchmark backend).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from datetime import datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from minivllm.config import cache_dir
from minivllm.model.gguf_file import GGUFFile
from minivllm.model.loader import model_files_dir, remembered_digest
from minivllm.model.model_config import ModelConfig

# Bump when what minivllm saves for a converted tokenizer changes.
TOKENIZER_CACHE_VERSION = 2


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
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            **template_kwargs: Any) -> str:
        """The prompt of a conversation, by the model's template or `chat_template` (which may render
        `tools`: OpenAI tool definitions), rendered as transformers renders it (tests/test_startup.py
        compares them) but without importing it: a second of every server start. `template_kwargs`: the
        template's own variables (a request's chat_template_kwargs, e.g. enable_thinking=False)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; use completions instead")
        variables = {**self.special_tokens, **template_kwargs}
        return _compile_template(template).render(**variables, messages=messages, tools=tools,
                                                  add_generation_prompt=add_generation_prompt)

    @functools.cached_property
    def chat_template(self) -> str | None:
        """The checkpoint's template: chat_template.jinja, or tokenizer_config.json's (a string, or a list
        of named templates of which "default" is the chat one)."""
        path = self.files / "chat_template.jinja"
        if path.is_file():
            return path.read_text()
        config_path = self.files / "tokenizer_config.json"
        template = json.loads(config_path.read_text()).get("chat_template") if config_path.is_file() else None
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    @functools.cached_property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as a template sees them (transformers passes its special tokens map)."""
        if not (self.files / "tokenizer_config.json").is_file():
            return {}
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        return {name: token for name in names if (token := _special_token(self.files, name)) is not None}


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> Any:
    """A chat template in the environment transformers gives it: sandboxed, trim_blocks/lstrip_blocks,
    loop controls, `raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


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
    """What the conversion depends on: the file's tokenizer metadata and architecture (not its weights:
    the quantizations of one model share a conversion) and the versions of the code that converts."""
    def tokenizer_digest(files: list[Path]) -> str:
        f = GGUFFile(files[0])
        return hashlib.sha256(f.metadata_bytes("tokenizer.") + f.metadata_bytes("general.architecture")).hexdigest()

    digest = hashlib.sha256(remembered_digest(path, "tokenizer", tokenizer_digest).encode())
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
        _gguf_auto_tokenizer(path, tmp).save_pretrained(tmp)
        tmp.rename(target)
    except OSError:
        if not (target / "tokenizer.json").is_file():  # not another process winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _gguf_auto_tokenizer(path: Path, scratch: Path) -> Any:
    """transformers' tokenizer of a GGUF file. transformers converts the tokenizers of the architectures
    it knows only (not SmolLM3's or Granite's, say), yet a GGUF tokenizer does not depend on the
    architecture: for another one, its tokenizer.* fields are copied into a vocabulary-only file that
    says "llama", and that one is converted."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if GGUFFile(path).get("general.architecture") in GGUF_SUPPORTED_ARCHITECTURES:
        return _auto_tokenizer(*model_files_dir(path))
    import gguf

    reader = gguf.GGUFReader(str(path))
    vocab = scratch / "vocab.gguf"
    writer = gguf.GGUFWriter(str(vocab), "llama")
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    try:
        return _auto_tokenizer(scratch, vocab.name)
    finally:
        vocab.unlink()


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
