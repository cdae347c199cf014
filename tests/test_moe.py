"""Mixtures of experts (model/moe.py, decoder.SparseMoE), one tiny random checkpoint per family that
transformers creates from the family's own config class (helpers.tiny_config): 2 of 4 experts per
token over 3 layers; Qwen3-MoE renormalizes the top-k weights and has a dense layer between sparse
ones, OLMoE does not renormalize and norms q and k over the whole projection with clip_qkv, Qwen2-MoE
has its gated shared expert, Mixtral a sliding window, Granite-MoE its multipliers and top-k softmax,
gpt-oss its sinks, biases, YaRN, alternating sliding layers and clamped SwiGLU (and its experts in MXFP4,
from the checkpoint's blocks and from llama.cpp's GGUF of them).

For each: float32 greedy tokens equal transformers', from the HF directory and from llama.cpp's GGUF
(float32; and Q8_0 with its expert blocks kept, against transformers reading the same file, for the
families transformers reads), on the native kernels and on the torch twins; bf16 tokens the same alone
and in a chunked, speculative crowd; a wrong routing breaks the equality; bad checkpoints are refused
naming the key or the tensor.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from minivllm.cli import main
from minivllm.bench.latency import weight_bytes_held
from minivllm.model import build, gguf_reader, registry
from minivllm.model.build import build_model
from minivllm.model.decoder import SparseMoE
from minivllm.model.gguf_file import GGUFFile
from minivllm.model.loader import weight_bytes
from minivllm.server.metrics import ServerMetrics
from minivllm.spec_decode.extension import SpeculativeDecoding, StepCostModel
from tests.helpers import (FAMILY_NEW_TOKENS, GPT_OSS_YARN, HFGreedy, assert_family_matches, family_engine, family_prompts, greedy,
                           layer_loop_outputs, save_tiny_model, tiny_config)
from tests.llama_cpp import convert_hf_many

FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "granitemoe", "gpt_oss"]
# What llama.cpp's converter does not carry (nor llama.cpp run): those families' GGUFs are made from the
# same config without it.
GGUF_WITHOUT = {"qwen3_moe": {"mlp_only_layers": []}, "olmoe": {"clip_qkv": None}, "mixtral": {"sliding_window": None},
                "gpt_oss": {"rope_parameters": {**GPT_OSS_YARN, "truncate": True}}}  # llama.cpp's YaRN truncates
Q8_FAMILIES = ["qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def checkpoints(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, HFGreedy]]:
    """family -> (HF directory, transformers' greedy continuations on it)."""
    made = {}
    for kind in FAMILIES:
        path = tmp_path_factory.mktemp(kind)
        made[kind] = (path, HFGreedy(save_tiny_model(tiny_config(kind), path, tokenizer_dir)))
    return made


@pytest.fixture(scope="module")
def ggufs(checkpoints: dict, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, tuple[Path, HFGreedy]]:
    """family (and "family-q8_0") -> (llama.cpp's GGUF, transformers' greedy continuations on its weights)."""
    made, sources = {}, {}
    for kind in FAMILIES:
        source, reference = checkpoints[kind]
        if kind in GGUF_WITHOUT:
            config = tiny_config(kind)
            config = type(config).from_dict({**config.to_dict(), **GGUF_WITHOUT[kind]})
            source = tmp_path_factory.mktemp(f"{kind}-gguf")
            reference = HFGreedy(save_tiny_model(config, source, tokenizer_dir))
        sources[kind] = source
        made[kind] = (source / "model-f32.gguf", reference)
    quantized = {k: sources[k] / "model-q8_0.gguf" for k in Q8_FAMILIES}
    convert_hf_many([(sources[k], made[k][0], "f32") for k in FAMILIES] +
                    [(sources[k], quantized[k], "q8_0") for k in Q8_FAMILIES])
    made.update({f"{k}-q8_0": (path, HFGreedy(_on_gguf_weights(sources[k], path))) for k, path in quantized.items()})
    return made


# A Qwen MoE GGUF's tensors as transformers 5 holds them (the experts stacked, gate rows before up rows).
_HF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate",
             "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _on_gguf_weights(directory: Path, path: Path):
    """transformers' model of `directory` holding the GGUF's weights, decoded by gguf-py (transformers'
    own GGUF reader assumes the released models' expert widths)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    state, experts_gate = {}, {}
    file = GGUFFile(path)  # gguf-py's own reader parses the vocabulary element by element: seconds
    for t in file.tensors:
        raw = file.raw(t).numpy().reshape(*t.shape[:-1], -1)
        value = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.type)).copy())
        base, suffix = t.name.rsplit(".", 1)
        parts = base.split(".")
        if parts[0] != "blk":
            state[f"{_TOP_NAMES[base]}.{suffix}"] = value
            continue
        layer = f"model.layers.{parts[1]}"
        if parts[2] in ("ffn_gate_exps", "ffn_up_exps"):
            experts_gate.setdefault(layer, {})[parts[2]] = value
        else:
            state[f"{layer}.{_HF_NAMES[parts[2]]}" + ("" if parts[2] == "ffn_down_exps" else f".{suffix}")] = value
    for layer, pieces in experts_gate.items():
        state[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([pieces["ffn_gate_exps"], pieces["ffn_up_exps"]], dim=1)
    own = model.state_dict()
    state = {name: value.reshape(own[name].shape) for name, value in state.items()}
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert missing == [] or missing == ["lm_head.weight"] and model.config.tie_word_embeddings, missing
    return model


@pytest.mark.parametrize("kind", FAMILIES)
def test_hf_directory_matches_transformers(kind: str, checkpoints: dict) -> None:
    path, reference = checkpoints[kind]
    llm = family_engine(path)
    config = llm.engine.model_config
    assert config.num_experts == 4 and config.num_experts_per_tok == 2
    assert config.dense_layers == ([1] if kind == "qwen3_moe" else [])
    assert llm.engine.runner.batch_invariant  # the experts on the native kernels
    # forward.c's layer loop, csrc/moe.c in it; the tiny OLMoE's clamped q, k and v keep the Python loop
    assert (llm.engine.runner.model.native_forward is None) == (kind == "olmoe")
    assert_family_matches(llm, reference)
    # The routing skew: each sparse layer sent each token to 2 experts (a prompt shorter than a block:
    # nothing from the cache), as the engine's stats and /metrics count it.
    before = llm.engine.get_stats()["moe_expert_tokens"]
    short = family_prompts(llm)[0]
    llm.generate([{"prompt_token_ids": short}], greedy(FAMILY_NEW_TOKENS), use_tqdm=False)
    after = llm.engine.get_stats()["moe_expert_tokens"]
    assert [len(counts) for counts in after] == [0 if i in config.dense_layers else 4 for i in range(3)]
    routed = [sum(b) - sum(a) for a, b in zip(before, after)]
    assert routed == [0 if i in config.dense_layers else 2 * (len(short) + FAMILY_NEW_TOKENS - 1) for i in range(3)]
    text = ServerMetrics("tiny", llm.engine.get_stats).render()[0].decode()
    series = re.findall(r'^minivllm:moe_expert_tokens_total\{expert="(\d)",layer="(\d)",model_name="tiny"\} (\S+)$',
                        text, re.MULTILINE)
    assert sorted((int(layer), int(expert), float(n)) for expert, layer, n in series) == sorted(
        (layer, expert, float(n)) for layer, counts in enumerate(after) for expert, n in enumerate(counts))


def test_bench_latency_reports_the_routing_skew(checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    main(["bench", "latency", "--model", str(checkpoints["olmoe"][0]), "--dtype", "float32", "--batch-size", "2",
          "--input-len", "12", "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1",
          "--output-json", str(out)])
    load = json.loads(out.read_text())["result"]["expert_load"]
    # Two measured iterations of 2 sequences x (12 prompt tokens + 3 decoded), 2 experts each, per layer.
    assert [sum(counts) for counts in load] == [2 * 2 * (12 + 3) * 2] * 3


@pytest.mark.parametrize("kind", FAMILIES)
def test_gguf_matches_transformers(kind: str, ggufs: dict) -> None:
    path, reference = ggufs[kind]
    llm = family_engine(path, tokenizer=str(path.parent))  # the same vocabulary, not converted from the file
    assert llm.engine.model_config.architecture == ("llama" if kind == "mixtral" else registry.hf_family(
        json.loads((path.parent / "config.json").read_text())["architectures"], "").name)  # llama.cpp: Mixtral is llama
    assert_family_matches(llm, reference)


@pytest.mark.parametrize("kind", Q8_FAMILIES)
def test_q8_0_experts(kind: str, ggufs: dict) -> None:
    """Decoded from the file's blocks at load, the tokens equal transformers' on the same weights; kept as
    blocks (the default), every expert runs the quantized kernels, and a token's bf16 experts give the
    same tokens alone and in a crowd."""
    path, reference = ggufs[f"{kind}-q8_0"]
    assert_family_matches(family_engine(path, quantization="none", tokenizer=str(path.parent)), reference)
    llm = family_engine(path, "bfloat16", tokenizer=str(path.parent))
    moe = next(layer.mlp for layer in llm.engine.runner.model.layers if isinstance(layer.mlp, SparseMoE))
    assert all(e.gate_up_proj.quantized is not None and e.down_proj.quantized is not None for e in moe.experts)
    assert llm.engine.runner.batch_invariant
    assert weight_bytes_held(llm.engine.runner.model) <= 1.05 * path.stat().st_size
    prompts = family_prompts(llm)
    alone = llm.generate([{"prompt_token_ids": prompts[1]}], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([{"prompt_token_ids": p} for p in [prompts[0], prompts[1], prompts[1][:50]]], greedy(8),
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("kind", ["olmoe", "qwen2_moe", "gpt_oss"])
def test_torch_twins_match_transformers(kind: str, checkpoints: dict) -> None:
    """The torch path (MINIVLLM_NO_KERNELS, CUDA): projection q/k norms and clip, the shared expert,
    sinks and the clamped SwiGLU."""
    path, reference = checkpoints[kind]
    llm = family_engine(path)
    runner = llm.engine.runner
    kernel, runner.attention_kernel = runner.attention_kernel, None
    runner.model.use_native_kernels(False)
    try:
        assert not runner.batch_invariant
        assert_family_matches(llm, reference)
    finally:
        runner.attention_kernel = kernel
        runner.model.use_native_kernels(True)


@torch.inference_mode()
def test_expert_kernel_against_its_torch_twin(checkpoints: dict) -> None:
    """csrc/moe.c (router, grouped experts, weighted sum, the shared expert) against moe.py's torch code
    on the same layer: float32 outputs within rounding, the same routing counts; and a token's row the
    same bits alone as beside others (bf16)."""
    llm = family_engine(checkpoints["qwen2_moe"][0])
    moe = next(layer.mlp for layer in llm.engine.runner.model.layers if isinstance(layer.mlp, SparseMoE))
    native, x = moe.native, torch.randn(9, moe.gate.in_features, generator=torch.Generator().manual_seed(0))
    assert native is not None and moe.shared_expert is not None
    before = moe.expert_load.clone()
    out = moe(x)
    counted = moe.expert_load - before
    moe.native = None
    try:
        twin = moe(x)
    finally:
        moe.native = native
    assert torch.allclose(out, twin, rtol=1e-4, atol=1e-5) and torch.equal(moe.expert_load - before, 2 * counted)
    bf16 = family_engine(checkpoints["qwen2_moe"][0], "bfloat16").engine.runner.model
    moe = next(layer.mlp for layer in bf16.layers if isinstance(layer.mlp, SparseMoE))
    x = x.bfloat16()
    assert all(torch.equal(moe(x[t:t + 1])[0], row) for t, row in enumerate(moe(x)))


# a shared expert; a dense layer among sparse ones; sinks, biases and the clamped SwiGLU; OLMoE's q/k
# norms over the whole projection (its GGUF: no clip_qkv, which keeps the Python loop)
@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe", "gpt_oss", "olmoe"])
def test_native_layer_loop_equals_python_loop(kind: str, checkpoints: dict, ggufs: dict) -> None:
    llm = family_engine((ggufs if kind == "olmoe" else checkpoints)[kind][0], "bfloat16")
    assert llm.engine.runner.model.native_forward is not None
    prompts = [{"prompt_token_ids": p} for p in family_prompts(llm)]
    assert layer_loop_outputs(llm, True, prompts=prompts) == layer_loop_outputs(llm, False, prompts=prompts)


class FlatStepCost(StepCostModel):
    """A step that costs the same whatever its tokens (a GPU's at these sizes): drafting pays at any batch
    size and acceptance, so the crowd below verifies drafts however the random model guesses."""

    knee = 4096.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_bf16_same_tokens_alone_and_in_a_speculative_crowd(kind: str, checkpoints: dict) -> None:
    """A token's experts' outputs never depend on which other tokens share the step or chose the same
    experts: the same bf16 tokens alone (one prefill, then decodes) and in a crowd whose prefills run in
    16-token chunks beside decodes and verifies (suffix decoding drafts the probe's continuation from
    its first run, so its tokens come out of verify steps)."""
    path = checkpoints[kind][0]
    alone_llm = family_engine(path, "bfloat16", max_num_batched_tokens=256, enable_prefix_caching=False)
    probe = family_prompts(alone_llm)[1]
    params = greedy(16)
    alone = alone_llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd_llm = family_engine(path, "bfloat16", speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    crowd_llm.engine.extension(SpeculativeDecoding).step_cost = FlatStepCost()
    first = crowd_llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [probe[:7], probe[:40], probe, probe[:7] * 3, probe[10:]]
    together = crowd_llm.generate([{"prompt_token_ids": p} for p in crowd], params, use_tqdm=False)
    assert first == together[2].outputs[0].token_ids == alone
    assert crowd_llm.engine.stats["spec_decode_num_accepted_tokens"] > 0  # verify steps ran and kept drafts


def test_wrong_routing_breaks_equality(checkpoints: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """OLMoE's top-k weights renormalized (as Qwen3-MoE's are): the tokens leave transformers'."""
    path, reference = checkpoints["olmoe"]
    olmoe = registry.family("olmoe")
    wrong = dataclasses.replace(olmoe, switches={**olmoe.switches, "norm_topk_prob": True},
                                hf_switches=lambda cfg: {k: v for k, v in olmoe.hf_switches(cfg).items()
                                                         if k != "norm_topk_prob"})
    monkeypatch.setitem(registry._BY_HF, "OlmoeForCausalLM", wrong)
    monkeypatch.setitem(registry._BY_NAME, "olmoe", wrong)
    build_model.cache_clear()
    try:
        llm = family_engine(path)
        assert llm.engine.model_config.norm_topk_prob
        prompts = family_prompts(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(FAMILY_NEW_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] != reference.many(prompts, FAMILY_NEW_TOKENS)
    finally:
        build_model.cache_clear()


def _edited_copy(source: Path, target: Path, **config: object) -> Path:
    shutil.copytree(source, target, dirs_exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, **config}))
    return target


