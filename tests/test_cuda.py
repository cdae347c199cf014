"""The CUDA path (issue 53): the Triton kernels against their torch twins and held to batch invariance by
equality, and on a GPU the engine itself: float32 greedy equal to transformers, bfloat16 alone equal to
in a crowd of 32, and the decode step's CUDA graphs equal to eager steps.

Without CUDA the kernel tests run on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set here
before the kernels are first imported) at tiny sizes. The interpreter rounds to bfloat16 by truncation
and its tl.dot on bfloat16 is wrong, so there the kernels are checked in float16 and float32 (the same
code paths; on a GPU bfloat16 too). The engine tests need a GPU and are skipped without one; their
checkpoints are random ones made here with transformers, with the tokenizer in MINIVLLM_TOKENIZER_DIR or
.gpu-kit/tok (../shared/gpu/prepare.sh).
"""
from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, at first import

triton_kernels = pytest.importorskip("minivllm.model.triton_kernels", reason="Triton is not installed")
from minivllm.model.cuda_graphs import batch_buckets  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _row_invariant_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    """tl.dot as a GPU's tensor cores compute it: each element's products summed in K order, the same for
    every row. The interpreter's own np.matmul goes to OpenBLAS, whose AVX2 sgemm sums a row in an order that
    depends on where the row sits in the tile, which no GPU does."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    products = a.data.astype(np.float32)[:, :, None] * b.data.astype(np.float32)[None, :, :]
    return TensorHandle(products.sum(axis=1, dtype=d.data.dtype) + d.data, d.dtype.scalar)


if not HAS_CUDA:
    from triton.runtime.interpreter import InterpreterBuilder

    InterpreterBuilder.create_dot = _row_invariant_dot
DOT_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else [])
ROW_DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * scale).to(DEVICE, dtype)


# -- kernels against their twins, and invariance ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_gemm_matches_f_linear_and_a_row_never_depends_on_the_row_count(dtype: torch.dtype) -> None:
    n, k = 96, 1100  # two column tiles, K split in two (gemm_split), a ragged last K step
    assert triton_kernels.gemm_split(n, k) == 2
    x, w, b = randn(70, k, dtype=dtype), randn(n, k, dtype=dtype, scale=0.03), randn(n, dtype=dtype)
    out = triton_kernels.gemm(x, w, b)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), atol=2e-2, rtol=2e-2)
    for rows in (1, 3, 64, 65):
        assert torch.equal(triton_kernels.gemm(x[:rows], w, b), out[:rows]), rows
    assert torch.equal(triton_kernels.gemm(x[40:41], w, b), out[40:41])  # a row's place in its tile is moot
    assert triton_kernels.gemm(x[:0], w, None).shape == (0, n)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_add_rms_norm_equals_the_twin(dtype: torch.dtype) -> None:
    from minivllm.model.decoder import RMSNorm

    delta, residual = randn(5, 200, dtype=dtype), randn(5, 201, dtype=dtype)[:, :200]  # a strided residual too
    norm = RMSNorm(200, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    ours, theirs = residual.clone(), residual.clone()
    out = triton_kernels.add_rms_norm(delta, ours, norm.weight, 1e-5)
    expected = norm(delta, theirs)
    assert torch.equal(ours, theirs)  # residual += delta, in place, rounded as torch rounds it
    torch.testing.assert_close(out, expected, atol=0, rtol=2 ** -6)  # the sum's order: a rounding or two
    assert torch.equal(triton_kernels.add_rms_norm(None, ours[2:3].clone(), norm.weight, 1e-5), out[2:3])


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_head_rms_norm_in_place_on_a_view(dtype: torch.dtype) -> None:
    from minivllm.model.decoder import RMSNorm

    qkv = randn(4, 3 * 64, dtype=dtype)
    q = qkv[:, :64].view(4, 2, 32)  # as the fused projection's output gives it
    norm = RMSNorm(32, 1e-6).to(DEVICE, dtype)
    expected, rest = norm(q.clone()), qkv[:, 64:].clone()
    triton_kernels.head_rms_norm_(q, norm.weight, 1e-6)
    torch.testing.assert_close(q, expected, atol=0, rtol=2 ** -6)
    assert torch.equal(qkv[:, 64:], rest)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("rotary_dim", [32, 24])  # whole heads, and partial rotary
def test_rotary_in_place_on_views_matches_the_twin(dtype: torch.dtype, rotary_dim: int) -> None:
    from minivllm.model.decoder import apply_rotary

    qkv = randn(5, 4 * 32, dtype=dtype)
    q, k = qkv[:, :64].view(5, 2, 32), qkv[:, 64:96].view(5, 1, 32)
    angles = torch.arange(5, device=DEVICE)[:, None] * torch.linspace(0.1, 1.0, rotary_dim // 2, device=DEVICE)
    cos, sin = angles.cos(), angles.sin()
    expected_q, expected_k, v = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), qkv[:, 96:].clone()
    triton_kernels.rotary_(q, k, cos, sin)
    atol = 1e-2 if dtype == torch.float16 else 5e-2  # the twin rounds in the dtype, we in float32
    torch.testing.assert_close(q, expected_q, atol=atol, rtol=1e-2)
    torch.testing.assert_close(k, expected_k, atol=atol, rtol=1e-2)
    assert torch.equal(qkv[:, 96:], v)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul_matches_the_twin(dtype: torch.dtype, act: str) -> None:
    gate_up = randn(3, 2 * 1100, dtype=dtype, scale=3.0)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    torch.testing.assert_close(triton_kernels.act_and_mul(gate_up, act).float(), expected, atol=3e-2, rtol=1e-2)


def test_write_kv_skips_padded_rows() -> None:
    from minivllm.model.attention import kv_cache_shapes

    k_shape, v_shape = kv_cache_shapes(4, 16, 2, 32)
    k_cache = torch.zeros(k_shape, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros(v_shape, dtype=torch.float16, device=DEVICE)
    k, v = randn(3, 2, 32, dtype=torch.float16), randn(3, 2, 33, dtype=torch.float16)[..., :32]
    blocks, offsets = torch.tensor([2, -1, 0], device=DEVICE), torch.tensor([5, 7, 15], device=DEVICE)
    triton_kernels.write_kv(k, v, blocks, offsets, k_cache, v_cache)
    assert torch.equal(k_cache[2, :, :, 5], k[0]) and torch.equal(v_cache[0, :, 15], v[2])
    assert int((k_cache != 0).sum()) == int((k[[0, 2]] != 0).sum())  # the padded row wrote nothing


HEADS, KV_HEADS, HEAD_DIM, BLOCK, POOL, LENGTH = 6, 2, 32, 16, 40, 150  # a group of 3: padded to 4 rows


def _pool(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from minivllm.model.attention import kv_cache_shapes

    k_shape, v_shape = kv_cache_shapes(POOL, BLOCK, KV_HEADS, HEAD_DIM)
    table = torch.randperm(POOL, generator=torch.Generator().manual_seed(1))[:10].to(DEVICE)
    queries = randn(LENGTH, HEADS, HEAD_DIM, dtype=dtype)
    return randn(*k_shape, dtype=dtype), randn(*v_shape, dtype=dtype), table, queries


def _attend(q: torch.Tensor, pool, spans: list[tuple[int, int, int]], **switches: Any) -> torch.Tensor:
    """spans: (first row, rows, context of the first query), all through the one block table."""
    k_cache, v_cache, table, _ = pool
    out = torch.zeros_like(q)
    starts, lens, ctx0 = (torch.tensor(col, device=DEVICE) for col in zip(*spans))
    triton_kernels.paged_attention(q, k_cache, v_cache, table[None].repeat(len(spans), 1), starts, lens, ctx0,
                                   max(lens.tolist()), 0.2, out, **switches)
    return out


def _reference(pool, i: int, window: int | None, softcap: float | None) -> torch.Tensor:
    """Query i (at position i) over positions 0..i, in float64."""
    k_cache, v_cache, table, q = pool
    keys = k_cache[table].permute(1, 0, 3, 2).flatten(1, 2)[:, :i + 1].double().repeat_interleave(HEADS // KV_HEADS, 0)
    values = v_cache[table].transpose(0, 1).flatten(1, 2)[:, :i + 1].double().repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (keys @ q[i].double()[:, :, None])[..., 0] * 0.2
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if window is not None:
        scores[:, :max(0, i + 1 - window)] = float("-inf")
    return (scores.softmax(-1)[:, None, :] @ values)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if HAS_CUDA else []))
@pytest.mark.parametrize("window, softcap", [(None, None), (40, None), (None, 3.0)])
def test_paged_attention_gives_a_token_the_same_bits_in_a_prefill_a_chunk_and_a_decode(
        dtype: torch.dtype, window: int | None, softcap: float | None) -> None:
    pool = _pool(dtype)
    q = pool[3]
    switches = dict(window=window, softcap=softcap)
    prefill = _attend(q, pool, [(0, LENGTH, 1)], **switches)
    atol = 3e-3 if dtype == torch.float16 else 2e-2  # bf16: 8 bits, the probabilities rounded to it too
    for i in range(0, LENGTH, 7):
        torch.testing.assert_close(prefill[i].double(), _reference(pool, i, window, softcap), atol=atol, rtol=1e-2)
    chunk = _attend(q[100:].contiguous(), pool, [(0, 50, 101)], **switches)  # after a cached prefix of 100
    assert torch.equal(chunk, prefill[100:])
    decodes = _attend(q[[149, 3, 77, 64]].contiguous(), pool, [(0, 1, 150), (1, 1, 4), (2, 1, 78), (3, 1, 65)],
                      **switches)  # one batch of decodes at other lengths
    assert torch.equal(decodes, prefill[[149, 3, 77, 64]])
    mixed = _attend(q[[77, *range(100, 130)]].contiguous(), pool, [(0, 1, 78), (1, 30, 101)], **switches)
    assert torch.equal(mixed, prefill[[77, *range(100, 130)]])  # a decode beside a chunk, as a step packs them


def test_decode_graph_buckets() -> None:
    assert batch_buckets(256)[:7] == [1, 2, 4, 8, 16, 24, 32] and batch_buckets(256)[-1] == 256
    assert batch_buckets(3) == [1, 2, 3] and batch_buckets(20) == [1, 2, 4, 8, 16, 20]


# -- the engine on a GPU ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_tokenizer_dir() -> Path:
    candidates = [os.environ.get("MINIVLLM_TOKENIZER_DIR"), Path(__file__).parents[1] / ".gpu-kit" / "tok"]
    path = next((Path(p) for p in candidates if p and (Path(p) / "tokenizer.json").exists()), None)
    if path is None:
        pytest.skip("no tokenizer: set MINIVLLM_TOKENIZER_DIR or run ../shared/gpu/prepare.sh")
    return path


@pytest.fixture(scope="module")
def checkpoints(gpu_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Two random families (Llama: GQA, no biases; Qwen2: q/k/v biases, tied head), with HF's greedy."""
    from tests.helpers import HFGreedy, save_tiny_model, tiny_config

    made = {}
    for kind in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(kind)
        made[kind] = (path, HFGreedy(save_tiny_model(tiny_config(kind), path, gpu_tokenizer_dir)))
    return made


