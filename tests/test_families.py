"""Every model family the registry knows (model/registry.py), on a tiny random checkpoint that
transformers creates from the family's own config class with its switches on (helpers.tiny_config:
sliding windows shorter than the long prompt, softcaps that bind, partial rotary and longrope, NoPE
layers, Granite's multipliers), saved, and converted to GGUF by llama.cpp's own converter.

For each: float32 greedy tokens equal transformers', from the HF directory and from the GGUF file, with
chunked prefill and prefix caching on (the long prompt runs twice: the second time from the cache);
the switches read from the GGUF equal those read from config.json; bf16 reproducible alone and in a
crowd; and a wrong switch (Gemma's +1 applied twice) breaks the equality, so these tests can fail.
The tokenizers are the default model's, but Gemma 2's: its converter wants a SentencePiece
tokenizer.model, trained here on the test prompts (helpers.sentencepiece_tokenizer).
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

from minivllm.model import registry
from minivllm.model.gguf_file import GGUFFile
from minivllm.model.build import build_model
from minivllm.model.hf_reader import read_hf_config
from minivllm.model.loader import load_checkpoint
from minivllm.model.model_config import ModelConfig
from minivllm.model.tokenizer import get_tokenizer
from tests.helpers import (EQUALITY_PROMPTS, GEMMA_SPECIAL_IDS, FAMILY_NEW_TOKENS, HFGreedy, assert_family_matches,
                           family_engine, family_prompts, greedy, mismatch_report, save_tiny_model,
                           sentencepiece_tokenizer, tiny_config)
from tests.llama_cpp import convert_hf_many

FAMILIES = ["llama3.2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "granite"]


@pytest.fixture(scope="module")
def checkpoints(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, HFGreedy]]:
    """family -> (HF directory, transformers' greedy continuations on it), each made once per module."""
    made = {}
    sentencepiece_dir = sentencepiece_tokenizer(tmp_path_factory.mktemp("sentencepiece"))
    for kind in FAMILIES:
        path = tmp_path_factory.mktemp(kind)
        tokenizer = sentencepiece_dir if kind == "gemma2" else tokenizer_dir
        made[kind] = (path, HFGreedy(save_tiny_model(tiny_config(kind), path, tokenizer)))
    # Phi-4-mini's tokenizer is GPT-2's, which llama.cpp's converter takes from the class name.
    config_file = made["phi3"][0] / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return made


def _gguf(checkpoints: dict, kind: str) -> Path:
    """The family's GGUF (float32), converted with every other family's on first use: one converter process."""
    out = {k: path.parent / f"{k}.gguf" for k, (path, _) in checkpoints.items()}
    missing = [(checkpoints[k][0], out[k]) for k in checkpoints if not out[k].exists()]
    if missing:
        convert_hf_many(missing, "f32")
    return out[kind]


@pytest.mark.parametrize("kind, fmt", [(k, f) for k in FAMILIES for f in ("hf", "gguf")])
def test_greedy_matches_transformers(kind: str, fmt: str, checkpoints: dict) -> None:
    path, reference = checkpoints[kind]
    llm = family_engine(path if fmt == "hf" else _gguf(checkpoints, kind))
    assert llm.engine.model_config.architecture == kind.split(".")[0].removesuffix("3.2").replace("llama3", "llama")
    assert llm.engine.runner.batch_invariant  # every switch runs on the native kernels
    assert_family_matches(llm, reference)


def _switches(config: ModelConfig) -> tuple[list, dict]:
    """What the decoder does with a config: per layer its window and rotary table, and the scalars."""
    layers = range(config.num_hidden_layers)
    per_layer = [(config.layer_window(i), config.layer_rope(i)) for i in layers]
    names = ("scale", "rope_theta", "local_rope_theta", "rotary_size", "attn_logit_softcap", "final_logit_softcap",
             "embedding_scale", "residual_scale", "logits_divisor", "hidden_act", "qk_norm", "sandwich_norms")
    values = {name: getattr(config, name) for name in names}
    return per_layer, {name: round(v, 6) if isinstance(v, float) else v for name, v in values.items()}  # GGUF: float32


@pytest.mark.parametrize("kind", FAMILIES)
def test_gguf_switches_equal_config_json(kind: str, checkpoints: dict) -> None:
    """llama.cpp's GGUF of each checkpoint, as minivllm reads it (keys, and llama.cpp's own rules where the
    converter writes none), switches the decoder as config.json does: Gemma 3's sliding layers and their
    RoPE base (rope.freq_base_swa), Gemma's query scale, SmolLM3's NoPE layers..."""
    hf_layers, hf_scalars = _switches(load_checkpoint(checkpoints[kind][0])[0])
    gguf_layers, gguf_scalars = _switches(load_checkpoint(_gguf(checkpoints, kind))[0])
    assert gguf_layers == hf_layers
    assert gguf_scalars == hf_scalars


def test_values_the_gguf_cannot_carry(checkpoints: dict) -> None:
    """The tiny checkpoints keep the values llama.cpp assumes (a GGUF has no key for them); others are read
    from config.json, and a 27B Gemma's GGUF gets llama.cpp's query scale, 1/sqrt(hidden / heads)."""
    gemma_dir, smollm_dir = checkpoints["gemma3"][0], checkpoints["smollm3"][0]
    gemma, smollm = (json.loads((d / "config.json").read_text()) for d in (gemma_dir, smollm_dir))
    assert read_hf_config({**gemma, "query_pre_attn_scalar": 144}, None, "gemma3").scale == 144 ** -0.5
    assert read_hf_config({**smollm, "no_rope_layers": [1, 0, 1, 1]}, None, "smollm3").nope_layers == [1]
    for kind in ("gemma2", "gemma3"):
        path = _gguf(checkpoints, kind)
        config, file = load_checkpoint(path)[0], GGUFFile(path)
        big = dataclasses.replace(config, num_hidden_layers=registry.GEMMA_27B_LAYERS[kind])
        switches = registry.family(kind).gguf_switches(big, lambda key, default=None: file.get(f"{kind}.{key}", default))
        assert math.isclose(switches["query_scale"], (config.hidden_size / config.num_attention_heads) ** -0.5)
        assert config.scale == config.head_dim ** -0.5 != switches["query_scale"]


def test_sentencepiece_gguf_tokenizer(checkpoints: dict) -> None:
    """Gemma 2's GGUF holds a SentencePiece vocabulary (tokenizer.ggml.model "llama": pieces, scores, token
    types): minivllm's tokenizer of it encodes and decodes as sentencepiece itself and as transformers'
    tokenizer of the checkpoint directory do, byte fallback (Chinese, an emoji) and whitespace runs included."""
    from sentencepiece import SentencePieceProcessor
    from transformers import AutoTokenizer

    directory, path = checkpoints["gemma2"][0], _gguf(checkpoints, "gemma2")
    assert GGUFFile(path).get("tokenizer.ggml.model") == "llama"
    ours = get_tokenizer(path, load_checkpoint(path)[0])
    hf = AutoTokenizer.from_pretrained(directory)
    sp = SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    bos, eos = GEMMA_SPECIAL_IDS["bos_token_id"], GEMMA_SPECIAL_IDS["eos_token_id"]
    assert ours.eos_token_ids == [eos]
    for text in [*EQUALITY_PROMPTS, "  two  spaces,\ttab\nnew line 12345 \U0001f642"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text) == [bos, *sp.encode(text)], text
        assert ours.decode(ids + [eos]) == hf.decode(ids + [eos], skip_special_tokens=True) == text


@pytest.mark.parametrize("kind", FAMILIES)
def test_bf16_reproducible_alone_and_in_a_crowd(kind: str, checkpoints: dict) -> None:
    llm = family_engine(checkpoints[kind][0], "bfloat16")
    prompts = family_prompts(llm)
    params = greedy(FAMILY_NEW_TOKENS)
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
    path, reference = checkpoints[kind]
    llm = family_engine(path)
    runner, model = llm.engine.runner, llm.engine.runner.model
    kernel = runner.attention_kernel
    runner.attention_kernel = None
    model.use_native_kernels(False)
    try:
        assert not runner.batch_invariant
        assert_family_matches(llm, reference)
    finally:
        runner.attention_kernel = kernel
        model.use_native_kernels(True)


def test_longrope_factors_chosen_per_request_as_transformers_does(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Phi-3's longrope with its threshold at 32 tokens: prompts above it (the long factors at every
    position) and below it, decoding short of it (the short factors), equal transformers' one request at a
    time, as transformers chooses per forward; a shorter prompt after a long one that shares its first
    block does not reuse that block (its K/V took the long factors)."""
    reference = HFGreedy(save_tiny_model(tiny_config("phi3-threshold-32"), tmp_path, tokenizer_dir))
    llm = family_engine(tmp_path)
    ids = family_prompts(llm)[1]
    for prompt in (ids[:50], ids[:24], ids[:20], ids[:80]):
        out = llm.generate([{"prompt_token_ids": prompt}], greedy(FAMILY_NEW_TOKENS), use_tqdm=False)[0]
        expected = reference(prompt, FAMILY_NEW_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{len(prompt)} prompt tokens: " + mismatch_report(
            reference.model, prompt, out.outputs[0].token_ids, expected)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_wrong_switch_breaks_equality(checkpoints: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma's +1 applied twice to the norm weights: the tokens leave transformers'."""
    path, reference = checkpoints["gemma2"]
    gemma2 = registry.family("gemma2")
    wrong = dataclasses.replace(gemma2, hf_norm_offset=2 * gemma2.hf_norm_offset)
    for table in (registry._BY_HF, registry._BY_NAME):
        monkeypatch.setitem(table, "Gemma2ForCausalLM" if table is registry._BY_HF else "gemma2", wrong)
    build_model.cache_clear()
    try:
        llm = family_engine(path)
        prompts = family_prompts(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(FAMILY_NEW_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] != reference.many(prompts, FAMILY_NEW_TOKENS)
    finally:
        build_model.cache_clear()


def test_unknown_architecture_is_refused_naming_it(checkpoints: dict, tmp_path: Path) -> None:
    shutil.copytree(checkpoints["qwen3"][0], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"MambaForCausalLM.*minivllm runs .*Gemma2ForCausalLM"):
        family_engine(tmp_path)