def test_bad_checkpoints_are_refused_naming_what(checkpoints: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source = checkpoints["qwen2_moe"][0]
    with pytest.raises(ValueError, match=r"num_experts_per_tok is 5: a token must use between 1 and num_experts \(4\)"):
        family_engine(_edited_copy(source, tmp_path / "topk", num_experts_per_tok=5))
    with pytest.raises(ValueError, match=r"weight layers\.0\.mlp\.gate\.weight: checkpoint shape \(4, 64\) != model \(5, 64\)"):
        family_engine(_edited_copy(source, tmp_path / "more", num_experts=5))
    cut = _edited_copy(source, tmp_path / "cut")
    weights = load_file(cut / "model.safetensors")
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    weights[name] = weights[name][:, :16].contiguous()
    save_file(weights, cut / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts\.3\.down_proj\.weight: checkpoint shape \(64, 16\)"):
        family_engine(cut)
    keys = {"expert_count": 4, "expert_used_count": 2, "expert_gating_func": 2}
    with pytest.raises(ValueError, match=r"m\.gguf: expert_gating_func 2 is not a routing minivllm runs"):
        gguf_reader._moe_fields(lambda key, default=None: keys.get(key, default), {}, 3, "m.gguf")


def test_what_does_not_fit_in_memory_is_refused_at_start(checkpoints: dict, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights, then the KV pool, larger than the memory available: refused before they are read or
    allocated, with both figures."""
    path = _edited_copy(checkpoints["qwen2_moe"][0], tmp_path / "copy")  # not a model this process holds
    needed = weight_bytes(path, torch.float32, "none")
    monkeypatch.setattr(build, "available_memory", lambda: needed - 1)
    with pytest.raises(ValueError, match=rf"the weights of copy need {build.readable_size(needed)} of memory, but "
                                         rf"{build.readable_size(needed - 1)} is available"):
        family_engine(path)
    left = iter([needed, 2**19])  # what is available before the weights, then after them
    monkeypatch.setattr(build, "available_memory", lambda: next(left))
    with pytest.raises(ValueError, match=r"the KV pool \(64 blocks: --kv-cache-memory or --num-kv-blocks\) need "
                                         r"0\.8 MiB of memory, but 0\.5 MiB is available"):
        family_engine(path, num_kv_blocks=64)  # 64 blocks x 16 tokens x 3 layers x K and V x 2 heads x 16 x 4 B: 768 KiB


# -- gpt-oss in MXFP4: its Hugging Face checkpoint's _blocks/_scales and llama.cpp's GGUF of it ---------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[experts, in, out] (transformers' x @ W) -> OpenAI's MXFP4 (blocks [experts, out, in / 32, 16], scales
    [experts, out, in / 32]: 2^(scale - 127) times E2M1, weights 2j and 2j + 1 in byte j's low and high
    nibbles) and the weights they hold, [experts, in, out]."""
    x = w.transpose(1, 2).reshape(*w.shape[:1], w.shape[2], -1, 32)
    exponent = torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True) / 6)).clamp(-20, 20)
    y = x / torch.exp2(exponent)
    index = (y.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = (index | ((y < 0).long() << 3)).to(torch.uint8)
    held = torch.where(y < 0, -E2M1[index], E2M1[index]) * torch.exp2(exponent)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8), held.reshape(x.shape[:2] + (-1,)).transpose(1, 2)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, HFGreedy]]:
    """"hf": a gpt-oss directory whose experts are MXFP4 blocks and scales, as OpenAI's checkpoints hold
    them; "gguf": llama.cpp's converter's file of it (the blocks repacked, not requantized). Each with
    transformers' greedy continuations on the weights the blocks hold. The config's YaRN truncated, as
    llama.cpp computes it."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = tiny_config("gpt_oss")
    config = type(config).from_dict({**config.to_dict(), **GGUF_WITHOUT["gpt_oss"]})
    reference_dir, mxfp4_dir = tmp_path_factory.mktemp("gpt-oss-ref"), tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model = save_tiny_model(config, reference_dir, tokenizer_dir)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    quantized = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, held = _to_mxfp4(state[name])
        assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), held)  # transformers' reading
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        state[name] = held
    model.load_state_dict(state)
    model.save_pretrained(reference_dir)
    shutil.copytree(reference_dir, mxfp4_dir, dirs_exist_ok=True)
    weights = {n: t for n, t in _all_tensors(reference_dir).items() if n + "_blocks" not in quantized}
    save_file({**weights, **quantized}, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((mxfp4_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mxfp4_dir / "config.json").write_text(json.dumps(cfg))
    reference = HFGreedy(model)
    convert_hf_many([(mxfp4_dir, mxfp4_dir / "model-mxfp4.gguf", "f32")])
    return {"hf": (mxfp4_dir, reference), "gguf": (mxfp4_dir / "model-mxfp4.gguf", reference)}


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_mxfp4_experts(source: str, gpt_oss_mxfp4: dict) -> None:
    """Decoded at load, float32 tokens equal transformers' on the weights the blocks hold; kept as blocks
    (the default on the CPU), every expert runs the MXFP4 kernel within 1.05x of the file's bytes, and a
    token's bf16 tokens are the same alone and in a crowd."""
    path, reference = gpt_oss_mxfp4[source]
    tokenizer = {"tokenizer": str(path.parent)} if source == "gguf" else {}
    assert_family_matches(family_engine(path, quantization="none", **tokenizer), reference)
    llm = family_engine(path, "bfloat16", **tokenizer)
    moe = next(layer.mlp for layer in llm.engine.runner.model.layers if isinstance(layer.mlp, SparseMoE))
    assert all(s.qtype == 39 for e in moe.experts for m in (e.gate_up_proj, e.down_proj) for s in m.quantized.segments)
    assert llm.engine.runner.batch_invariant and llm.engine.runner.model.native_forward is not None
    experts = [m.quantized for layer in llm.engine.runner.model.layers for m in layer.mlp.modules()
               if getattr(m, "quantized", None) is not None]
    expert_file_bytes = sum(t.numel() for n, t in _mxfp4_tensors(gpt_oss_mxfp4["hf"][0]).items())
    assert sum(w.nbytes for w in experts) <= 1.05 * expert_file_bytes
    prompts = family_prompts(llm)
    alone = llm.generate([{"prompt_token_ids": prompts[1]}], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate([{"prompt_token_ids": p} for p in [prompts[0], prompts[1], prompts[1][:50]]], greedy(8),
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


def _mxfp4_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {n: t for n, t in _all_tensors(directory).items() if n.endswith(("_blocks", "_scales"))}


def test_bad_mxfp4_tensors_are_refused_naming_them(gpt_oss_mxfp4: dict, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    source = gpt_oss_mxfp4["hf"][0]
    name = "model.layers.1.mlp.experts.down_proj"
    for label, edit, message in [
            ("lost", lambda w: w.pop(f"{name}_scales"), rf"{name}_blocks has no {name}_scales beside it"),
            ("cut", lambda w: w.update({f"{name}_blocks": w[f"{name}_blocks"][..., :8].contiguous()}),
             rf"MXFP4 tensor {name}_blocks has shape \(4, 64, 1, 8\)")]:
        copy = _edited_copy(source, tmp_path / label)
        weights = _all_tensors(source)
        edit(weights)
        save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            family_engine(copy)


def _all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")
