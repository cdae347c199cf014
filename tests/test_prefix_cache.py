"""Prefix caching: shared prompt prefixes reuse KV blocks without changing a single output token."""
from __future__ import annotations

from minivllm import LLM
from tests.fake_engine import FakeEngine
from tests.helpers import LONG_PROMPT, assert_idle, greedy

SYSTEM = [{"role": "system", "content": LONG_PROMPT}]
QUESTIONS = ["What is this text about?", "Who is Bi Sheng?", "When was the Bible printed?", "Name one city."]


def chats(llm: LLM) -> list[str]:
    return [llm.engine.tokenizer.apply_chat_template(SYSTEM + [{"role": "user", "content": q}]) for q in QUESTIONS]


def test_outputs_identical_with_and_without_caching_and_shared_system_prompt_hits():
    cached = LLM(dtype="float32", num_kv_blocks=128, enable_prefix_caching=True)
    plain = LLM(dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    prompts = chats(cached)
    first = cached.generate(prompts[:1], greedy(16), use_tqdm=False)  # fills the cache with the system prompt
    rest = cached.generate(prompts[1:], greedy(16), use_tqdm=False)
    reference = plain.generate(prompts, greedy(16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in reference]
    system_tokens = len(cached.engine.tokenizer.encode(cached.engine.tokenizer.apply_chat_template(SYSTEM, False)))
    for out in rest:
        assert out.metrics.num_cached_tokens >= (system_tokens // 16 - 1) * 16, "the system prompt is reused"
    stats = cached.engine.get_stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_queries"] >= stats["prefix_cache_hits"]
    assert plain.engine.get_stats()["prefix_cache_hits"] == 0
    assert_idle(cached.engine)
    assert_idle(plain.engine)


def test_eviction_under_pressure_stays_correct():
    """A pool too small to keep every prompt: cached blocks are evicted and reused, outputs stay
    those of a cache-less engine, nothing leaks."""
    cached = LLM(dtype="float32", num_kv_blocks=40, max_model_len=320, enable_prefix_caching=True)
    plain = LLM(dtype="float32", num_kv_blocks=40, max_model_len=320, enable_prefix_caching=False)
    prompts = chats(cached) + [f"{LONG_PROMPT[i * 40:]} Question {i}:" for i in range(4)] + chats(cached)[:2]
    got = [cached.generate([p], greedy(12), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(12), use_tqdm=False)]
    assert got == want
    bm = cached.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and len(bm.cached) <= bm.num_blocks
    assert_idle(cached.engine)


def test_last_prompt_token_is_always_recomputed():
    eng = FakeEngine(block_size=16, num_blocks=64, max_num_batched_tokens=256)
    eng.add("a", 32, 1)
    eng.run()
    second = eng.add("b", 32, 1)  # the same 32 tokens: two full blocks, both cached
    out = eng.step()
    assert second.metrics.num_cached_tokens == 16, "the block holding the last token is not reused"
    assert out.scheduled == [(second, 16)]
    eng.run()


def test_cached_blocks_are_shared_by_reference_and_evicted_lru():
    eng = FakeEngine(block_size=4, num_blocks=12, max_num_batched_tokens=256, watermark=0.0)
    a = eng.add("a", 17, 4)  # 4 full blocks + 1 token
    eng.step()  # a's prompt is computed: its full blocks enter the cache
    b = eng.add("b", 17, 2)
    eng.step()
    assert b.block_table[:4] == a.block_table[:4], "b reuses a's blocks while a still runs"
    assert all(eng.bm.ref_counts[blk] == 2 for blk in a.block_table[:4])
    prefix_hashes = a.block_hashes[:4]
    eng.run()
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
    cached_before = set(eng.bm.cached)  # block hashes
    assert set(prefix_hashes) <= cached_before, "freed blocks stay cached"
    eng.add("c", 40, 1, first_token=500)  # 10 blocks of other tokens: old cached blocks must go
    eng.run()
    evicted = cached_before - set(eng.bm.cached)
    assert evicted, "least recently used cached blocks were evicted"
    again = eng.add("a2", 17, 1)
    eng.run()
    still_cached = next((i for i, h in enumerate(prefix_hashes) if h in evicted), 4)
    assert again.num_output_tokens == 1 and again.metrics.num_cached_tokens == 4 * still_cached
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
