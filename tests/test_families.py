"""Every model family the registry knows (model/registry.py), on a tiny random checkpoint that
transformers creates from the family's own config class with its switches on (helpers.tiny_config:
sliding windows shorter than the long prompt, softcaps that bind, partial rotary and longrope, NoPE
layers, Granite's multipliers), saved, and converted to GGUF by llama.cpp's own converter.

For each: float32 greedy tokens equal transformers', from the HF directory and from the GGUF file, with
chunked prefill and prefix caching on (the long prompt runs twice: the second time from the cache);
bf16 reproducible alone and in a crowd; and a wrong switch (Gemma's +1 applied twice) breaks the
equality, so these tests can fail.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM
from minivllm.model import registry
from minivllm.model.loading import load_model
from tests.helpers import (LONG_PROMPT, TINY_WINDOW, HFGreedy, greedy, mismatch_report, save_tiny_model,
                           tiny_config)
from tests.llama_cpp import convert_hf

FAMILIES = ["llama3.2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "granite"]
NEW_TOKENS = 8
SHORT_PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def checkpoints(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """family -> (HF directory, transformers' model on it), each made once per module."""
    made = {}
    for kind in FAMILIES:
        path = tmp_path_factory.mktemp(kind)
        made[kind] = (path, save_tiny_model(tiny_config(kind), path, tokenizer_dir))
    # Phi-4-mini's tokenizer is GPT-2's, which llama.cpp's converter takes from the class name.
    config_file = made["phi3"][0] / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return made


def _gguf(checkpoints: dict, kind: str) -> Path:
    path = checkpoints[kind][0]
    out = path.parent / f"{kind}.gguf"
    if not out.exists():
        convert_hf(path, out, "f32")
    return out


def _engine(path: Path, dtype: str = "float32") -> LLM:
    # 16-token chunks: the long prompt's prefill runs in pieces that start inside the window.
    return LLM(model=str(path), dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=16, enable_chunked_prefill=True,
               enable_prefix_caching=True)


def _prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(SHORT_PROMPT), tokenizer.encode(LONG_PROMPT)[:80]]
    assert len(prompts[1]) > 3 * TINY_WINDOW
    return prompts


def _assert_matches_transformers(llm: LLM, hf_model: Any) -> None:
    prompts = _prompts(llm)
    reference = HFGreedy(hf_model)
    # The long prompt twice, one after the other: the second reads its prefix from the cache.
    for batch in (prompts, prompts[1:]):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(NEW_TOKENS), use_tqdm=False)
        for out, expected in zip(outputs, reference.many(batch, NEW_TOKENS)):
            ours = out.outputs[0].token_ids
            assert ours == expected, mismatch_report(hf_model, out.prompt_token_ids, ours, expected)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


# Gemma 2's converter wants a SentencePiece tokenizer.model (not trained here yet): its GGUF is not tested.
@pytest.mark.parametrize("kind, fmt", [(k, f) for k in FAMILIES for f in ("hf", "gguf") if (k, f) != ("gemma2", "gguf")])
def test_greedy_matches_transformers(kind: str, fmt: str, checkpoints: dict) -> None:
    path, hf_model = checkpoints[kind]
    llm = _engine(path if fmt == "hf" else _gguf(checkpoints, kind))
    assert llm.engine.model_config.architecture == kind.split(".")[0].removesuffix("3.2").replace("llama3", "llama")
    assert llm.engine.runner.batch_invariant  # every switch runs on the native kernels
    _assert_matches_transformers(llm, hf_model)


@pytest.mark.parametrize("kind", FAMILIES)
def test_bf16_reproducible_alone_and_in_a_crowd(kind: str, checkpoints: dict) -> None:
    llm = _engine(checkpoints[kind][0], "bfloat16")
    prompts = _prompts(llm)
    params = greedy(NEW_TOKENS)
    alone = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [{"prompt_token_ids": p} for p in [prompts[0], prompts[1], prompts[1][:40], prompts[0] * 3]]
    together = llm.generate(crowd, params, use_tqdm=False)
    assert together[1].outputs[0].token_ids == alone
    model = llm.engine.runner.model  # the Python loop over the same kernels: the same bits as forward.c's
    native, model.native_forward = model.native_forward, None
    try:
        python_loop = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        model.native_forward = native
    assert native is not None and python_loop == alone


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3"])
def test_torch_twins_match_transformers(kind: str, checkpoints: dict) -> None:
    """The torch path (MINIVLLM_NO_KERNELS, CUDA) of the switches: softcaps and windows in attention.py,
    q/k norms, GeGLU, partial rotary."""
    path, hf_model = checkpoints[kind]
    llm = _engine(path)
    runner, model = llm.engine.runner, llm.engine.runner.model
    kernel = runner.attention_kernel
    runner.attention_kernel = None
    model.use_native_kernels(False)
    try:
        assert not runner.batch_invariant
        _assert_matches_transformers(llm, hf_model)
    finally:
        runner.attention_kernel = kernel
        model.use_native_kernels(True)


def test_wrong_switch_breaks_equality(checkpoints: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma's +1 applied twice to the norm weights: the tokens leave transformers'."""
    path, hf_model = checkpoints["gemma2"]
    gemma2 = registry.family("gemma2")
    wrong = dataclasses.replace(gemma2, hf_norm_offset=2 * gemma2.hf_norm_offset)
    for table in (registry._BY_HF, registry._BY_NAME):
        monkeypatch.setitem(table, "Gemma2ForCausalLM" if table is registry._BY_HF else "gemma2", wrong)
    load_model.cache_clear()
    try:
        llm = _engine(path)
        prompts = _prompts(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(NEW_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] != HFGreedy(hf_model).many(prompts, NEW_TOKENS)
    finally:
        load_model.cache_clear()


def test_unknown_architecture_is_refused_naming_it(checkpoints: dict, tmp_path: Path) -> None:
    shutil.copytree(checkpoints["qwen3"][0], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"MambaForCausalLM.*minivllm runs .*Gemma2ForCausalLM"):
        _engine(tmp_path)
