"""Quantized weights (issues 10, 27): every GGUF block format split, packed and computed by the native
kernel and its torch twin against the gguf package's decoding; batch invariance; the bytes held; mixed
formats in one fused projection; the loader keeping them quantized; the files that broke (a tied Q6_K
embedding, Q4_K beside Q6_K in one layer, q/k/v biases, rows not a multiple of 256), pinned; and the
default model run quantized against the dequantized float32 model."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model import gguf_quants, quant
from minivllm.model import kernels
from minivllm.model.kernels import quant_gemm
from minivllm.model.loader import default_model_path, load_checkpoint
from tests.helpers import EQUALITY_PROMPTS, assert_idle, cpu_targets, greedy, random_blocks, write_tiny_gguf

FORMATS = [fmt.name for fmt in gguf_quants.BLOCK_FORMATS.values()]
CPU = torch.device("cpu")


def _tensor(qtype: str, n: int, k: int, seed: int = 0) -> tuple[quant.QuantizedTensor, torch.Tensor]:
    """Random valid blocks of `qtype` [n, k], and the gguf package's decoding of them."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    data = random_blocks(np.random.default_rng(seed), n, k, kind)
    expected = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, kind), dtype=np.float32))
    return quant.QuantizedTensor(torch.from_numpy(data), int(kind)), expected.view(n, k)


ROWS = 131  # past one of the kernel's row blocks of 128


def _k(qtype: str) -> int:
    """The kernel's chunks are 32 blocks of 32: a width of a chunk and one block more (33 blocks of 32),
    or of a chunk and a part (5 super-blocks of 256)."""
    return 1280 if gguf_quants.BLOCK_FORMATS[_id(qtype)].block_size == 256 else 1056


def _id(name: str) -> int:
    return next(q for q, fmt in gguf_quants.BLOCK_FORMATS.items() if fmt.name == name)


