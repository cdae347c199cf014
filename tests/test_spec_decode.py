"""Speculative decoding (issue 29): the proposers, the cost rule, and on the real model that outputs
with speculation equal those without, token for token: greedy alone and among requests that draft
none, under preemption, with chunked prefill and prefix-cache hits, with stop strings, max_tokens
and logprobs landing mid-draft; seeded sampling at several temperatures alone and in a crowd. Every
engine ends with its KV pool whole.

Expected outputs are never hard-coded: the reference is the plain engine (`llm`), and every test
checks that drafts were verified and accepted, so that speculation really ran."""
from __future__ import annotations

from typing import Any

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig, SpeculativeConfig
from minivllm.engine.sequence import Sequence
from minivllm.outputs import RequestMetrics
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.spec_decode.extension import SpeculativeDecoding, StepCostModel, draft_length
from minivllm.spec_decode.proposers import NgramProposer, SuffixProposer
from tests.helpers import LONG_PROMPT, assert_idle

FUNCTION = '''def moving_average(values, width):
    """Return the averages of each window of `width` consecutive values."""
    if width <= 0:
        raise ValueError("width must be positive")
    averages = []
    total = sum(values[:width])
    averages.append(total / width)
    for i in range(width, len(values)):
        total += values[i] - values[i - width]
        averages.append(total / width)
    return averages
'''
# Grounded prompts (the answer is in the input: drafts get accepted) and plain ones.
GROUNDED = [f"Copy this function exactly, then stop.\n\n{FUNCTION}\n{FUNCTION}",
            f"Here is a function:\n{FUNCTION}\nRename `total` to `running` and write it again:\n"]
PLAIN = ["The capital of France is", "def fibonacci(n):", LONG_PROMPT]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}


