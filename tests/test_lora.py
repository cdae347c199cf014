"""LoRA adapters (issue 32) on the default model: random adapters of rank 8 made here, in PEFT's layout
and converted by llama.cpp's own converter; float32 greedy output equal to PEFT's forward on
transformers; a step mixing adapters gives each request its tokens alone (bf16, by equality); the
prefix cache keeps adapters apart; bad adapters are refused by name; the server's endpoints."""
from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm import LLM, LoRARequest
from minivllm.lora.adapter import PEFT_CONFIG, PEFT_WEIGHTS, PROJECTIONS, read_adapter
from minivllm.lora.extension import LoRAAdapters
from tests.helpers import EQUALITY_PROMPTS, LONG_PROMPT, HFGreedy, assert_idle, greedy, layer_loop_outputs

RANK, NUM_TOKENS = 8, 8
PROMPTS = EQUALITY_PROMPTS[1:3]


def projection_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each adaptable projection of a llama.py model."""
    cfg = model.config
    hidden, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def write_peft_adapter(path: Path, model: Any, seed: int, rank: int = RANK, modules: tuple[str, ...] = PROJECTIONS,
                       layers: range | None = None, in_features: int | None = None, **config: Any) -> Path:
    """A random LoRA adapter saved as PEFT saves one: adapter_config.json and adapter_model.safetensors
    with PEFT's tensor names. A and B ~ N(0, 0.02^2): small enough to keep the text readable, large
    enough to change it."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(model)
    tensors = {}
    for layer in layers if layers is not None else range(model.config.num_hidden_layers):
        for m in modules:
            out, inp = shapes.get(m, (model.config.hidden_size, model.config.hidden_size))
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features or inp, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / PEFT_WEIGHTS))
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                "target_modules": list(modules), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
                "fan_in_fan_out": False, "base_model_name_or_path": None, **config}
    (path / PEFT_CONFIG).write_text(json.dumps(settings))
    return path


def _lora_llm(**kwargs: Any) -> LLM:
    return LLM(enable_lora=True, max_loras=4, max_cpu_loras=8, max_lora_rank=16, num_kv_blocks=256, **kwargs)


@pytest.fixture(scope="module")
def f32_llm() -> Iterator[LLM]:
    """A float base (dequantized, float32): the reference comparisons."""
    yield _lora_llm(dtype="float32", quantization="none")


@pytest.fixture(scope="module")
def bf16_llm() -> Iterator[LLM]:
    """The GGUF file's quantized base in bf16: the batch-invariance checks."""
    yield _lora_llm(dtype="bfloat16")