@pytest.mark.parametrize("qtype", FORMATS)
def test_every_format_decodes_as_the_gguf_package_does(qtype: str) -> None:
    """The float decoder is bit-identical to gguf.quants.dequantize; the packed layout unpacks to the same
    weights (w = d * v + m: bit-identical where the format's rule has that form, else within a rounding);
    and the packed bytes stay within 1.05x of the file's."""
    t, expected = _tensor(qtype, 64, _k(qtype))
    assert torch.equal(t.dequantize(), expected)
    weight = quant.QuantizedWeight.of(t)
    torch.testing.assert_close(weight.dequantize(), expected, atol=1e-7 * expected.abs().max().item(), rtol=1e-6)
    assert weight.nbytes <= 1.05 * t.blocks.numel()


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin_and_is_batch_invariant(qtype: str, dtype: torch.dtype, cpu_target: str) -> None:
    """On each target this machine runs: a partial panel of columns, a bias, 131 rows (past one 128-row
    block); the twin against a float matmul on the gguf package's weights; the kernel against the twin;
    then every row alone, and two, three and four rows together: the same bits; and an embedding's rows."""
    kernel = quant_gemm(CPU, dtype)
    if kernel is None:
        pytest.skip(f"no native quantized kernel for {cpu_target} (no compiler, no simd.h section, or "
                    "MINIVLLM_NO_KERNELS)")
    n, k, rows = 100, _k(qtype), ROWS
    t, expected = _tensor(qtype, n, k, seed=1)
    weight = quant.QuantizedWeight.of(t)
    bias = torch.randn(n)
    x = torch.randn(rows, k).to(dtype)
    weight.use_kernel(None, dtype)
    twin = weight.linear(x, bias)
    exact = x.float() @ expected.T + bias
    assert (twin.float() - exact).abs().max() < 0.02 * exact.abs().max()  # the activations' int8 rounding
    weight.use_kernel(kernel, dtype)
    out = weight.linear(x, bias)
    # float32: sums in another order; bf16: one rounding of the output either side (an ulp of its scale)
    scale = twin.float().abs().max().item()
    tol = dict(atol=1e-6 * scale, rtol=1e-4) if dtype == torch.float32 else dict(atol=2 ** -7 * scale, rtol=2 ** -7)
    torch.testing.assert_close(out.float(), twin.float(), **tol)
    alone = torch.cat([weight.linear(x[i:i + 1], bias) for i in range(rows)])
    assert torch.equal(alone, out)
    assert torch.equal(weight.linear(x[30:], bias), out[30:])  # another row block boundary
    for first, last in [(0, 2), (5, 8), (9, 13)]:  # a few rows decode each block in registers once for all
        assert torch.equal(weight.linear(x[first:last], bias), out[first:last])
    ids = torch.tensor([0, 17, 99, 5])
    torch.testing.assert_close(weight.rows(ids).float(), expected[ids].to(dtype).float(), atol=1e-6, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_sums_stay_exact_at_the_extremes(dtype: torch.dtype, cpu_target: str) -> None:
    """The largest products the formats make: Q8_0's u = 255 and IQ4_NL's 241 (its table's 113 + 128)
    against activations all at +-127, where AVX2's vpmaddubsw would saturate a pair's int16 sum
    (2 * 255 * 127 > 32,767); and Q5_0's u = 31 and Q6_K's 63, whose int16 parts on AVX2 hold 4 and 2
    groups (4 * 2 * 31 * 127 = 31,496: one group more would wrap). Kernel against twin on each target,
    within float32 rounding."""
    kernel = quant_gemm(CPU, dtype)
    if kernel is None:
        pytest.skip(f"no native quantized kernel for {cpu_target}")
    n, k = 32, 256
    iq4 = torch.cat([torch.tensor([0x00, 0x3C], dtype=torch.uint8), torch.full((16,), 0xFF, dtype=torch.uint8)])
    q5_0 = torch.tensor([0x00, 0x3C] + [0xFF] * 20, dtype=torch.uint8)  # d = 1, qh and qs all ones: q = 31
    q6_k = torch.tensor([0xFF] * 192 + [1] * 16 + [0x00, 0x3C], dtype=torch.uint8)  # q = 63, scales 1, d = 1
    tensors = [quant.quantize(torch.ones(n, k), "int8"),  # d = 1 / 127, every q = 127: u = 255
               quant.QuantizedTensor(iq4.repeat(n, k // 32), _id("IQ4_NL")),  # d = 1, every index 15
               quant.QuantizedTensor(q5_0.repeat(n, k // 32), _id("Q5_0")),
               quant.QuantizedTensor(q6_k.repeat(n, k // 256), _id("Q6_K"))]
    x = torch.ones(3, k, dtype=dtype)
    x[1] = -1
    x[2, ::2] = -1  # the signs alternate within each pair
    for t in tensors:
        weight = quant.QuantizedWeight.of(t)
        weight.use_kernel(None, dtype)
        twin = weight.linear(x, None)
        weight.use_kernel(kernel, dtype)
        torch.testing.assert_close(weight.linear(x, None).float(), twin.float(), atol=1e-6, rtol=1e-6)


def test_every_target_computes_the_same_bits() -> None:
    """simd.h's sections do the same integer sums and the same float steps per output on every target,
    so the quantized GEMM (every format, ROWS rows and one alone) and the float GEMM (1, 2 and 13 rows: the
    AVX-512 build's vdpbf16ps and FMA paths) give the same bits on every x86 target this machine runs:
    AVX-512, AVX2 with vpmaddubsw (its saturation kept out of Q8_0's and IQ4's sums) and AVX2 with AVX-VNNI.
    The bound across targets is 0."""
    targets = cpu_targets(vnni=True)
    libs = [kernels.library(t) for t in targets]
    if len(targets) < 2 or not all(lib is not None and hasattr(lib, "qgemm_f32") for lib in libs):
        pytest.skip(f"one target with GEMMs here ({targets})")
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for qtype in FORMATS:
            t, _ = _tensor(qtype, 100, _k(qtype), seed=2)
            weight = quant.QuantizedWeight.of(t)
            x, bias = torch.randn(ROWS, _k(qtype), generator=gen).to(dtype), torch.randn(100, generator=gen)
            outs = []
            for lib in libs:
                weight.use_kernel(kernels.QuantGemm(lib, dtype), dtype)
                outs.append((weight.linear(x, bias), weight.linear(x[40:41], bias)))
            for target, out in zip(targets[1:], outs[1:]):
                assert all(torch.equal(a, b) for a, b in zip(out, outs[0])), f"{qtype} {dtype} on {target}"
        w, b = torch.randn(100, 576, generator=gen).to(dtype), torch.randn(100, generator=gen)
        x = torch.randn(13, 576, generator=gen).to(dtype)
        outs = []
        for lib in libs:
            native = kernels.Gemm(lib, dtype)
            packed, padded = native.pack(w, b)
            outs.append([native.forward(x[:rows], packed, padded, 100) for rows in (1, 2, 13)])
        for target, out in zip(targets[1:], outs[1:]):
            assert all(torch.equal(a, b) for a, b in zip(out, outs[0])), f"float GEMM {dtype} on {target}"


def test_mixed_formats_in_one_fused_projection() -> None:
    """q and k in Q5_0 and v in Q8_0 fuse into two segments of one weight (never a conversion): the same
    output as three separate GEMMs, on the kernel and the twin."""
    parts = [_tensor("Q5_0", n, 224, seed)[0] for n, seed in ((64, 0), (32, 1))] + [_tensor("Q8_0", 32, 224, 2)[0]]
    fused = quant.fuse_rows(parts)
    assert [(s.qtype, s.shape[0]) for s in fused] == [(_id("Q5_0"), 96), (_id("Q8_0"), 32)]
    weight, alone = quant.QuantizedWeight.of(fused), [quant.QuantizedWeight.of(p) for p in parts]
    x, bias = torch.randn(5, 224), torch.randn(128)
    for kernel in {None, quant_gemm(CPU, torch.float32)}:
        for w in [weight, *alone]:
            w.use_kernel(kernel, torch.float32)
        separate = torch.cat([w.linear(x, b) for w, b in zip(alone, bias.split([64, 32, 32]))], dim=1)
        assert torch.equal(weight.linear(x, bias), separate)
    assert isinstance(quant.fuse_rows([parts[0], torch.zeros(32, 224)]), torch.Tensor)  # float wins, exactly


def test_activation_quantization_is_per_row() -> None:
    """A row's int8 codes and scales do not depend on the rows beside it (prefill, chunk or decode alike)."""
    x = torch.randn(9, 64)
    x8, dx = quant.quantize_activations(x)
    x8_alone, dx_alone = quant.quantize_activations(x[4:5])
    assert torch.equal(x8[4:5], x8_alone) and torch.equal(dx[4:5], dx_alone)
    assert x8.abs().max() <= 127


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K", "IQ4_NL"])
def test_loader_keeps_every_format_quantized(tmp_path: Path, qtype: str) -> None:
    """A GGUF file's matrices load as QuantizedTensor (vectors stay float); the model built from them
    holds every linear layer quantized and computes what the dequantized model computes."""
    from minivllm.model.decoder import Linear
    from minivllm.model.weights import model_from_weights

    path = tmp_path / "tiny.gguf"
    encoded = write_tiny_gguf(path, "llama", qtype)
    config, weights = load_checkpoint(path, torch.float32, keep_quantized=True)
    weights = dict(weights)
    for name, tensor in weights.items():
        assert isinstance(tensor, quant.QuantizedTensor) == (encoded[name].ndim == 2), name
    models = {q: model_from_weights(config, load_checkpoint(path, torch.float32, q == "gguf")[1],
                                    CPU, torch.float32, q) for q in ("gguf", "none")}
    assert all(m.quantized is not None for m in models["gguf"].modules() if isinstance(m, Linear))
    x = torch.randn(5, config.hidden_size)
    ref = models["none"].layers[0].mlp(x)
    torch.testing.assert_close(models["gguf"].layers[0].mlp(x), ref, atol=0.05 * ref.abs().max().item(), rtol=0.05)


def test_an_unsupported_format_is_refused_by_name(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "iq2.gguf"
    write_tiny_gguf(path, "llama", "F32")
    data = bytearray(path.read_bytes())
    # Rewrite the type of the first matrix (token_embd, F32) to IQ2_XXS in the tensor table.
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # past the name, n_dims and two dims
    assert int.from_bytes(data[at:at + 4], "little") == int(gguf.GGMLQuantizationType.F32)
    data[at:at + 4] = int(gguf.GGMLQuantizationType.IQ2_XXS).to_bytes(4, "little")
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"token_embd\.weight is IQ2_XXS.*supported: Q4_0, .*IQ4_XS"):
        config, weights = load_checkpoint(path, torch.float32, keep_quantized=True)
        dict(weights)


@pytest.mark.parametrize("scheme,qtype", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_quantize_at_load(scheme: str, qtype: str) -> None:
    w = torch.randn(48, 256) * 0.05
    t = quant.quantize(w, scheme)
    assert t.fmt.name == qtype and t.shape == w.shape
    groups = w.view(48, -1, 32)
    step = groups.abs().amax(2) / 127 if scheme == "int8" else (groups.amax(2) - groups.amin(2)) / 15
    error = (t.dequantize() - w).view(48, -1, 32).abs().amax(2)
    assert (error <= step * 0.51 + 1e-4).all()  # half a step, plus float16 scales
    with pytest.raises(ValueError, match="in_features"):
        quant.quantize(torch.randn(4, 100), scheme)


# -- the files that broke (issue 27), pinned -----------------------------------------------------------
MIXED = {"token_embd": "Q6_K", "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q6_K",
         "blk.0.attn_output": "Q4_K", "blk.0.ffn_gate": "Q4_K", "blk.0.ffn_up": "Q6_K", "blk.0.ffn_down": "Q5_0"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2's shape: q/k/v biases, a tied Q6_K embedding, Q4_K and Q6_K in one layer (q/k beside v,
    gate beside up), and a down projection 288 wide (not a multiple of 256: Q5_0, as llama.cpp falls back)."""
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_tiny_gguf(path, "qwen2", "Q4_K", formats=MIXED, ffn=288, tied=True)
    return path


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """One prefill of `ids` through the model's forward, through a fresh KV pool."""
    from minivllm.model.attention import AttentionMetadata
    from minivllm.model.kernels import attention_kernel
    from minivllm.model.kv_cache import allocate_kv_caches, kv_format
    from minivllm.model.attention import kv_cache_shapes

    cfg, dtype = model.config, model.norm.weight.dtype
    caches = allocate_kv_caches(cfg.num_hidden_layers, *kv_cache_shapes(4, 16, cfg.num_key_value_heads, cfg.head_dim),
                                dtype, CPU, kv_format("auto"))
    n = ids.shape[0]
    kernel = attention_kernel(CPU, dtype, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads, 16)
    meta = AttentionMetadata(slot_blocks=torch.arange(n) // 16, slot_offsets=torch.arange(n) % 16,
                             span_starts=torch.tensor([0]), span_lens=torch.tensor([n]), span_ctx0=torch.tensor([1]),
                             num_decodes=0, kernel=kernel, block_tables=torch.arange(4).view(1, 4))
    if kernel is None:
        from minivllm.model.attention import PrefillSpan

        meta.prefills = [PrefillSpan(start=0, num_tokens=n, context_len=n)]
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(n), caches, meta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_tied_biased_file_computes_what_its_float_model_does(mixed_gguf: Path, dtype: torch.dtype,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (quantized) load of the mixed file, native and twin, against its dequantized float32
    model; then mapped back from the weight cache (which crashed on it): the same bits."""
    from minivllm.model.build import build_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config, reference = build_model.__wrapped__(mixed_gguf, CPU, torch.float32, "none")
    config, model = build_model.__wrapped__(mixed_gguf, CPU, dtype, "gguf")
    assert config.tie_word_embeddings and config.attention_bias
    assert model.lm_head.quantized is model.embed_tokens.quantized
    qkv = model.layers[0].self_attn.qkv_proj.quantized
    assert [gguf_quants.BLOCK_FORMATS[s.qtype].name for s in qkv.segments] == ["Q4_K", "Q6_K"]
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3])
    expected = _logits(reference, ids)
    ours = _logits(model, ids)
    tol = 0.06 if dtype == torch.float32 else 0.08  # the activations' int8 rounding on large random weights
    assert (ours - expected).abs().max() < tol * expected.abs().max()
    model.use_native_kernels(False)  # the twins, from the same bytes
    twin = _logits(model, ids)
    assert (twin - expected).abs().max() < tol * expected.abs().max()
    model.use_native_kernels(True)
    _, mapped = build_model.__wrapped__(mixed_gguf, CPU, dtype, "gguf")  # from the cache entry written above
    assert torch.equal(_logits(mapped, ids), ours)


# -- the default model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized_llm() -> Any:
    return LLM(dtype="float32", num_kv_blocks=256)  # the default: the GGUF file's own quantization


def test_default_gguf_stays_quantized_within_the_memory_target(quantized_llm: Any) -> None:
    model = quantized_llm.engine.runner.model
    assert quantized_llm.engine.config.weight_quantization(True) == "gguf"
    weights = model.quantized_weights()
    assert weights and model.lm_head.quantized is model.embed_tokens.quantized  # tied, one copy
    held = sum(w.nbytes for w in weights) + sum(p.numel() * p.element_size() for p in model.parameters())
    assert held <= 1.05 * Path(default_model_path()).stat().st_size


def test_quantized_greedy_equals_dequantized_where_the_margin_is_large(quantized_llm: Any, llm: Any) -> None:
    """Token for token against the dequantized float32 model for as long as both models' top-2 margins
    stay large (where the two may legitimately differ is where either is a near tie: after "Hello" the
    quantized model's second token is one, 0.04 apart on the torch twin), and coherent."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    reference = llm.generate(EQUALITY_PROMPTS, params, use_tqdm=False)
    ours = quantized_llm.generate(EQUALITY_PROMPTS, params, use_tqdm=False)

    def margin(top: dict[int, float]) -> float:
        first, second = sorted(top.values(), reverse=True)[:2]
        return first - second

    checked = 0
    for ref, out in zip(reference, ours):
        for step, (token, top) in enumerate(zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)):
            if min(margin(top), margin(out.outputs[0].logprobs[step])) < 0.5:
                break
            assert out.outputs[0].token_ids[step] == token, (ref.prompt[:30], step)
            checked += 1
    assert checked >= 2 * len(EQUALITY_PROMPTS), "too few confident tokens to compare"
    assert "Paris" in ours[1].outputs[0].text
    assert_idle(quantized_llm.engine)


@pytest.mark.parametrize("scheme,qtype", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_int8_int4_at_load_generate_coherently(scheme: str, qtype: str) -> None:
    llm = LLM(dtype="float32", quantization=scheme, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert all(s.fmt.name == qtype for w in model.quantized_weights() if w is not model.lm_head.quantized
               for s in w.segments)
    out = llm.generate(["The capital of France is"], greedy(8), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
