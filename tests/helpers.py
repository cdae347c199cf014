"""Helpers shared by the tests that run the real model (fixtures live in conftest.py)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm import LLM
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.outputs import RequestOutput

NEW_TOKENS = 32


def cpu_targets(vnni: bool = False) -> list[str]:
    """The -march targets (MINIVLLM_CPU_ARCH) whose kernels this machine runs: its own ("native") and, on
    an x86 CPU with AVX2, FMA and F16C, x86-64-v3 (simd.h's AVX2 section without VNNI). With `vnni`, also
    alderlake where the CPU has AVX-VNNI (the AVX2 section's vpdpbusd).
    x86-64-v3 only where "native" builds other code: csrc/ branches beyond AVX2 on AVX-512 (__AVX512F__,
    simd.h's avx512 section, __AVX512VNNI__) and AVX-VNNI (__AVXVNNI__) alone, so on a CPU with neither
    "native" is already the AVX2 section without VNNI, and a second run would test the same code twice."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    targets = ["native"]
    if {"avx2", "fma", "f16c"} <= flags and flags & {"avx512f", "avx_vnni"}:
        targets.append("x86-64-v3")
        if vnni and "avx_vnni" in flags:
            targets.append("alderlake")
    return targets

# Prompts of different lengths and languages: one token, short, code, Chinese, German, and one
# over 200 tokens (long enough to be chunked and to cross many KV blocks).
LONG_PROMPT = (
    "The history of the printing press begins long before Johannes Gutenberg. Woodblock printing was "
    "practised in China by the ninth century, and movable type made of baked clay was described by the "
    "scholar Shen Kuo, who credited an artisan named Bi Sheng with its invention around the year 1040. "
    "Later, Korean printers cast movable type in bronze, and the oldest surviving book printed with metal "
    "type dates from 1377. In Europe, Gutenberg combined several ideas in the middle of the fifteenth "
    "century: an adjustable hand mould for casting uniform letters, an oil-based ink that clung to metal, "
    "and a screw press adapted from those used to make wine and olive oil. His workshop in Mainz produced "
    "the famous Bible around 1455, and within fifty years presses had spread to more than two hundred "
    "cities. Books became cheaper, literacy rose, scholars could compare identical copies of a text, and "
    "new ideas travelled faster than ever before. Summarize the consequences of this invention in three "
    "short points:"
)
EQUALITY_PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    "请用三句话介绍一下长城的历史。",
    "Die wichtigsten Flüsse in Deutschland sind",
    LONG_PROMPT,
]


def greedy(num_tokens: int = NEW_TOKENS, **kwargs: Any) -> SamplingParams:
    """Greedy with exactly `num_tokens` new tokens, as HF's `min_new_tokens = max_new_tokens` does."""
    return SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens, ignore_eos=True, **kwargs)


class HFGreedy:
    """HF `generate`'s greedy continuations (`min_new_tokens = max_new_tokens`), each computed once.
    Prompts not seen before that are asked for together run as one left-padded batch: decoding is
    memory-bound, so a batch costs about what one prompt costs."""

    def __init__(self, hf_model: Any) -> None:
        self.model = hf_model
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt_ids: list[int], num_tokens: int) -> list[int]:
        return self.many([prompt_ids], num_tokens)[0]

    def many(self, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        import torch

        new = list(dict.fromkeys(tuple(p) for p in prompts if (tuple(p), num_tokens) not in self.cache))
        if new:
            width = max(map(len, new))
            pad = self.model.generation_config.pad_token_id
            ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in new])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in new])
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                      max_new_tokens=num_tokens, min_new_tokens=num_tokens)
            for p, row in zip(new, out[:, width:].tolist()):
                self.cache[(p, num_tokens)] = row
        return [self.cache[(tuple(p), num_tokens)] for p in prompts]


def hf_from_gguf(path: Path, dtype: Any = None) -> Any:
    """transformers' model on a GGUF file's tensors, read and dequantized by transformers, in float32 unless
    `dtype` (through a copy of the file without the tokenizer's arrays: hf_backend.hf_causal_lm)."""
    import torch

    from minivllm.bench.hf_backend import hf_causal_lm

    return hf_causal_lm(path, dtype or torch.float32)