def _engine(path: Path, **engine_args: Any):
    from minivllm import LLM

    return LLM(str(path), device="cuda", **{"num_kv_blocks": 512, "max_num_seqs": 48, **engine_args})


def _release(llm) -> None:
    llm.engine.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _greedy(max_tokens: int):
    from minivllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def _runs(outputs) -> list[tuple[list[int], Any]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


CROWD = [f"Tell me about the {w} and the {v}." * r for r, (w, v) in
         enumerate([("sea", "moon"), ("fox", "hen"), ("king", "coin"), ("lamp", "road")] * 6, 1)]  # 24 others


@gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_float32_greedy_equals_transformers_on_cuda(checkpoints, kind: str) -> None:
    from tests.helpers import EQUALITY_PROMPTS, mismatch_report

    path, hf_greedy = checkpoints[kind]
    llm = _engine(path, dtype="float32")
    outputs = llm.generate(EQUALITY_PROMPTS, _greedy(8), use_tqdm=False)
    _release(llm)
    references = hf_greedy.many([o.prompt_token_ids for o in outputs], 8)
    for o, ref in zip(outputs, references):
        assert o.outputs[0].token_ids == ref, mismatch_report(hf_greedy.model, o.prompt_token_ids,
                                                              o.outputs[0].token_ids, ref)


@gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_alone_equals_in_a_crowd_of_32(checkpoints, kind: str) -> None:
    from tests.helpers import EQUALITY_PROMPTS

    probes = EQUALITY_PROMPTS[:8]
    llm = _engine(checkpoints[kind][0], dtype="bfloat16", enable_prefix_caching=False)
    assert llm.engine.runner.batch_invariant
    alone = [_runs(llm.generate([p], _greedy(24), use_tqdm=False))[0] for p in probes]
    crowd = _runs(llm.generate(CROWD + probes, [_greedy(8 + i) for i in range(len(CROWD))] + [_greedy(24)] * 8,
                               use_tqdm=False))[len(CROWD):]
    _release(llm)
    assert [a == c for a, c in zip(alone, crowd)] == [True] * len(probes)


@gpu
def test_decode_graphs_equal_eager_steps(checkpoints) -> None:
    from tests.helpers import EQUALITY_PROMPTS

    path = checkpoints["llama"][0]
    runs = {}
    for eager in (False, True):
        llm = _engine(path, dtype="bfloat16", enforce_eager=eager, max_num_seqs=16)
        assert (llm.engine.runner.graphs is None) == eager
        runs[eager] = _runs(llm.generate(EQUALITY_PROMPTS + CROWD[:5], _greedy(20), use_tqdm=False))
        _release(llm)
    assert runs[False] == runs[True]


def test_the_decoder_on_the_cuda_entries_gives_a_token_the_same_logits_in_a_prefill_and_a_decode() -> None:
    """The whole forward through the table's CUDA entries (here on whatever DEVICE is, in float16): a
    prompt's last token alone in a prefill, then as a decode beside another sequence's, the same bits;
    and near the torch twins' logits. Biases, q/k norms and a sliding window on: their paths run too."""
    from minivllm.model import cuda_kernels
    from minivllm.model.batch import BatchInputs, SeqSpan
    from minivllm.model.decoder import MLP, Attention, CausalLM, Linear, RMSNorm
    from minivllm.model.model_config import ModelConfig
    from minivllm.model.runner import ModelRunner

    config = ModelConfig("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
                         attention_bias=True, qk_norm=True, sliding_window=8, sliding_layers=[0])
    torch.manual_seed(0)
    model = CausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.2)
    model = model.to(DEVICE, torch.float16).eval()

    def runner(cuda_entries: bool) -> ModelRunner:
        run = ModelRunner(model, 16, 16, torch.device(DEVICE), torch.float16)
        ops = cuda_kernels.TritonLayerOps() if cuda_entries else None
        for module in model.modules():
            if isinstance(module, Linear):
                module.native = cuda_kernels.TritonGemm() if cuda_entries else None
                module.packed = module.native.pack(module.weight, module.bias) if cuda_entries else None
            elif isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops
        run.attention_kernel = cuda_kernels.TritonAttention() if cuda_entries else None
        return run

    prompt, other = [(7 * i) % 256 for i in range(20)], [(3 * i + 1) % 256 for i in range(8)]
    alone = runner(True).execute(BatchInputs([SeqSpan(prompt, 0, [0, 1], num_logits=1)]))
    together = runner(True)
    together.execute(BatchInputs([SeqSpan(other, 0, [5], num_logits=1), SeqSpan(prompt[:-1], 0, [0, 1])]))
    step = together.execute(BatchInputs([SeqSpan([9], 8, [5], num_logits=1),
                                         SeqSpan(prompt[-1:], 19, [0, 1], num_logits=1)]))
    assert torch.equal(step[1], alone[0])
    twin = runner(False).execute(BatchInputs([SeqSpan(prompt, 0, [0, 1], num_logits=1)]))
    torch.testing.assert_close(alone, twin, atol=0.1, rtol=0.05)
