"""The packed weights cached on disk: mapped back, they equal the freshly built ones; the key follows
the checkpoint's bytes; a damaged entry is rebuilt, not trusted."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.executor import ModelParts
from minivllm.model import weight_cache
from minivllm.model.build import build_model
from minivllm.model.kernels import quant_gemm
from minivllm.model.decoder import CausalLM
from minivllm.model.loader import checkpoint_digest
from minivllm.model.quant import QuantizedWeight
from minivllm.model.runner import ModelRunner
from minivllm.model.sampler import Sampler
from minivllm.model.weights import model_state
from tests.helpers import EQUALITY_PROMPTS

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(quant_gemm(CPU, torch.bfloat16) is None, reason="needs the native quantized kernel")


def _build(path: Path) -> tuple[Any, CausalLM]:
    return build_model.__wrapped__(path, CPU, torch.bfloat16, "gguf")  # past the per-process memo


def _held(value: torch.Tensor | QuantizedWeight) -> list:
    """What a weight holds: its tensor, or each segment's format, rows and packed bytes."""
    if isinstance(value, QuantizedWeight):
        return [(s.qtype, s.n, s.packed) for s in value.segments]
    return [value]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x[:2] == y[:2] and torch.equal(x[2], y[2])
        for x, y in zip(a, b))


def test_mapped_weights_equal_the_built_ones(llm: Any, default_model_path: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    entry = weight_cache.cache_file(default_model_path, CPU, torch.bfloat16, "gguf")
    config, built = _build(default_model_path)  # builds, then writes the entry
    assert entry.is_file()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("built again instead of mapped from the cache")

    monkeypatch.setattr("minivllm.model.build.model_from_weights", refuse)
    mapped_config, mapped = _build(default_model_path)
    assert mapped_config == config
    built_state, mapped_state = model_state(built), model_state(mapped)
    assert built_state.keys() == mapped_state.keys()
    for name, value in built_state.items():
        assert type(mapped_state[name]) is type(value), name
        assert _same(_held(mapped_state[name]), _held(value)), name
    assert mapped.lm_head.quantized is mapped.embed_tokens.quantized  # still one tied object
    assert mapped.uses_native_kernels and mapped.native_forward is not None

    # The same greedy tokens and logprobs through an engine on each.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outputs = []
    for model in (built, mapped):
        parts = ModelParts(config, llm.engine.tokenizer, ModelRunner(model, 64, 16, CPU, torch.bfloat16),
                           Sampler(CPU, 0), 64)
        engine = LLMEngine(EngineConfig(num_kv_blocks=64), parts=parts)
        for i, prompt in enumerate(EQUALITY_PROMPTS[:3]):
            engine.add_request(str(i), prompt, params)
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        outputs.append(sorted((o.request_id, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in finished))
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3


def test_the_key_follows_the_bytes_and_a_damaged_entry_is_rebuilt(
        default_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path, copy)
    key = weight_cache.cache_file(copy, CPU, torch.bfloat16, "gguf")
    assert weight_cache.cache_file(copy, CPU, torch.float32, "gguf") != key
    assert weight_cache.cache_file(copy, CPU, torch.bfloat16, "int8") != key
    assert weight_cache.cache_file(copy, CPU, torch.bfloat16, "none") is None  # nothing packed to save

    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF  # a weight's byte: the same size, a new version of the file
    copy.write_bytes(data)
    os.utime(copy, ns=(1, 1))
    checkpoint_digest.cache_clear()
    assert weight_cache.cache_file(copy, CPU, torch.bfloat16, "gguf") != key

    _build(copy)
    entry = weight_cache.cache_file(copy, CPU, torch.bfloat16, "gguf")
    whole = entry.read_bytes()
    for cut in (100, len(whole) // 2):  # in the header, in the tensors
        entry.write_bytes(whole[:cut])
        assert weight_cache.load(entry) is None
    _, model = _build(copy)  # rebuilt and rewritten
    assert weight_cache.load(entry) is not None and model.uses_native_kernels
