"""Batch invariance on the real model in bfloat16 (issue 12): a request gets the same tokens and the same
logits, held to equality, whatever else runs with it, however its prompt is chunked, on a prefix-cache
hit or miss, after preemption, with caching off and under the static scheduler; greedy and seeded.

The logits are compared through each step's top-5 logprobs, which are functions of the whole logit row:
equal floats there and equal tokens everywhere mean the rows did not move by a bit on the way."""
from __future__ import annotations

from typing import Any

import pytest

from minivllm import LLM, SamplingParams
from tests.helpers import EQUALITY_PROMPTS, assert_idle

PROBES = EQUALITY_PROMPTS  # one token to 200+ tokens, several languages
CROWD = [f"Write a short story about a {a} who finds a {b}." * r
         for r, (a, b) in enumerate([("cat", "key"), ("robot", "map"), ("sailor", "star"), ("child", "door"),
                                     ("baker", "letter"), ("king", "coin"), ("fox", "song"), ("miner", "lamp")], 1)]


def probe_params(seed: int | None = None) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True, logprobs=5)


def run(llm: LLM, crowd: bool = False, seeded: bool = False) -> list[tuple[list[int], list[Any]]]:
    """The probes' (tokens, per-step logprobs), run together, among the crowd's requests if asked."""
    prompts = list(PROBES)
    params = [probe_params(seed=100 + i if seeded else None) for i in range(len(PROBES))]
    if crowd:  # the crowd first, with other lengths: the probes sit at other positions in every step
        prompts = CROWD + prompts
        params = [SamplingParams(temperature=0.7, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(CROWD))] + params
    outs = llm.generate(prompts, params, use_tqdm=False)[-len(PROBES):]
    assert_idle(llm.engine)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def bf16(**engine_args: Any) -> LLM:
    llm = LLM(dtype="bfloat16", **{"num_kv_blocks": 256, **engine_args})
    if not llm.engine.runner.batch_invariant:
        pytest.skip("the native kernels are not in use here (no compiler, or MINIVLLM_NO_KERNELS): "
                    "the torch kernels are not batch-invariant")
    return llm


@pytest.fixture(scope="module")
def reference() -> dict[bool, list]:
    """Each probe alone on a fresh engine (no cache), greedy and seeded."""
    refs = {}
    for seeded in (False, True):
        llm = bf16(enable_prefix_caching=False)
        refs[seeded] = [run_one(llm, i, seeded) for i in range(len(PROBES))]
    return refs


def run_one(llm: LLM, i: int, seeded: bool) -> tuple[list[int], list[Any]]:
    out = llm.generate([PROBES[i]], probe_params(seed=100 + i if seeded else None), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].logprobs


SETTINGS = {
    "together": (dict(), False),
    "crowd": (dict(), True),
    "budget-32": (dict(max_num_batched_tokens=32), True),
    "preemption": (dict(num_kv_blocks=30, max_model_len=320), True),
    "caching-off": (dict(enable_prefix_caching=False), True),
    "static": (dict(scheduler="static", static_batch_size=5), True),
}


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", SETTINGS)
def test_same_request_same_logits(name: str, seeded: bool, reference: dict[bool, list]) -> None:
    engine_args, crowd = SETTINGS[name]
    llm = bf16(**engine_args)
    first = run(llm, crowd=crowd, seeded=seeded)
    again = run(llm, crowd=crowd, seeded=seeded)  # prefix-cache hits where caching is on
    for i, (ref, got, repeat) in enumerate(zip(reference[seeded], first, again)):
        assert got == ref, f"{name}: probe {i} ({PROBES[i][:30]!r}) differs from its run alone"
        assert repeat == ref, f"{name}: probe {i} differs on the repeat (prefix-cache hit)"
    stats = llm.engine.get_stats()
    if name == "preemption":
        assert stats["num_preemptions"] > 0, "the pool is small enough to force preemption"
    if engine_args.get("enable_prefix_caching", True) and name != "static":
        assert stats["prefix_cache_hits"] > 0, "the repeat hit the prefix cache"
