"""Cold start: the tokenizer converted once and read back from the cache, and the KV pool's memory
committed only where blocks are written."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import minivllm
from tests.helpers import EQUALITY_PROMPTS, LONG_PROMPT

MULTILINGUAL = EQUALITY_PROMPTS[1:5] + [
    "Ça coûte 12,50 € — très cher !", "Привет, как дела?", "こんにちは、世界。", "emoji: 🚀🔥 and tabs\tand\nnewlines",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>", LONG_PROMPT,
]


class Converted(Exception):
    """Raised instead of converting: the test wanted the cache."""


def test_cached_tokenizer_equals_fresh_conversion_and_follows_the_file(
        default_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from minivllm.model import tokenizer as tokenizer_module
    from minivllm.model.loader import load_checkpoint
    from minivllm.model.tokenizer import Tokenizer, _auto_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config, _ = load_checkpoint(default_model_path)
    fresh = _auto_tokenizer(default_model_path.parent, gguf_file=default_model_path.name)
    Tokenizer(default_model_path, config)  # converts, into the empty cache
    assert len(list((tmp_path / "cache" / "minivllm" / "tokenizers").iterdir())) == 1

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Converted

    monkeypatch.setattr(tokenizer_module, "_auto_tokenizer", refuse)
    cached = Tokenizer(default_model_path, config)  # read back: no conversion
    for text in MULTILINGUAL:
        for special in (True, False):
            ids = fresh(text, add_special_tokens=special)["input_ids"]
            assert cached.encode(text, add_special_tokens=special) == ids, text
        assert cached.decode(ids, skip_special_tokens=False) == fresh.decode(ids)
    assert cached.eos_token_ids == sorted({*config.eos_token_ids, fresh.eos_token_id})
    monkeypatch.setattr(tokenizer_module, "_auto_tokenizer", _auto_tokenizer)  # .hf reads the cached files
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est Paris ?"}]
    assert cached.apply_chat_template(messages) == fresh.apply_chat_template(messages, tokenize=False,
                                                                               add_generation_prompt=True)

    # The key is the file's tokenizer metadata: other weights read it back; a changed token converts again.
    monkeypatch.setattr(tokenizer_module, "_auto_tokenizer", refuse)
    data = bytearray(default_model_path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor
    (tmp_path / "weights_changed.gguf").write_bytes(data)
    Tokenizer(tmp_path / "weights_changed.gguf", config)
    data[-1] ^= 0xFF
    at = data.index(b"<|im_start|>")
    data[at + 5] = ord("S")  # one token's text, same length
    (tmp_path / "tokens_changed.gguf").write_bytes(data)
    with pytest.raises(Converted):
        Tokenizer(tmp_path / "tokens_changed.gguf", config)
    monkeypatch.setattr(tokenizer_module, "TOKENIZER_CACHE_VERSION", tokenizer_module.TOKENIZER_CACHE_VERSION + 1)
    with pytest.raises(Converted):
        Tokenizer(default_model_path, config)


def test_tokenizer_flag_takes_a_directory_instead_of_the_files_own(
        llm: Any, default_model_path: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    """--tokenizer (vLLM's flag): a GGUF model with a Hugging Face directory's tokenizer, never converting the
    file's; the same tokens as the file's own. A directory without tokenizer files is refused, naming it."""
    from minivllm import LLM
    from minivllm.config import EngineConfig

    other = LLM(model=str(default_model_path), tokenizer=str(tokenizer_dir), num_kv_blocks=16)
    assert other.engine.tokenizer.files == tokenizer_dir
    for text in MULTILINGUAL:
        assert other.get_tokenizer().encode(text) == llm.get_tokenizer().encode(text), text
    with pytest.raises(ValueError, match=f"tokenizer: '{tmp_path}' is not a directory of Hugging Face tokenizer files"):
        EngineConfig(tokenizer=str(tmp_path))


def test_one_tokenizer_per_checkpoint(llm: Any, default_model_path: Path) -> None:
    from minivllm.bench.workloads import load_tokenizer

    assert load_tokenizer(str(default_model_path))[0] is load_tokenizer(None)[0] is llm.engine.tokenizer


def _pages_present(tensor: Any) -> int:
    """How many of the tensor's memory pages the process has touched (/proc/self/pagemap: one
    64-bit entry per page, bit 63 set when the page is mapped in)."""
    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    first = tensor.data_ptr() // page
    count = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page) - first
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read(count * 8), dtype=np.uint64)
    return int((entries >> np.uint64(63)).sum())


def _huge_page_size() -> int:
    """Bytes of a transparent huge page where Linux has them enabled, else 0."""
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    if not (thp / "enabled").exists() or "[never]" in (thp / "enabled").read_text():
        return 0
    return int((thp / "hpage_pmd_size").read_text())


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads /proc/self/pagemap")
def test_kv_pool_memory_is_committed_only_where_written() -> None:
    from minivllm import LLM, SamplingParams

    # The shared fixtures' weights (float32), with a pool of 1 GiB.
    llm = LLM(dtype="float32", num_kv_blocks=2048)
    pool = [t for cache in llm.engine.runner.kv_caches for t in cache.tensors()]
    assert sum(_pages_present(t) for t in pool) == 0
    llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    page = os.sysconf("SC_PAGE_SIZE")
    block_pages = pool[0][0].numel() * pool[0].element_size() // page + 2
    huge_pages = 2 * _huge_page_size() // page  # the pool asks for huge pages: a block may touch two
    for t in pool:  # one block written per layer: its few pages (or huge pages), not the tensor's thousands
        assert 0 < _pages_present(t) <= max(block_pages, huge_pages) < t.numel() * t.element_size() // page // 4
    for t in pool:  # and every slot never written reads as zero (the torch path must not see garbage)
        assert int(t.count_nonzero()) <= t[0].numel()
