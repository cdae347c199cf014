"""The layer loop in one native call (native_forward.py) gives the same bits as llama.py's Python loop
over the same native kernels: logprobs and tokens, with decodes, prefill chunks and padding in one step."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.kernels import report
from tests.helpers import EQUALITY_PROMPTS, assert_idle, cpu_targets


def run(llm: LLM, native: bool) -> list[Any]:
    model = llm.engine.runner.model
    saved = model.native_forward
    model.native_forward = saved if native else None
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
        outs = llm.generate(EQUALITY_PROMPTS, params, use_tqdm=False)
    finally:
        model.native_forward = saved
    assert_idle(llm.engine)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype,engine_args", [
    ("bfloat16", dict(max_num_batched_tokens=48)),  # prefill chunks beside decodes
    ("float32", dict(scheduler="static", static_batch_size=3)),  # padding rows
    ("bfloat16", dict(max_num_batched_tokens=48, kv_cache_dtype="fp8")),  # a quantized KV pool
], ids=["bf16-chunked", "fp32-static", "bf16-fp8-kv"])
def test_native_layer_loop_equals_python_loop(dtype: str, engine_args: dict) -> None:
    llm = LLM(dtype=dtype, num_kv_blocks=128, enable_prefix_caching=False, **engine_args)
    if llm.engine.runner.model.native_forward is None:
        pytest.skip("no native layer loop here (no compiler, no simd.h section for the CPU, or MINIVLLM_NO_KERNELS)")
    assert run(llm, native=True) == run(llm, native=False)


@pytest.mark.parametrize("target", cpu_targets()[1:])
def test_smaller_targets_run_the_layer_loop_natively(target: str, monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture) -> None:
    """MINIVLLM_CPU_ARCH=x86-64-v3 on a larger CPU: the engine says at start that every kernel family runs
    natively for that target, and its layer loop gives the Python loop's bits there too."""
    monkeypatch.setenv("MINIVLLM_CPU_ARCH", target)
    capfd.readouterr()
    llm = LLM(dtype="bfloat16", num_kv_blocks=128, enable_prefix_caching=False, max_num_batched_tokens=48)
    line = report(torch.device("cpu"), torch.bfloat16)
    assert line.startswith(f"minivllm: kernels for {target} (avx2") and line.endswith("; torch for: nothing")
    assert capfd.readouterr().err.splitlines().count(line) == 1
    assert llm.engine.runner.model.native_forward is not None
    assert run(llm, native=True) == run(llm, native=False)
