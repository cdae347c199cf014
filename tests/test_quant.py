"""Quantized weights (issue 10): the packed kernel against its torch twin on every layout, its batch
invariance, the GGUF formats split into integers, the loader keeping them quantized, and the default
model run quantized against the dequantized float32 model."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model import gguf_quants, quant
from minivllm.model.kernels import quant_gemm
from minivllm.model.loader import default_model_path, load_checkpoint
from tests.helpers import EQUALITY_PROMPTS, assert_idle, encode_matrix, greedy, write_tiny_gguf

GGUF_QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
EXACT_SPLITS = {"Q8_0", "Q4_0", "Q4_1"}  # float16 scales: the split is exact; the K-quants' are rounded


def random_quantized(n: int, k: int, bits: int, sub: int, seed: int = 0) -> quant.QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    groups = k // 32 * sub
    u = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, groups, generator=g) * 0.01).half()
    m = (torch.randn(n, groups, generator=g) * 0.05).half()
    return quant.QuantizedTensor(u, d, m, bits)


@pytest.mark.parametrize("bits,sub", [(4, 1), (8, 1), (4, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin_and_is_batch_invariant(bits: int, sub: int, dtype: torch.dtype) -> None:
    """Odd shapes (a partial panel of columns, 7 blocks of k), a bias; then every row alone: the same bits."""
    kernel = quant_gemm(torch.device("cpu"), dtype)
    if kernel is None:
        pytest.skip("no native quantized kernel here (no compiler, no AVX512-VNNI, or MINIVLLM_NO_KERNELS)")
    n, k, rows = 100, 224, 37
    t = random_quantized(n, k, bits, sub)
    packed = kernel.pack(t)
    bias = torch.randn(n)
    x = torch.randn(rows, k).to(dtype)
    out = kernel.forward(x, packed, bits, sub, quant.padded_bias(bias, n), n)
    twin = quant.linear_twin(x, t, bias)
    # float32: sums in another order; bf16: one rounding of the output either side (an ulp of its scale)
    scale = twin.float().abs().max().item()
    tol = dict(atol=1e-6 * scale, rtol=1e-4) if dtype == torch.float32 else dict(atol=2 ** -7 * scale, rtol=2 ** -7)
    torch.testing.assert_close(out.float(), twin.float(), **tol)
    # the twin computes what a float matmul on the dequantized weights does, up to the activations' int8 rounding
    exact = x.float() @ t.dequantize().T + bias
    assert (twin.float() - exact).abs().max() < 0.02 * exact.abs().max()
    alone = torch.cat([kernel.forward(x[i:i + 1], packed, bits, sub, quant.padded_bias(bias, n), n)
                       for i in range(rows)])
    assert torch.equal(alone, out)
    ids = torch.tensor([0, 17, 99, 5])
    torch.testing.assert_close(kernel.rows(packed, bits, sub, k, ids).float(), t.dequantize(dtype)[ids].float())


@pytest.mark.parametrize("bits,sub", [(4, 1), (8, 2)])
def test_pack_unpack_round_trip(bits: int, sub: int) -> None:
    kernel = quant_gemm(torch.device("cpu"), torch.float32)
    if kernel is None:
        pytest.skip("no native quantized kernel here: nothing is packed")
    t = random_quantized(50, 96, bits, sub)
    back = quant.unpack(kernel.pack(t), 50, bits, sub)
    assert all(torch.equal(a, b) for a, b in ((back.u, t.u), (back.d, t.d), (back.m, t.m)))


def test_activation_quantization_is_per_row() -> None:
    """A row's int8 codes and scales do not depend on the rows beside it (prefill, chunk or decode alike)."""
    x = torch.randn(9, 64)
    x8, dx = quant.quantize_activations(x)
    x8_alone, dx_alone = quant.quantize_activations(x[4:5])
    assert torch.equal(x8[4:5], x8_alone) and torch.equal(dx[4:5], dx_alone)
    assert x8.abs().max() <= 127


