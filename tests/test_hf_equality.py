"""Greedy output equals Hugging Face transformers' greedy `generate`, token for token (float32, same
GGUF weights), whatever the batch, the KV pool and the token budget."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minivllm.outputs import RequestOutput
from tests.helpers import EQUALITY_PROMPTS, NEW_TOKENS, greedy, mismatch_report


def assert_match_hf(outputs: list[RequestOutput], hf_greedy: Callable[[list[int], int], list[int]],
                    hf_model: Any) -> None:
    assert len(outputs) == len(EQUALITY_PROMPTS)
    for out in outputs:
        ours = out.outputs[0].token_ids
        reference = hf_greedy(out.prompt_token_ids, NEW_TOKENS)
        assert ours == reference, f"prompt {out.prompt!r:.40}: " + mismatch_report(
            hf_model, out.prompt_token_ids, ours, reference)
        assert out.outputs[0].finish_reason == "length"


def test_one_prompt_at_a_time(llm, hf_greedy, hf_model) -> None:
    outputs = [llm.generate(p, greedy(), use_tqdm=False)[0] for p in EQUALITY_PROMPTS]
    assert max(len(o.prompt_token_ids) for o in outputs) > 200
    assert min(len(o.prompt_token_ids) for o in outputs) == 1
    assert_match_hf(outputs, hf_greedy, hf_model)


def test_all_prompts_in_one_batch(llm, hf_greedy, hf_model) -> None:
    assert_match_hf(llm.generate(EQUALITY_PROMPTS, greedy(), use_tqdm=False), hf_greedy, hf_model)


def test_kv_pool_so_small_that_requests_are_preempted(small_kv_llm, hf_greedy, hf_model) -> None:
    before = small_kv_llm.engine.get_stats()["num_preemptions"]
    outputs = small_kv_llm.generate(EQUALITY_PROMPTS, greedy(), use_tqdm=False)
    assert small_kv_llm.engine.get_stats()["num_preemptions"] > before
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_match_hf(outputs, hf_greedy, hf_model)


def test_token_budget_so_small_that_prompts_wait(small_budget_llm, hf_greedy, hf_model) -> None:
    outputs = small_budget_llm.generate(EQUALITY_PROMPTS, greedy(), use_tqdm=False)
    # Some prompt was first scheduled only after another request had already produced a token.
    assert max(o.metrics.first_scheduled_time for o in outputs) > min(o.metrics.first_token_time for o in outputs)
    assert_match_hf(outputs, hf_greedy, hf_model)
