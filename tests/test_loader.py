"""Checkpoint loading against transformers: GGUF dequantization and Llama's Q/K row order, Hugging
Face checkpoint directories, and the Llama-family configs (Llama, Mistral, Qwen2, Qwen3's q/k norm,
llama3 RoPE scaling) on tiny random models."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.decoder import rope_inv_freq
from minivllm.model.loader import load_checkpoint
from tests.helpers import (EQUALITY_PROMPTS, LLAMA3_ROPE, LONG_PROMPT, TINY_HEADS, TINY_HIDDEN, TINY_KV_HEADS,
                           assert_match_hf, encode_matrix, greedy, hf_from_gguf, save_tiny_model, tiny_config,
                           tiny_head_dim, write_tiny_gguf)


# -- GGUF ------------------------------------------------------------------------------------------
def test_default_gguf_weights_equal_transformers(default_model_path: Path, hf_model: Any) -> None:
    import gguf

    from minivllm.model.gguf_file import GGUFFile

    types = {gguf.GGMLQuantizationType(t.type).name for t in GGUFFile(default_model_path).tensors}
    assert {"Q4_1", "Q8_0", "F32"} <= types
    reference = hf_model.state_dict()
    _, weights = load_checkpoint(default_model_path)
    names = set()
    for name, tensor in weights:
        assert torch.equal(tensor, reference[name]), name
        names.add(name)
    assert names == set(reference) - {"lm_head.weight"}  # tied to the embeddings


QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS"]

@pytest.mark.parametrize("arch, qtype", [("llama", q) for q in QUANT_TYPES] + [("qwen2", "Q8_0"), ("qwen3", "Q4_K")])
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str, qtype: str) -> None:
    """What the file encodes comes back, in HF layout (Llama's Q/K rows un-permuted), and equals
    what transformers reads from the same file."""
    path = tmp_path / "tiny.gguf"
    encoded = write_tiny_gguf(path, arch, qtype)
    config, weights = load_checkpoint(path)
    ours = dict(weights)
    theirs = hf_from_gguf(path).state_dict()
    assert set(ours) == set(encoded)
    for name, expected in encoded.items():
        assert torch.equal(ours[name], torch.from_numpy(expected)), name
        assert torch.equal(ours[name], theirs[name]), name
    assert (config.architecture, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (arch, TINY_HEADS, TINY_KV_HEADS, tiny_head_dim(arch))
    assert not config.tie_word_embeddings
    assert config.attention_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_gguf_decoding_is_bit_identical_to_the_gguf_package(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch decoders against the gguf package's numpy code, over many chunks (the last one
    short), into float32 and straight into bfloat16."""
    import gguf

    from minivllm.model import gguf_quants

    monkeypatch.setattr(gguf_quants, "CHUNK_ELEMENTS", 3000)
    kind = gguf.GGMLQuantizationType[qtype]
    data = encode_matrix(np.random.default_rng(0), 24, 1024, kind)
    expected = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, kind), dtype=np.float32))
    raw = torch.from_numpy(data.reshape(-1).view(np.uint8))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(gguf_quants.dequantize(raw, int(kind), (24, 1024), dtype), expected.to(dtype))


def test_gguf_llama3_rope_freqs_scale_like_transformers(tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    def hf_inv_freq(rope_scaling: dict | None) -> torch.Tensor:
        config = LlamaConfig(hidden_size=TINY_HIDDEN, num_attention_heads=TINY_HEADS, rope_scaling=rope_scaling)
        return LlamaRotaryEmbedding(config).inv_freq

    scaled = hf_inv_freq(LLAMA3_ROPE)
    factors = hf_inv_freq(None) / scaled
    assert (factors > 1).any() and (factors == 1).any()  # low frequencies stretched, high ones kept
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, rope_freqs=factors.numpy())
    config, _ = load_checkpoint(path)
    torch.testing.assert_close(rope_inv_freq(config), scaled)


# -- Hugging Face checkpoint directories -----------------------------------------------------------
@pytest.fixture(scope="module")
def hf_checkpoint_dir(hf_model: Any, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model as transformers holds it, saved as safetensors with its tokenizer."""
    from transformers import AutoModelForCausalLM

    # transformers refuses to save a model it loaded from GGUF ("quantized with gguf"): save the
    # same weights through a plain model of the same config.
    config = copy.deepcopy(hf_model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict())
    plain.generation_config = hf_model.generation_config
    path = tmp_path_factory.mktemp("smollm2-hf")
    plain.save_pretrained(path)
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    return path


def test_hf_checkpoint_directory_matches_transformers(hf_checkpoint_dir: Path, hf_greedy) -> None:
    assert list(hf_checkpoint_dir.glob("*.safetensors"))
    llm = LLM(model=str(hf_checkpoint_dir), dtype="float32", num_kv_blocks=64)
    assert llm.engine.model_config.tie_word_embeddings and llm.engine.tokenizer.eos_token_ids == [2]
    outputs = llm.generate(EQUALITY_PROMPTS, greedy(), use_tqdm=False)
    assert_match_hf(outputs, hf_greedy)


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"])
def test_tiny_random_model_matches_transformers(kind: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    model = save_tiny_model(tiny_config(kind), tmp_path, tokenizer_dir)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=32)
    torch.testing.assert_close(rope_inv_freq(llm.engine.model_config), model.model.rotary_emb.inv_freq)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    for out in llm.generate([EQUALITY_PROMPTS[1], LONG_PROMPT], params, use_tqdm=False):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        start = len(out.prompt_token_ids) - 1
        for step, (token, ours) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            reference = logprobs[start + step]
            assert reference.max() - reference[token] < 1e-4, f"step {step}: not the greedy token"
            for token_id, value in ours.items():
                assert abs(reference[token_id].item() - value) < 1e-4, f"step {step}, token {token_id}"
            torch.testing.assert_close(torch.tensor(sorted(ours.values(), reverse=True)[:5]),
                                       reference.topk(5).values, atol=1e-4, rtol=0)


def test_transformers_v4_config_reads_like_v5(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Checkpoints on the hub mostly carry v4 configs: `rope_theta` and `rope_scaling` at the top."""
    save_tiny_model(tiny_config("llama3-rope"), tmp_path, tokenizer_dir)
    v5_config, _ = load_checkpoint(tmp_path)
    config_path = tmp_path / "config.json"
    cfg = json.loads(config_path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    config_path.write_text(json.dumps(cfg))
    v4_config, _ = load_checkpoint(tmp_path)
    assert v4_config.rope_theta == v5_config.rope_theta == 10000.0
    assert v4_config.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(rope_inv_freq(v4_config), rope_inv_freq(v5_config))
