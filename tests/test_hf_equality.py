"""Greedy output equals Hugging Face transformers' greedy `generate`, token for token (float32, same
GGUF weights), whatever the batch, the KV pool and the token budget."""
from __future__ import annotations

from tests.helpers import EQUALITY_PROMPTS, assert_match_hf, greedy


def test_one_prompt_at_a_time(llm, hf_greedy) -> None:
    outputs = [llm.generate(p, greedy(), use_tqdm=False)[0] for p in EQUALITY_PROMPTS]
    assert max(len(o.prompt_token_ids) for o in outputs) > 200
    assert min(len(o.prompt_token_ids) for o in outputs) == 1
    assert_match_hf(outputs, hf_greedy)


def test_all_prompts_in_one_batch(llm, hf_greedy) -> None:
    outputs = llm.generate(EQUALITY_PROMPTS, greedy(), use_tqdm=False)
    assert len(outputs) == len(EQUALITY_PROMPTS)
    assert_match_hf(outputs, hf_greedy)


def test_kv_pool_so_small_that_requests_are_preempted(small_kv_llm, hf_greedy) -> None:
    before = small_kv_llm.engine.get_stats()["num_preemptions"]
    outputs = small_kv_llm.generate(EQUALITY_PROMPTS, greedy(), use_tqdm=False)
    assert small_kv_llm.engine.get_stats()["num_preemptions"] > before
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_match_hf(outputs, hf_greedy)


def test_token_budget_so_small_that_prompts_wait(small_budget_llm, hf_greedy) -> None:
    outputs = small_budget_llm.generate(EQUALITY_PROMPTS, greedy(), use_tqdm=False)
    # Some prompt was first scheduled only after another request had already produced a token.
    assert max(o.metrics.first_scheduled_time for o in outputs) > min(o.metrics.first_token_time for o in outputs)
    assert_match_hf(outputs, hf_greedy)