@pytest.mark.parametrize("qtype", GGUF_QUANTIZED)
def test_gguf_blocks_split_into_integers(qtype: str) -> None:
    """The integer split of each format, dequantized, is the gguf package's decoding (bit for bit where
    the scales are float16 in the file; the K-quants' scale products are rounded to float16)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    data = encode_matrix(np.random.default_rng(1), 8, 512, kind)
    expected = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, kind), dtype=np.float32))
    fmt = gguf_quants.BLOCK_FORMATS[int(kind)]
    raw = torch.from_numpy(data.reshape(-1).view(np.uint8)).view(-1, fmt.type_size)
    t = quant.QuantizedTensor.from_blocks(fmt.split(raw), (8, 512))
    assert int(t.u.max()) < (1 << t.bits) and t.sub == (2 if qtype == "Q6_K" else 1)
    if qtype in EXACT_SPLITS:
        assert torch.equal(t.dequantize(), expected)
    else:
        torch.testing.assert_close(t.dequantize(), expected, atol=1e-3 * expected.abs().max().item(), rtol=1e-3)


@pytest.mark.parametrize("qtype", GGUF_QUANTIZED)
def test_loader_keeps_every_format_quantized(tmp_path: Path, qtype: str) -> None:
    """A GGUF file's matrices load as QuantizedTensor (vectors stay float); the model built from them
    holds every linear layer quantized and computes what the dequantized model computes."""
    from minivllm.model.llama import Linear, LlamaForCausalLM

    path = tmp_path / "tiny.gguf"
    encoded = write_tiny_gguf(path, "llama", qtype)
    config, weights = load_checkpoint(path, torch.float32, keep_quantized=True)
    weights = dict(weights)
    for name, tensor in weights.items():
        assert isinstance(tensor, quant.QuantizedTensor) == (encoded[name].ndim == 2), name
    models = {q: LlamaForCausalLM.from_weights(config, load_checkpoint(path, torch.float32, q == "gguf")[1],
                                               torch.device("cpu"), torch.float32, q) for q in ("gguf", "none")}
    assert all(m.quantized is not None for m in models["gguf"].modules() if isinstance(m, Linear))
    x = torch.randn(5, config.hidden_size)
    ref = models["none"].layers[0].mlp(x)
    torch.testing.assert_close(models["gguf"].layers[0].mlp(x), ref, atol=0.05 * ref.abs().max().item(), rtol=0.05)


@pytest.mark.parametrize("scheme,bits", [("int8", 8), ("int4", 4)])
def test_quantize_at_load(scheme: str, bits: int) -> None:
    w = torch.randn(48, 256) * 0.05
    t = quant.quantize(w, scheme)
    assert t.bits == bits and t.shape == w.shape and int(t.u.max()) < (1 << bits)
    step = (w.abs().amax() / 127) if scheme == "int8" else (w.amax() - w.amin()) / 15
    assert (t.dequantize() - w).abs().max() <= step * 0.51 + 1e-4  # half a step, plus float16 scales
    with pytest.raises(ValueError, match="in_features"):
        quant.quantize(torch.randn(4, 100), scheme)
    if scheme == "int4":  # 128 does not divide 576 (the default model's width): groups of 64
        assert quant.quantize(torch.randn(4, 576), scheme).d.unique(dim=1).shape[1] == 576 // 64


@pytest.fixture(scope="module")
def quantized_llm() -> Any:
    return LLM(dtype="float32", num_kv_blocks=256)  # the default: the GGUF file's own quantization


def test_default_gguf_stays_quantized_within_the_memory_target(quantized_llm: Any) -> None:
    model = quantized_llm.engine.runner.model
    assert quantized_llm.engine.config.weight_quantization(True) == "gguf"
    weights = model.quantized_weights()
    assert weights and model.lm_head.quantized is model.embed_tokens.quantized  # tied, one copy
    held = sum(w.nbytes for w in weights) + sum(p.numel() * p.element_size() for p in model.parameters())
    assert held <= 1.1 * Path(default_model_path()).stat().st_size


def test_quantized_greedy_equals_dequantized_where_the_margin_is_large(quantized_llm: Any, llm: Any) -> None:
    """Token for token against the dequantized float32 model for as long as that model's top-2 margin
    stays large (where the two may legitimately differ is where it is a near tie), and coherent."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    reference = llm.generate(EQUALITY_PROMPTS, params, use_tqdm=False)
    ours = quantized_llm.generate(EQUALITY_PROMPTS, params, use_tqdm=False)
    checked = 0
    for ref, out in zip(reference, ours):
        for step, (token, top) in enumerate(zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)):
            first, second = sorted(top.values(), reverse=True)[:2]
            if first - second < 0.5:
                break
            assert out.outputs[0].token_ids[step] == token, (ref.prompt[:30], step)
            checked += 1
    assert checked >= 2 * len(EQUALITY_PROMPTS), "too few confident tokens to compare"
    assert "Paris" in ours[1].outputs[0].text
    assert_idle(quantized_llm.engine)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_int8_int4_at_load_generate_coherently(scheme: str) -> None:
    llm = LLM(dtype="float32", quantization=scheme, num_kv_blocks=64)
    assert all(w.bits == (8 if scheme == "int8" else 4) for w in llm.engine.runner.model.quantized_weights()
               if w is not llm.engine.runner.model.lm_head.quantized)
    out = llm.generate(["The capital of France is"], greedy(8), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