def assert_match_hf(outputs: list[RequestOutput], hf_greedy: HFGreedy) -> None:
    """Each output is HF's greedy continuation of its prompt, token for token."""
    references = hf_greedy.many([o.prompt_token_ids for o in outputs], NEW_TOKENS)
    for out, reference in zip(outputs, references):
        ours = out.outputs[0].token_ids
        assert ours == reference, f"prompt {out.prompt!r:.40}: " + mismatch_report(
            hf_greedy.model, out.prompt_token_ids, ours, reference)
        assert out.outputs[0].finish_reason == "length"


def assert_idle(engine: LLMEngine) -> None:
    """Nothing left running, and every KV block back in the free pool."""
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    bm.check_invariants([])


def layer_loop_outputs(llm: LLM, native: bool, lora_request: Any = None, prompts: list[str] = EQUALITY_PROMPTS,
                       max_tokens: int = 8) -> list[Any]:
    """Greedy tokens and logprobs of `prompts` (in one batch; `lora_request` as LLM.generate takes it)
    through the native layer loop (csrc/forward.c) or, native=False, decoder.py's Python loop. 8 tokens:
    at a budget of 48 tokens a step, the long prompt's chunks end in step 6, and decodes run beside each."""
    model = llm.engine.runner.model
    saved = model.native_forward
    model.native_forward = saved if native else None
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    finally:
        model.native_forward = saved
    assert_idle(llm.engine)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def drain(engine: LLMEngine) -> None:
    """Abort whatever a failed test left behind, so that the next test finds the engine idle."""
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every RequestOutput the engine emits for one request, in order, until it finishes."""
    request_id = engine.add_request(None, prompt, params)
    outputs: list[RequestOutput] = []
    while not outputs or not outputs[-1].finished:
        outputs.extend(o for o in engine.step() if o.request_id == request_id)
    return outputs


def mismatch_report(hf_model: Any, prompt_ids: list[int], ours: list[int], reference: list[int]) -> str:
    """Where our tokens first leave the reference, and the reference's logit gap there: a gap below
    ~1e-4 is a near tie that float rounding may flip, anything larger is a bug."""
    import torch

    i = next((k for k, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    if i == min(len(ours), len(reference)):
        return f"lengths differ: {len(ours)} tokens vs {len(reference)} in the reference"
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + reference[:i]])).logits[0, -1]
    gap = (logits[reference[i]] - logits[ours[i]]).item()
    return (f"first difference at output token {i}: ours {ours[i]}, reference {reference[i]}; "
            f"reference logit gap {gap:.3g} (ours {ours[:i + 1]}, reference {reference[:i + 1]})")


# -- a family's engine against transformers (test_families.py, test_moe.py) ----------------------------
FAMILY_NEW_TOKENS = 8
SHORT_PROMPT = "The capital of France is"


def family_engine(path: Path, dtype: str = "float32", **engine_args: Any) -> Any:
    """An engine on a tiny checkpoint, with 16-token chunks (the long prompt's prefill runs in pieces
    that start inside the window) and prefix caching on."""
    from minivllm import LLM

    return LLM(model=str(path), dtype=dtype, **{"num_kv_blocks": 64, "max_num_batched_tokens": 16,
                                                "enable_chunked_prefill": True, "enable_prefix_caching": True,
                                                **engine_args})


def family_prompts(llm: Any) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(SHORT_PROMPT), tokenizer.encode(LONG_PROMPT)[:80]]
    assert len(prompts[1]) > 3 * TINY_WINDOW
    return prompts


def assert_family_matches(llm: Any, reference: HFGreedy) -> None:
    """Greedy tokens equal transformers' on the short and long prompts, then on the long one again,
    read from the prefix cache; no block left held."""
    prompts = family_prompts(llm)
    for batch in (prompts, prompts[1:]):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(FAMILY_NEW_TOKENS), use_tqdm=False)
        for out, expected in zip(outputs, reference.many(batch, FAMILY_NEW_TOKENS)):
            ours = out.outputs[0].token_ids
            assert ours == expected, mismatch_report(reference.model, out.prompt_token_ids, ours, expected)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


# -- tiny random Hugging Face checkpoints, one per family -------------------------------------------
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
TINY_SIZES = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,  # the default tokenizer's vocab
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
TINY_WINDOW = 24  # sliding windows shorter than the long prompts (and several KV blocks of 16 tokens)
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                 "original_max_position_embeddings": 256,  # above every test position: the short factors apply
                 "short_factor": [1.0 + 0.25 * i for i in range(6)], "long_factor": [2.0 + i for i in range(6)]}


def tiny_config(kind: str) -> Any:
    """The config of a tiny model of family `kind`, with the family's switches on (sliding windows
    shorter than the long prompts, softcaps low enough to bind, partial rotary, NoPE layers, multipliers)."""
    import transformers as t

    sizes = TINY_SIZES
    # query_pre_attn_scalar = head_dim: llama.cpp's converter does not write it, and its Gemma code takes head_dim.
    moe = dict(sizes, num_hidden_layers=3, num_experts_per_tok=2)
    gemma = dict(sizes, head_dim=32, query_pre_attn_scalar=32, sliding_window=TINY_WINDOW, tie_word_embeddings=True)
    return {
        "llama": lambda: t.LlamaConfig(**sizes),
        "llama3-rope": lambda: t.LlamaConfig(**sizes, rope_scaling=LLAMA3_ROPE),
        "llama3.2": lambda: t.LlamaConfig(**{**sizes, "tie_word_embeddings": True}, rope_scaling=LLAMA3_ROPE),
        "mistral": lambda: t.MistralConfig(**sizes),
        "qwen2": lambda: t.Qwen2Config(**{**sizes, "tie_word_embeddings": True}),
        "qwen3": lambda: t.Qwen3Config(**sizes, head_dim=32),  # head_dim != hidden / heads
        "gemma2": lambda: t.Gemma2Config(**{**gemma, **GEMMA_SPECIAL_IDS, "num_hidden_layers": 3, "vocab_size": GEMMA_VOCAB},
                                         attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
        # Five sliding layers to one global, as llama.cpp assumes (the converter writes no pattern).
        "gemma3": lambda: t.Gemma3TextConfig(**{**gemma, "num_hidden_layers": 6},
                                             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                 "rope_theta": 100000.0},
                                                              "sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 1000.0}}),
        "phi3": lambda: t.Phi3Config(**{**sizes, "max_position_embeddings": 1024}, rope_parameters=PHI3_LONGROPE,
                                     original_max_position_embeddings=256, sliding_window=None, pad_token_id=0),
        # Longrope's threshold inside the test prompts: short factors below it, long ones above (test_families).
        "phi3-threshold-32": lambda: t.Phi3Config(
            **{**sizes, "max_position_embeddings": 1024}, sliding_window=None, pad_token_id=0,
            rope_parameters={**PHI3_LONGROPE, "original_max_position_embeddings": 32}, original_max_position_embeddings=32),
        "smollm3": lambda: t.SmolLM3Config(**{**sizes, "num_hidden_layers": 4}, pad_token_id=0),
        "granite": lambda: t.GraniteConfig(**sizes, embedding_multiplier=4.0, attention_multiplier=0.2,
                                           residual_multiplier=0.5, logits_scaling=2.0),
        # Mixtures of experts: 2 of 4 experts per token, over 3 layers.
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**moe, head_dim=32, moe_intermediate_size=32, num_experts=4,
                                              norm_topk_prob=True, mlp_only_layers=[1]),  # a dense layer between
        "qwen2_moe": lambda: t.Qwen2MoeConfig(**moe, moe_intermediate_size=32, num_experts=4,
                                              shared_expert_intermediate_size=48),
        "olmoe": lambda: t.OlmoeConfig(**moe, num_experts=4, clip_qkv=3.0),  # the weights unrenormalized
        "mixtral": lambda: t.MixtralConfig(**moe, num_local_experts=4, sliding_window=TINY_WINDOW),
        "granitemoe": lambda: t.GraniteMoeConfig(**moe, num_local_experts=4, embedding_multiplier=4.0,
                                                 attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0),
        # Sliding and full layers alternating, sinks, YaRN, biases everywhere, the clamped SwiGLU.
        "gpt_oss": lambda: t.GptOssConfig(**{**moe, "intermediate_size": 32}, num_local_experts=4, head_dim=64,
                                          sliding_window=TINY_WINDOW, rope_parameters=GPT_OSS_YARN),
    }[kind]()


# Gemma 2's tokenizer: SentencePiece, trained on the test prompts (sentencepiece_tokenizer).
GEMMA_VOCAB = 384
GEMMA_SPECIAL_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}  # and <unk> 3, as Gemma's


def sentencepiece_tokenizer(path: Path) -> Path:
    """A SentencePiece model as Gemma's is made (BPE with byte fallback, digits split, no dummy prefix,
    whitespace kept, <pad> <eos> <bos> <unk> first), trained on the test prompts with GEMMA_VOCAB pieces,
    saved in `path` as tokenizer.model (what llama.cpp's Gemma converter reads) beside transformers'
    files made from it (tokenizer.json, tokenizer_config.json)."""
    import io
    import json

    import sentencepiece
    from transformers import AutoTokenizer

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(EQUALITY_PROMPTS), model_writer=model, model_type="bpe", vocab_size=GEMMA_VOCAB,
        byte_fallback=True, split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", minloglevel=2)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>",
              "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(path).save_pretrained(path)
    return path


def save_tiny_model(config: Any, path: Path, tokenizer_dir: Path) -> Any:
    """A random model of this config (every weight random, biases and norms too, large enough that RoPE
    and attention matter to the logits), saved with the tokenizer in `tokenizer_dir`. Gemma's norms
    multiply by 1 + w: theirs are drawn around 0, the others' around 1."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    centre = 0.0 if config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(centre - 0.5, centre + 0.5)
            else:
                param.normal_(0.0, 0.2)
    if model.generation_config.pad_token_id is None:  # HFGreedy left-pads its batches
        model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    return model


# -- tiny GGUF checkpoints -------------------------------------------------------------------------
TINY_HIDDEN, TINY_HEADS, TINY_KV_HEADS, TINY_VOCAB = 256, 4, 2, 32  # rows 256 wide: the K-quants' block


def tiny_head_dim(arch: str) -> int:
    # transformers reads no head_dim from a qwen3 GGUF and assumes Qwen3's 128; elsewhere hidden / heads.
    return 128 if arch == "qwen3" else TINY_HIDDEN // TINY_HEADS


def write_tiny_gguf(path: Path, arch: str = "llama", qtype: str = "F32", seed: int = 0,
                    rope_freqs: np.ndarray | None = None, formats: dict[str, str] | None = None,
                    ffn: int = TINY_HIDDEN, tied: bool = False) -> dict[str, np.ndarray]:
    """Write a one-layer model of architecture `arch` with every matrix stored as `qtype` (vectors
    stay F32), laid out as llama.cpp's converter does: Llama's Q/K rows permuted for its RoPE, and
    Llama 3's RoPE scaling, if any, as the `rope_freqs` tensor of per-frequency divisors. `formats`
    gives single matrices (GGUF names: "blk.0.attn_v") another format, as llama.cpp's mixes do; `ffn`
    is the MLP's width; `tied` leaves out the LM head (the embedding serves).
    Returns the weights the file encodes, under Hugging Face names and in HF layout."""
    import gguf

    rng = np.random.default_rng(seed)
    h, head_dim = TINY_HIDDEN, tiny_head_dim(arch)
    q, kv = TINY_HEADS * head_dim, TINY_KV_HEADS * head_dim
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", h),
                       ("feed_forward_length", ffn), ("attention.head_count", TINY_HEADS),
                       ("attention.head_count_kv", TINY_KV_HEADS), ("attention.key_length", head_dim),
                       ("attention.value_length", head_dim), ("rope.dimension_count", head_dim),
                       ("vocab_size", TINY_VOCAB)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)

    layer = "model.layers.0"
    matrices = {  # GGUF name -> (HF name, rows, columns)
        "token_embd": ("model.embed_tokens", TINY_VOCAB, h), "output": ("lm_head", TINY_VOCAB, h),
        "blk.0.attn_q": (f"{layer}.self_attn.q_proj", q, h), "blk.0.attn_k": (f"{layer}.self_attn.k_proj", kv, h),
        "blk.0.attn_v": (f"{layer}.self_attn.v_proj", kv, h), "blk.0.attn_output": (f"{layer}.self_attn.o_proj", h, q),
        "blk.0.ffn_gate": (f"{layer}.mlp.gate_proj", ffn, h), "blk.0.ffn_up": (f"{layer}.mlp.up_proj", ffn, h),
        "blk.0.ffn_down": (f"{layer}.mlp.down_proj", h, ffn),
    }
    if tied:
        del matrices["output"]
    encoded: dict[str, np.ndarray] = {}
    for name, (hf_name, rows, cols) in matrices.items():
        kind = gguf.GGMLQuantizationType[(formats or {}).get(name, qtype)]
        data = encode_matrix(rng, rows, cols, kind)
        encoded[f"{hf_name}.weight"] = gguf.quants.dequantize(data, kind)
        if arch == "llama" and name in ("blk.0.attn_q", "blk.0.attn_k"):
            data = _permute_rows(data, TINY_HEADS if name.endswith("q") else TINY_KV_HEADS)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=kind)
    vectors = {"output_norm.weight": ("model.norm.weight", h),
               "blk.0.attn_norm.weight": (f"{layer}.input_layernorm.weight", h),
               "blk.0.ffn_norm.weight": (f"{layer}.post_attention_layernorm.weight", h)}
    if arch == "qwen2":  # q/k/v biases
        for part, size in (("q", q), ("k", kv), ("v", kv)):
            vectors[f"blk.0.attn_{part}.bias"] = (f"{layer}.self_attn.{part}_proj.bias", size)
    if arch == "qwen3":  # per-head q/k norms
        for part in ("q", "k"):
            vectors[f"blk.0.attn_{part}_norm.weight"] = (f"{layer}.self_attn.{part}_norm.weight", head_dim)
    for name, (hf_name, size) in vectors.items():
        encoded[hf_name] = (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)
        writer.add_tensor(name, encoded[hf_name])
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return encoded


