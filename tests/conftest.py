"""Fixtures that load the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) once per engine
configuration, and the Hugging Face transformers reference on the same weights once per session.

Nothing heavy is imported at module level: the scheduler's tests run without torch.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# `make test` runs two files at a time (pytest-xdist's --dist loadfile, one thread each): the longest files
# go first, so that no worker is left with one of them at the end while the other has nothing to run.
LONGEST_FILES = ["test_real_gguf.py", "test_ray.py", "test_bench.py", "test_spec_decode.py", "test_simulate.py",
                 "test_batch_invariance.py", "test_moe.py", "test_hf_equality.py", "test_server.py", "test_router.py",
                 "test_tensor_parallel.py", "test_scheduler_real.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


def _load(**engine_args: Any) -> Any:
    from minivllm import LLM

    # float32 and dequantized: the reference comparisons need it (the HF reference runs the dequantized
    # weights in float32); the quantized path has its own tests (test_quant.py).
    return LLM(dtype="float32", quantization="none", **engine_args)


def _checked(llm: Any) -> Iterator[Any]:
    """Hand a shared engine to one test, then make sure the test left it idle with no block leaked."""
    from tests.helpers import assert_idle, drain

    yield llm
    left_running = llm.engine.has_unfinished_requests()
    drain(llm.engine)  # so that one failing test does not fail the next ones
    assert not left_running, "the test left requests unfinished"
    assert_idle(llm.engine)


def _cpu_targets() -> list[str]:
    from tests.helpers import cpu_targets

    return cpu_targets()


@pytest.fixture(params=_cpu_targets())
def cpu_target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each -march target whose kernels this machine runs (helpers.cpu_targets), as MINIVLLM_CPU_ARCH: the
    kernel getters build and load that target's library."""
    monkeypatch.setenv("MINIVLLM_CPU_ARCH", request.param)
    return request.param


@pytest.fixture(scope="session")
def _default_llm() -> Any:
    return _load(num_kv_blocks=256)


@pytest.fixture(scope="session")
def _small_kv_llm() -> Any:
    # 24 blocks of 16 tokens: the long prompt and its output need 15, so concurrent requests must preempt.
    return _load(num_kv_blocks=24, max_model_len=320)


@pytest.fixture(scope="session")
def _small_budget_llm() -> Any:
    # 32 tokens per step: prompts are chunked and wait for each other's prefills.
    return _load(num_kv_blocks=256, max_num_batched_tokens=32)


@pytest.fixture
def llm(_default_llm: Any) -> Iterator[Any]:
    yield from _checked(_default_llm)


@pytest.fixture
def small_kv_llm(_small_kv_llm: Any) -> Iterator[Any]:
    yield from _checked(_small_kv_llm)


@pytest.fixture
def small_budget_llm(_small_budget_llm: Any) -> Iterator[Any]:
    yield from _checked(_small_budget_llm)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from minivllm.model.loader import default_model_path

    return Path(default_model_path())


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path) -> Any:
    """transformers' own model on the same GGUF, dequantized by transformers, in float32."""
    from tests.helpers import hf_from_gguf

    return hf_from_gguf(default_model_path)


@pytest.fixture(scope="session")
def hf_greedy(hf_model: Any) -> Any:
    """HF `generate`'s greedy continuations of tokenized prompts, each computed once per session."""
    from tests.helpers import HFGreedy

    return HFGreedy(hf_model)


@pytest.fixture(scope="session")
def tokenizer_dir(_default_llm: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer saved as Hugging Face files, for checkpoints built by the tests."""
    path = tmp_path_factory.mktemp("tokenizer")
    _default_llm.get_tokenizer().save_pretrained(path)
    return path
