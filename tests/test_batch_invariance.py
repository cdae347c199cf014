"""Batch invariance on the real model in bfloat16 (issue 12): a request gets the same tokens and the same
logits, held to equality, whatever else runs with it, however its prompt is chunked, on a prefix-cache
hit or miss, after preemption, with caching off and under the static scheduler; greedy and seeded.

The logits are compared through each step's top-5 logprobs, which are functions of the whole logit row:
equal floats there and equal tokens everywhere mean the rows did not move by a bit on the way."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from minivllm import LLM, SamplingParams
from tests.helpers import EQUALITY_PROMPTS, assert_idle

PROBES = EQUALITY_PROMPTS  # one token to 200+ tokens, several languages
CROWD = [f"Write a short story about a {a} who finds a {b}." * r
         for r, (a, b) in enumerate([("cat", "key"), ("robot", "map"), ("sailor", "star"), ("child", "door"),
                                     ("baker", "letter"), ("king", "coin"), ("fox", "song"), ("miner", "lamp")], 1)]


# The crowd's requests end one by one (8, 11, ... 29 tokens) while the probes decode theirs: every probe
# shares steps with a shrinking batch, at shifting positions, for all of its 16 tokens.
PROBE_TOKENS = 16


def probe_params(i: int) -> SamplingParams:
    """Probe i of PROBES runs greedy, probe len(PROBES) + i the same prompt seeded."""
    if i < len(PROBES):
        return SamplingParams(temperature=0, max_tokens=PROBE_TOKENS, ignore_eos=True, logprobs=5)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=PROBE_TOKENS, ignore_eos=True,
                          logprobs=5)


NUM_PROBES = 2 * len(PROBES)


def result(out) -> tuple[list[int], list[Any]]:
    return out.outputs[0].token_ids, out.outputs[0].logprobs


def run(llm: LLM) -> list[tuple[list[int], list[Any]]]:
    """The probes' (tokens, per-step logprobs), all run together among the crowd's requests (the crowd
    first, with other lengths: the probes sit at other positions in every step)."""
    prompts = CROWD + [PROBES[i % len(PROBES)] for i in range(NUM_PROBES)]
    params = ([SamplingParams(temperature=0.7, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(CROWD))]
              + [probe_params(i) for i in range(NUM_PROBES)])
    outs = llm.generate(prompts, params, use_tqdm=False)[-NUM_PROBES:]
    assert_idle(llm.engine)
    return [result(o) for o in outs]


def bf16(**engine_args: Any) -> LLM:
    llm = LLM(dtype="bfloat16", **{"num_kv_blocks": 256, **engine_args})
    if not llm.engine.runner.batch_invariant:
        pytest.skip("the native kernels are not in use here (no compiler, or MINIVLLM_NO_KERNELS): "
                    "the torch kernels are not batch-invariant")
    return llm


@pytest.fixture(scope="module")
def reference() -> list[tuple[list[int], list[Any]]]:
    """Each probe alone on a fresh engine (no cache)."""
    llm = bf16(enable_prefix_caching=False)
    return [result(llm.generate([PROBES[i % len(PROBES)]], probe_params(i), use_tqdm=False)[0])
            for i in range(NUM_PROBES)]


SETTINGS = {
    "crowd": dict(),
    "budget-32": dict(max_num_batched_tokens=32),
    "preemption": dict(num_kv_blocks=30, max_model_len=320),
    "caching-off": dict(enable_prefix_caching=False),
    "static": dict(scheduler="static", static_batch_size=5),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_same_request_same_logits(name: str, reference: list) -> None:
    """Greedy and seeded probes, in a crowd, under each engine setting, then again (prefix-cache hits
    where caching is on): each probe's tokens and logprobs equal its run alone."""
    engine_args = SETTINGS[name]
    llm = bf16(**engine_args)
    first, again = run(llm), run(llm)
    for i, (ref, got, repeat) in enumerate(zip(reference, first, again)):
        what = f"{name}: probe {i} ({'greedy' if i < len(PROBES) else 'seeded'}, {PROBES[i % len(PROBES)][:30]!r})"
        assert got == ref, f"{what} differs from its run alone"
        assert repeat == ref, f"{what} differs on the repeat"
    stats = llm.engine.get_stats()
    if name == "preemption":
        assert stats["num_preemptions"] > 0, "the pool is small enough to force preemption"
    if engine_args.get("enable_prefix_caching", True) and name != "static":
        assert stats["prefix_cache_hits"] > 0, "the repeat hit the prefix cache"


def comparable(results: list[tuple[list[int], list[Any]]]) -> list:
    """(tokens, per-step logprobs) as JSON gives them back: token ids as keys become strings."""
    return [[tokens, [{str(t): lp for t, lp in step.items()} for step in steps]] for tokens, steps in results]


TWO_THREADS = """
import json
from tests.test_batch_invariance import bf16, comparable, run
print(json.dumps(comparable(run(bf16()))))
"""


def test_same_logits_on_two_threads(reference: list) -> None:
    """`make test` runs each file on one thread; here the probes run in their crowd in a process on two
    (every GEMM's units, the attention's spans and the layer ops split between the threads): the same
    tokens and logprobs as each alone on this process's threads."""
    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, "-c", TWO_THREADS], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == comparable(reference)
