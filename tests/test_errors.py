"""Bad input gets a clear error naming the problem, and the engine goes on serving without leaking
a block (the `llm` fixtures check idleness and free blocks after every test too)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM, SamplingParams
from tests.helpers import assert_idle, write_tiny_gguf


def assert_still_serves(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.finished and len(out.outputs[0].token_ids) == 3
    assert_idle(llm.engine)


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt_token_ids is empty"),
    ({"prompt": ""}, "prompt is empty"),
    ({"text": "Hello"}, "needs 'prompt' or 'prompt_token_ids'"),
    ([1, 49152], r"prompt_token_ids must be integers in \[0, 49152\)"),
    ([1, -1], "prompt_token_ids must be integers"),
    (3.5, "prompt must be a string"),
])
def test_invalid_prompt(llm: LLM, prompt: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(None, prompt, SamplingParams())
    assert_still_serves(llm)


def test_prompt_longer_than_max_model_len(small_kv_llm: LLM) -> None:
    max_len = small_kv_llm.engine.max_model_len
    with pytest.raises(ValueError, match=f"prompt has {max_len} tokens, but max_model_len is {max_len}"):
        small_kv_llm.engine.add_request(None, [42] * max_len)
    with pytest.raises(ValueError, match="prompt 0: .*max_model_len"):
        small_kv_llm.generate("word " * (2 * max_len), use_tqdm=False)
    assert_still_serves(small_kv_llm)


def test_max_tokens_beyond_the_context_is_refused(small_kv_llm: LLM) -> None:
    """As vLLM's server answers (offline too here): max_tokens that cannot fit is an error, not a clamp."""
    max_len = small_kv_llm.engine.max_model_len
    with pytest.raises(ValueError, match=f"max_tokens is 100000000, but the prompt has 10 tokens and max_model_len "
                                         f"is {max_len}: at most {max_len - 10} new tokens fit"):
        small_kv_llm.engine.add_request(None, [42] * 10, SamplingParams(max_tokens=100_000_000))
    out = small_kv_llm.generate({"prompt_token_ids": [42] * 10}, SamplingParams(max_tokens=max_len - 10, temperature=0,
                                                                                ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == max_len - 10 and out.outputs[0].finish_reason == "length"
    assert_still_serves(small_kv_llm)


def test_a_bad_prompt_rejects_its_whole_batch_and_leaks_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["Hello", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert_idle(llm.engine)  # the good prompt, already queued, was withdrawn
    assert_still_serves(llm)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -0.1), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.1), ("top_k", -2), ("top_k", 2.5), ("seed", "42"), ("min_tokens", -1),
    ("logprobs", 21), ("logprobs", -1), ("stop", ""), ("stop", 3), ("stop", ["ok", 3]), ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]), ("stop_token_ids", 5),
])
def test_invalid_sampling_params(llm: LLM, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})
    assert_still_serves(llm)


def test_min_tokens_above_max_tokens_is_invalid() -> None:
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_engine_rejects_n_above_one_and_a_duplicate_request_id(llm: LLM) -> None:
    with pytest.raises(ValueError, match="n > 1"):
        llm.engine.add_request(None, "Hello", SamplingParams(n=2))
    llm.engine.add_request("twice", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'twice' is already in use"):
        llm.engine.add_request("twice", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.engine.add_request(None, "Hello", SamplingParams(), priority="high")
    llm.engine.abort_request("twice")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert_still_serves(llm)


@pytest.mark.parametrize("engine_args, message", [
    ({"block_size": 0}, "block_size must be an integer >= 1"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory: cannot parse size"),
    ({"scheduling_policy": "random"}, "scheduling_policy must be one of"),
])
def test_invalid_engine_config(engine_args: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(**engine_args)


def test_model_path_that_does_not_exist(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="without config.json"):
        LLM(model=str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither a .gguf file nor a checkpoint directory"):
        LLM(model=str(tmp_path / "weights.bin"))
    assert_still_serves(llm)


def test_gguf_of_an_unsupported_architecture(llm: LLM, tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        LLM(model=str(path))
    assert_still_serves(llm)


def test_checkpoint_directory_of_an_unsupported_architecture(llm: LLM, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 8}))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        LLM(model=str(tmp_path))
    assert_still_serves(llm)