class PriorKnee(StepCostModel):
    """A step cost model that keeps the CPU's prior knee: the fitted one comes from the steps' wall-clock
    times, which a loaded test machine makes anything (at a knee near 0 no draft pays)."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


def spec_llm(config: dict, **engine_args: Any) -> LLM:
    # As conftest's engines: float32, dequantized (the weights are loaded once per process).
    llm = LLM(dtype="float32", quantization="none", speculative_config=config, **engine_args)
    llm.engine.extension(SpeculativeDecoding).step_cost = PriorKnee()
    return llm


def greedy(max_tokens: int = 40, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def accepted(llm: LLM) -> int:
    return llm.engine.stats["spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def ngram_llm() -> LLM:
    llm = spec_llm(NGRAM, num_kv_blocks=256)
    yield llm
    assert_idle(llm.engine)


# -- no model ------------------------------------------------------------------------------------------
def test_config_is_checked() -> None:
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3
    for bad, message in (({"method": "eagle"}, "method"), ({"method": "ngram", "k": 2}, "unknown keys"),
                         ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                         ("{not json", "JSON")):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="continuous"):
        EngineConfig(speculative_config=NGRAM, scheduler="static")


def seq(request_id: str, prompt: list[int], output: list[int] = ()) -> Sequence:
    s = Sequence(request_id, None, list(prompt), SamplingParams(), RequestMetrics(arrival_time=0.0))
    for t in output:
        s.append_token(t)
    return s


def test_ngram_drafts_what_followed_the_latest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 2}))
    s = seq("a", [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 8, 1, 2, 3])
    assert proposer.propose(s, 3) == [5, 6, 7]  # [1, 2, 3] last occurred before 5
    s.append_token(5)
    assert proposer.propose(s, 2) == [6, 7]  # the index follows the new tokens
    assert proposer.propose(seq("b", [1, 2, 3, 4]), 3) == []  # no earlier occurrence


def test_suffix_learns_across_requests_and_stays_bounded() -> None:
    proposer = SuffixProposer(SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_cached_requests": 2}))
    first = seq("a", [7, 8], [10, 11, 12, 13, 14])
    proposer.on_finish(first)
    # Another request whose text ends like the first's output gets its continuation.
    assert proposer.propose(seq("b", [1, 10, 11]), 4) == [12, 13]  # at most max_spec_factor x the match
    assert proposer.propose(seq("c", [5, 7, 8, 10, 11, 12]), 4) == [13, 14]
    proposer.on_finish(seq("d", [1], [2, 3]))
    proposer.on_finish(seq("e", [1], [4, 5]))  # the first request leaves the cache: its counts go
    assert proposer.propose(seq("f", [7, 8, 10, 11, 12]), 4) == []
    assert all(proposer.shared.next.values())


def test_drafting_pays_at_low_batch_and_high_acceptance_only() -> None:
    assert draft_length(0.9, 8, num_running=1, knee=4.0) >= 4
    assert draft_length(0.5, 8, num_running=1, knee=4.0) == 1
    assert draft_length(0.1, 8, num_running=1, knee=4.0) == 0
    assert draft_length(0.9, 8, num_running=256, knee=4.0) == 0  # saturated: no drafts
    assert draft_length(0.9, 8, num_running=64, knee=512.0) >= 4  # a GPU's knee: drafts pay at batch 64


# -- the real model ------------------------------------------------------------------------------------
def test_greedy_equal_alone_and_beside_requests_that_draft_none(llm: LLM, ngram_llm: LLM) -> None:
    prompts = GROUNDED + PLAIN
    reference = tokens(llm.generate(prompts, greedy(), use_tqdm=False))
    before = accepted(ngram_llm)
    assert tokens([ngram_llm.generate(p, greedy(), use_tqdm=False)[0] for p in GROUNDED]) == reference[:2]
    assert accepted(ngram_llm) > before, "drafts were accepted"
    # All together, with a structured-output request (it drafts none) in the batch.
    choice = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    outs = ngram_llm.generate(prompts + ["Is the sky blue?"], [greedy()] * len(prompts) + [choice], use_tqdm=False)
    assert tokens(outs[:-1]) == reference
    assert outs[-1].outputs[0].text == llm.generate("Is the sky blue?", choice, use_tqdm=False)[0].outputs[0].text


def test_greedy_equal_under_preemption(llm: LLM) -> None:
    # 24 blocks of 16 tokens: two long prompts with their outputs do not fit together.
    small = spec_llm(SUFFIX, num_kv_blocks=24, max_model_len=320)
    prompts = [LONG_PROMPT, GROUNDED[1], LONG_PROMPT + " Be brief."]
    outs = small.generate(prompts, greedy(48), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert accepted(small) > 0
    assert tokens(outs) == tokens(llm.generate(prompts, greedy(48), use_tqdm=False))
    assert_idle(small.engine)


def test_greedy_equal_with_chunked_prefill_and_prefix_hits(llm: LLM) -> None:
    chunked = spec_llm(NGRAM, num_kv_blocks=256, max_num_batched_tokens=32)
    reference = tokens(llm.generate(GROUNDED, greedy(), use_tqdm=False))
    for _ in range(2):  # the second time, the prompts hit the prefix cache
        assert tokens(chunked.generate(GROUNDED, greedy(), use_tqdm=False)) == reference
    stats = chunked.engine.get_stats()
    assert stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert_idle(chunked.engine)


def test_stops_max_tokens_and_logprobs_mid_draft(llm: LLM, ngram_llm: LLM) -> None:
    prompt = GROUNDED[0]
    full = llm.generate(prompt, greedy(48), use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2:][:6]  # a stop string that ends inside the output
    cases = [greedy(48, stop=[stop]), greedy(48, stop=[stop], include_stop_str_in_output=True),
             greedy(17), greedy(23, logprobs=2), greedy(48, stop_token_ids=[full.token_ids[30]]),
             greedy(48, min_tokens=20, stop_token_ids=[full.token_ids[10]], repetition_penalty=1.2)]
    # One batch of the cases on each engine: a request's output does not depend on what shares its steps.
    ours, reference = ([o.outputs[0] for o in x.generate([prompt] * len(cases), cases, use_tqdm=False)]
                       for x in (ngram_llm, llm))
    for params, a, b in zip(cases, ours, reference):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
               (b.token_ids, b.text, b.finish_reason, b.stop_reason), params
        assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob


def test_seeded_sampling_equal_alone_and_in_a_crowd(llm: LLM, ngram_llm: LLM) -> None:
    params = [SamplingParams(temperature=t, top_p=0.95, seed=11 + i, max_tokens=32, ignore_eos=True)
              for i, t in enumerate((0.3, 0.7, 1.0))]
    prompts = [GROUNDED[0]] * len(params)
    reference = tokens(llm.generate(prompts, params, use_tqdm=False))
    before = accepted(ngram_llm)
    assert tokens([ngram_llm.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params)]) == reference
    crowd = PLAIN + GROUNDED
    crowd_params = [SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)] * len(crowd)
    outs = ngram_llm.generate(crowd + prompts, crowd_params + params, use_tqdm=False)
    assert tokens(outs[len(crowd):]) == reference
    assert accepted(ngram_llm) > before


def test_the_step_trace_carries_drafts_and_acceptance(tmp_path) -> None:
    """The per-step columns the dashboard sums (drafts, draft tokens, accepted tokens) add up to the
    engine's counters."""
    from minivllm.server.dashboard import load_trace

    llm = spec_llm(NGRAM, num_kv_blocks=64, trace_file=str(tmp_path / "steps.csv"))
    llm.generate(GROUNDED, greedy(), use_tqdm=False)
    llm.engine.close()
    steps = [r for r in load_trace(tmp_path / "steps.csv").records if r["kind"] == "step"]
    for column, counter in (("num_drafts", "spec_decode_num_drafts"), ("num_draft_tokens", "spec_decode_num_draft_tokens"),
                            ("num_accepted_tokens", "spec_decode_num_accepted_tokens")):
        assert sum(r[column] for r in steps) == llm.engine.stats[counter] > 0