# Where each block format keeps its float16 scales (byte offsets in a block): what random bytes need
# set to small finite values to be a valid block.
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                 "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
                 "MXFP4": ()}


def encode_matrix(rng: np.random.Generator, rows: int, cols: int, kind: Any) -> np.ndarray:
    """Random weights in `kind`'s storage: quantized by the gguf package where it can, else (the
    K-quants and IQ4 formats, which it only reads) random valid blocks (`random_blocks`)."""
    import gguf

    weights = (0.05 * rng.standard_normal((rows, cols))).astype(np.float32)
    try:
        return gguf.quants.quantize(weights, kind)
    except NotImplementedError:
        return random_blocks(rng, rows, cols, kind)


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: Any) -> np.ndarray:
    """Random bytes in `kind`'s blocks, [rows, bytes per row]: any bytes form a valid block once its
    float16 scales are finite; they are set small (1e-4 .. 2e-3, either sign)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in SCALE_OFFSETS[kind.name]:
        scales = (rng.uniform(1e-4, 2e-3, (rows, cols // block)) * rng.choice([-1, 1], (rows, cols // block)))
        blocks[..., at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    if kind.name == "MXFP4":  # its E8M0 exponent: 2^-14 .. 2^-8, about the scales above
        blocks[..., 0] = rng.integers(114, 121, (rows, cols // block), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def _permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: within each head, the two RoPE halves interleaved. Rows are
    quantized independently, so this works on quantized storage too."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
