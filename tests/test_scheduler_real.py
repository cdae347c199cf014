"""The scheduler on the real model: whatever the chunk size, order, policy, preemptions or static
batching, greedy outputs stay token for token those of Hugging Face transformers."""
from __future__ import annotations

import csv
import json
from typing import Any

import pytest

from minivllm import LLM
from tests.helpers import EQUALITY_PROMPTS, NEW_TOKENS, assert_idle, greedy

SETTINGS = {
    "chunk-16": dict(max_num_batched_tokens=16),
    "chunk-64": dict(max_num_batched_tokens=64),
    "chunk-unlimited": dict(max_num_batched_tokens=8192),
    "no-chunking": dict(max_num_batched_tokens=256, enable_chunked_prefill=False),
    "prefill-first": dict(max_num_batched_tokens=64, schedule_order="prefill-first"),
    "sjf": dict(max_num_batched_tokens=64, scheduling_policy="sjf"),
    "priority": dict(max_num_batched_tokens=64, scheduling_policy="priority", max_num_seqs=3),
    "fair": dict(max_num_batched_tokens=64, scheduling_policy="fair"),
    "preemption": dict(max_num_batched_tokens=64, num_kv_blocks=22, max_model_len=320),
    "static": dict(scheduler="static", static_batch_size=4),
}


# The settings differ in how prompts are chunked, ordered, preempted and batched: all of it happens while
# the prompts are prefilled and the first tokens decoded, which 16 tokens cover (the long prompt alone
# takes 13 steps at 16 tokens a step); later steps are plain decodes, equal to HF in test_hf_equality.py.
SCHEDULED_TOKENS = 16


@pytest.mark.parametrize("name", SETTINGS)
def test_greedy_matches_hf_under_every_scheduler_setting(name: str, hf_greedy: Any) -> None:
    llm = LLM(dtype="float32", quantization="none", **{"num_kv_blocks": 256, **SETTINGS[name]})
    tok = llm.engine.tokenizer
    prompts = [tok.encode(p) for p in EQUALITY_PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(SCHEDULED_TOKENS), use_tqdm=False,
                        priority=[i % 3 for i in range(len(prompts))], tenant=["a", "b", "b", "b", "b", "a"])
    # The start of the session's 32-token references: HF bans EOS over all 32, min_tokens here over these 16.
    for prompt, out, reference in zip(prompts, outs, hf_greedy.many(prompts, NEW_TOKENS)):
        assert out.outputs[0].token_ids == reference[:SCHEDULED_TOKENS], f"{name}: {tok.decode(prompt)[:40]!r}"
    if name == "preemption":
        assert llm.engine.get_stats()["num_preemptions"] > 0, "the pool is small enough to force preemption"
    assert_idle(llm.engine)


def read_trace(path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def test_static_trace_shows_padding_emptying_batches_and_blocked_arrivals(tmp_path) -> None:
    """The seed's failures, read off the static scheduler's step trace on a mixed workload."""
    trace = tmp_path / "static.csv"
    llm = LLM(dtype="float32", num_kv_blocks=256, scheduler="static", static_batch_size=3, trace_file=str(trace))
    prompts = ["Hi", "Tell me about the history of the printing press in Europe and Asia.", "Why?",
               "Name a color.", "Describe a long walk along the river at dawn, in detail.", "Count to three."]
    lengths = [2, 24, 6, 4, 20, 3]
    from minivllm import SamplingParams
    llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths],
                 use_tqdm=False)
    llm.engine.close()
    rows = read_trace(trace)
    assert list(rows[0]) == ["step", "t_start", "t_end", "num_scheduled_tokens", "num_prefill_tokens",
                             "num_decode_tokens", "num_padding_tokens", "num_running", "num_waiting",
                             "num_kv_blocks_used", "num_kv_blocks_total", "num_preempted", "num_finished",
                             "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_tier_ram_tokens",
                             "num_tier_disk_tokens"]
    assert rows[0]["num_padding_tokens"] > 0, "prompts are padded to the batch's longest"
    first_batch = rows[: next(i for i, r in enumerate(rows[1:], 1) if r["num_prefill_tokens"] > 0)]
    running = [r["num_running"] for r in first_batch]
    assert running == sorted(running, reverse=True) and running[-1] < running[0], "occupancy only falls"
    assert all(r["num_waiting"] == 3 for r in first_batch), "nobody joins mid-batch"
    assert sum(r["num_padding_tokens"] for r in first_batch[1:]) > 0, "finished members keep computing"

    events = json.loads(trace.with_suffix(".json").read_text())["traceEvents"]
    names = {e["name"].split()[0] for e in events if e["ph"] == "X"}
    assert {"queued", "prefill", "decode"} <= names
    assert len({e["tid"] for e in events if e["ph"] == "X"}) == len(prompts), "one track per request"


def test_continuous_trace_has_no_padding_and_admits_mid_flight(tmp_path) -> None:
    trace = tmp_path / "continuous.csv"
    llm = LLM(dtype="float32", num_kv_blocks=256, max_num_seqs=3, trace_file=str(trace))
    from minivllm import SamplingParams
    llm.generate(["Hi", "Why?", "Name a color.", "Count to three."],
                 [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (2, 12, 4, 6)],
                 use_tqdm=False)
    llm.engine.close()
    rows = read_trace(trace)
    assert all(r["num_padding_tokens"] == 0 for r in rows)
    assert any(r["num_prefill_tokens"] > 0 and r["num_decode_tokens"] > 0 for r in rows), \
        "a new request joins while others decode"


def test_llm_writes_the_chrome_trace_after_each_generate(tmp_path) -> None:
    """LLM(trace_file=...) keeps both files current without a close(): the CSV and the Chrome JSON."""
    trace = tmp_path / "steps.csv"
    llm = LLM(dtype="float32", num_kv_blocks=64, trace_file=str(trace))
    from minivllm import SamplingParams
    llm.generate(["Hi", "Hello there"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    events = json.loads(trace.with_suffix(".json").read_text())["traceEvents"]
    assert {e["name"].split()[0] for e in events if e["ph"] == "X"} >= {"prefill", "decode"}
    steps = len(read_trace(trace))
    assert steps >= 3
    llm.generate(["Once more"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(read_trace(trace)) > steps
    assert len(json.loads(trace.with_suffix(".json").read_text())["traceEvents"]) > len(events)