@pytest.fixture(scope="module")
def adapters(f32_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    """Three random rank-8 adapters: the first on every projection, the others on a few."""
    model, root = f32_llm.engine.runner.model, tmp_path_factory.mktemp("adapters")
    paths = [write_peft_adapter(root / "all", model, seed=1),
             write_peft_adapter(root / "attn", model, seed=2, modules=("q_proj", "v_proj", "o_proj")),
             write_peft_adapter(root / "mlp", model, seed=3, modules=("gate_proj", "down_proj"), use_rslora=True)]
    return [LoRARequest(p.name, i, str(p)) for i, p in enumerate(paths, start=1)]


def require_batch_invariance(llm: LLM) -> None:
    if not llm.engine.runner.batch_invariant:
        pytest.skip("the native kernels are not in use here (no compiler, or MINIVLLM_NO_KERNELS): "
                    "the torch kernels are not batch-invariant")


def tokens(llm: LLM, prompts: list[str], lora: Any = None, n: int = NUM_TOKENS) -> list[list[int]]:
    outs = llm.generate(prompts, greedy(n), use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


def peft_greedy(hf_model: Any, adapter: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """PEFT's own forward of the adapter on transformers' model (float32), then the model restored."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(hf_model, str(adapter))
    try:
        return HFGreedy(peft_model).many(prompts, n)
    finally:
        peft_model.unload()


def test_float32_greedy_equals_peft_forward(f32_llm: LLM, adapters: list[LoRARequest], hf_model: Any) -> None:
    prompts = PROMPTS[:1]
    ids = [f32_llm.engine.tokenizer.encode(p) for p in prompts]
    base = tokens(f32_llm, prompts)
    outputs = {}
    for adapter in adapters[::2]:  # every projection; and gate/down with rsLoRA's scaling
        outputs[adapter.lora_name] = ours = tokens(f32_llm, prompts, adapter)
        assert ours == peft_greedy(hf_model, Path(adapter.lora_path), ids, NUM_TOKENS), adapter.lora_name
    assert outputs["all"] != base, "the adapter should change the output"
    assert_idle(f32_llm.engine)


def test_llama_cpp_gguf_adapter_equals_peft(f32_llm: LLM, adapters: list[LoRARequest], hf_model: Any,
                                            tmp_path: Path) -> None:
    """convert_lora_to_gguf.py's file (Llama's q/k rows in llama.cpp's order) computes what PEFT's does."""
    from tests.llama_cpp import convert_lora

    # What the converter reads of the base: its config.json, as save_pretrained writes it, less what
    # transformers adds for a GGUF file (its quantization) and with the class it leaves out.
    config = copy.deepcopy(hf_model.config)
    config.architectures = [type(hf_model).__name__]
    del config.quantization_config
    config.save_pretrained(tmp_path / "base")
    gguf = convert_lora(Path(adapters[0].lora_path), tmp_path / "base", tmp_path / "all.gguf")
    cfg = f32_llm.engine.model_config
    ours = read_adapter(gguf, cfg.num_attention_heads, cfg.num_key_value_heads)
    theirs = read_adapter(adapters[0].lora_path, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert ours.factors.keys() == theirs.factors.keys()
    for key, f in theirs.factors.items():  # f32: the same numbers, q/k rows back in Hugging Face's order
        assert torch.equal(ours.factors[key].a, f.a) and torch.equal(ours.factors[key].b, f.b), key
    assert tokens(f32_llm, PROMPTS[:1], LoRARequest("all-gguf", 10, str(gguf))) == \
        tokens(f32_llm, PROMPTS[:1], adapters[0])
    assert_idle(f32_llm.engine)


def test_mixed_batch_gives_each_request_its_tokens_alone(bf16_llm: LLM, adapters: list[LoRARequest]) -> None:
    """bf16 on the quantized base: three adapters and the base in the same steps, by equality."""
    require_batch_invariance(bf16_llm)
    prompts = EQUALITY_PROMPTS[1:5]
    loras = [*adapters, None]
    alone = [tokens(bf16_llm, [p], lora)[0] for p, lora in zip(prompts, loras)]
    assert tokens(bf16_llm, prompts[::-1], loras[::-1]) == alone[::-1]
    assert_idle(bf16_llm.engine)


def test_max_loras_caps_the_adapters_of_a_step(bf16_llm: LLM, adapters: list[LoRARequest]) -> None:
    engine = bf16_llm.engine
    engine.config.max_loras = 2
    try:
        ids = [engine.add_request(None, p, greedy(4), lora_request=a)
               for p, a in zip(PROMPTS * 2, adapters + adapters[::-1])]
        finished, ran = set(), set()
        while engine.has_unfinished_requests():
            finished |= {o.request_id for o in engine.step() if o.finished}
            running = {s.lora.request.lora_name for s in engine.scheduler.running}
            assert len(running) <= 2, f"adapters running at once: {running}"
            ran |= running
        assert finished == set(ids) and ran == {a.lora_name for a in adapters}
    finally:
        engine.config.max_loras = 4
    assert_idle(engine)


def test_prefix_cache_keeps_adapters_apart(bf16_llm: LLM, adapters: list[LoRARequest]) -> None:
    """A prompt of several full blocks under one adapter, then another, then the base: no hit; then the
    first adapter again: a hit, and the same tokens."""
    require_batch_invariance(bf16_llm)
    engine = bf16_llm.engine
    bm = engine.block_manager
    prompt = LONG_PROMPT[:300]
    first = tokens(bf16_llm, [prompt], adapters[0], n=2)
    hits = bm.prefix_hits
    tokens(bf16_llm, [prompt], adapters[1], n=2)
    tokens(bf16_llm, [prompt], n=2)
    assert bm.prefix_hits == hits, "another adapter (or the base) was served the first adapter's KV"
    assert tokens(bf16_llm, [prompt], adapters[0], n=2) == first
    assert bm.prefix_hits >= hits + 3 * bm.block_size, "the same adapter and prompt should hit its blocks"
    assert_idle(engine)


@pytest.mark.parametrize("base", ["bf16_llm", "f32_llm"])  # the GGUF's quantized GEMMs; the float GEMM
def test_native_layer_loop_adds_adapters_as_the_python_loop(base: str, adapters: list[LoRARequest],
                                                            request: pytest.FixtureRequest) -> None:
    """csrc/forward.c adds a step's adapters with the same bits as the Python loop's lora hooks: one batch
    mixing three adapters and the base (one prompt both with and without an adapter), prefills and decodes."""
    llm = request.getfixturevalue(base)
    if llm.engine.runner.model.native_forward is None:
        pytest.skip("no native layer loop here (no compiler, no simd.h section for the CPU, or MINIVLLM_NO_KERNELS)")
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], EQUALITY_PROMPTS[0], PROMPTS[1]]
    loras = [None, adapters[0], adapters[1], adapters[0], adapters[2]]
    native = layer_loop_outputs(llm, True, loras, prompts, max_tokens=4)
    assert native == layer_loop_outputs(llm, False, loras, prompts, max_tokens=4)
    assert native[0] != native[1], "the adapter should change the output"


def test_kernel_matches_twin_and_is_batch_invariant(bf16_llm: LLM, f32_llm: LLM,
                                                    adapters: list[LoRARequest]) -> None:
    """csrc/lora.c against lora_twin on a real adapter's layout, and a row alone against the row among
    other adapters' rows."""
    for llm in (bf16_llm, f32_llm):
        manager, context = llm.engine.extension(LoRAAdapters).manager, llm.engine.runner.model.lora
        loaded = [manager.get(a) for a in adapters]
        if context.kernel is None:
            pytest.skip("no native kernels here (MINIVLLM_NO_KERNELS or no compiler)")
        dtype = llm.engine.dtype
        for index in (0, 2, 3):  # layer 0's qkv, gate_up, down
            hook = manager.targets[index].linear.lora
            k, n = manager.targets[index].linear.in_features, manager.targets[index].linear.out_features
            x, base = torch.randn(9, k).to(dtype), torch.randn(9, n).to(dtype)
            spans = [(0, 3, loaded[0]), (3, 1, loaded[1]), (5, 4, loaded[2])]  # row 4: the base
            with context.step(spans):
                native = hook(x, base.clone())
            kernel, context.kernel = context.kernel, None
            try:
                with context.step(spans):
                    twin = hook(x, base.clone())
            finally:
                context.kernel = kernel
            assert torch.equal(native[4], base[4])
            tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(native.float(), twin.float(), atol=tolerance, rtol=tolerance)
            with context.step([(0, 1, loaded[2])]):
                alone = hook(x[6:7], base[6:7].clone())
            assert torch.equal(alone[0], native[6])


def test_bad_adapters_are_refused_by_name(f32_llm: LLM, tmp_path: Path) -> None:
    model = f32_llm.engine.runner.model
    cases = {
        "rank 32 is above --max-lora-rank 16": write_peft_adapter(tmp_path / "big", model, 4, rank=32, layers=range(1)),
        "layer 99, a module the model lacks": write_peft_adapter(tmp_path / "deep", model, 4, layers=range(99, 100)),
        "target_modules ['lm_head']": write_peft_adapter(tmp_path / "head", model, 4, modules=("lm_head",),
                                                         layers=range(1)),
        "shape mismatch": write_peft_adapter(tmp_path / "wide", model, 4, layers=range(1), in_features=100),
    }
    corrupt = write_peft_adapter(tmp_path / "corrupt", model, 4, layers=range(1))
    weights = corrupt / PEFT_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    cases["corrupt"] = corrupt
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    cases["cannot read it as GGUF"] = bad_gguf
    cases["no such adapter"] = tmp_path / "missing"
    for i, (message, path) in enumerate(cases.items(), start=100):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            f32_llm.engine.extension(LoRAAdapters).add_lora(LoRARequest(path.name, i, str(path)))
        with pytest.raises(ValueError, match="prompt 0"):
            f32_llm.generate(["Hi"], greedy(2), use_tqdm=False, lora_request=LoRARequest(path.name, i, str(path)))
    registered = {r.lora_name for r in f32_llm.engine.extension(LoRAAdapters).list_loras()}
    assert not registered & {p.name for p in cases.values()}
    assert len(tokens(f32_llm, ["Hi"], n=2)[0]) == 2  # still serving
    assert_idle(f32_llm.engine)


def test_server_endpoints(f32_llm: LLM, adapters: list[LoRARequest]) -> None:
    from fastapi.testclient import TestClient

    from minivllm.frontend.async_engine import AsyncEngine
    from minivllm.server.api import ServerOptions, build_app

    engine, loras = f32_llm.engine, f32_llm.engine.extension(LoRAAdapters)
    expected = f32_llm.generate([PROMPTS[0]], greedy(NUM_TOKENS), use_tqdm=False,
                                lora_request=adapters[1])[0].outputs[0].text
    for a in loras.list_loras():  # the offline tests' registrations: start from none
        loras.remove_lora(a.lora_name)
    loras.add_loras([adapters[0]])  # as --lora-modules does before the server starts
    app = build_app(AsyncEngine(engine), ServerOptions("base", lora_modules=[adapters[0]]))
    with TestClient(app) as http:
        def complete(model: str) -> Any:
            return http.post("/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": NUM_TOKENS,
                                                      "temperature": 0, "min_tokens": NUM_TOKENS, "ignore_eos": True})

        assert complete("attn").status_code == 404
        assert complete("attn").json()["error"]["code"] == "model_not_found"
        load = {"lora_name": "attn", "lora_path": adapters[1].lora_path}
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 400  # already loaded
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert models.keys() == {"base", "all", "attn"} and models["attn"]["parent"] == "base"
        answer = complete("attn").json()
        assert answer["model"] == "attn"
        assert answer["choices"][0]["text"] == expected
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "no such adapter" in bad.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 404
        assert complete("attn").status_code == 404
        assert complete("base").status_code == 200  # still serving
    assert_idle(engine)


def test_served_through_the_engine_core_process(bf16_llm: LLM, adapters: list[LoRARequest], tmp_path: Path) -> None:
    """`minivllm serve`'s default: the adapters cross the process boundary (started with --lora-modules,
    loaded and unloaded at run time) and give what the offline engine gives (bf16, same kernels)."""
    import httpx

    from tests.test_server import start_server

    every, attn = adapters[0], adapters[1]
    expected = {a.lora_name: bf16_llm.generate([PROMPTS[0]], greedy(NUM_TOKENS), use_tqdm=False, lora_request=a)[0]
                .outputs[0].text for a in (every, attn)}
    server = start_server(tmp_path / "server.log", "--dtype", "bfloat16", "--enable-lora", "--max-loras", "2",
                          "--lora-modules", f"{every.lora_name}={every.lora_path}")
    try:
        def complete(model: str) -> httpx.Response:
            return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": model, "prompt": PROMPTS[0], "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True})

        assert complete(every.lora_name).json()["choices"][0]["text"] == expected[every.lora_name]
        assert complete(attn.lora_name).status_code == 404
        load = {"lora_name": attn.lora_name, "lora_path": attn.lora_path}
        assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
        assert complete(attn.lora_name).json()["choices"][0]["text"] == expected[attn.lora_name]
        bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "no such adapter" in bad.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": attn.lora_name}).status_code == 200
        assert complete(attn.lora_name).status_code == 404
    finally:
        assert server.stop() == 0, server.log.read_text()
