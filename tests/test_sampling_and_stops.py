"""Stop strings and tokens, min_tokens, max_model_len, seeded sampling, abort, and streaming text.

Expected outputs are never hard-coded: each test derives what the feature must do from a plain run of
the model on the same prompt (the stop tests share one, `baseline`).
"""
from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.outputs import CompletionOutput
from tests.helpers import LONG_PROMPT, assert_idle, stream

CODE_PROMPT = "def fibonacci(n):"  # greedy output is plain ASCII code: clean token boundaries


def complete(llm: LLM, prompt: str = CODE_PROMPT, **params) -> CompletionOutput:
    """Greedy, 32 tokens, EOS ignored, unless `params` say otherwise."""
    params = {"temperature": 0, "max_tokens": 32, "ignore_eos": True, **params}
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


# -- stop strings and stop tokens ----------------------------------------------------------------
def two_token_stop(texts: list[str]) -> tuple[str, int, int]:
    """From the cumulative texts after each token, a stop string made of the end of one token's text
    and the start of the next one's, whose first occurrence is there. Returns (stop, where it
    starts in the text, index of the token that completes it)."""
    final = texts[-1]
    for k in range(2, len(texts) - 1):
        boundary = len(texts[k])
        left, right = texts[k][len(texts[k - 1]):][-2:], texts[k + 1][boundary:][:2]
        if left.strip() and right.strip() and final.find(left + right) == boundary - len(left):
            return left + right, boundary - len(left), k + 1
    raise AssertionError(f"no usable token boundary in {final!r}")


@pytest.fixture(scope="module")
def baseline(_default_llm: LLM) -> list[CompletionOutput]:
    """The plain greedy run of CODE_PROMPT (complete()'s defaults), streamed: the output after each step.
    Run once for the module: the stop tests below each derive what their feature must do from it."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0] for o in stream(_default_llm.engine, CODE_PROMPT, params)]


def test_stop_string_spanning_two_tokens(llm: LLM, baseline: list[CompletionOutput]) -> None:
    texts = [o.text for o in baseline]
    tokens = baseline[-1].token_ids
    stop, at, last = two_token_stop(texts)

    outs = stream(llm.engine, CODE_PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=stop))
    done = outs[-1].outputs[0]
    assert (done.finish_reason, done.stop_reason) == ("stop", stop)
    assert done.text == texts[-1][:at]
    assert done.token_ids == tokens[:last + 1]
    # While streaming, the text never shows the stop string, nor anything the final text lacks.
    for out in outs:
        assert stop not in out.outputs[0].text and done.text.startswith(out.outputs[0].text)

    kept = complete(llm, stop=["never-in-output", stop], include_stop_str_in_output=True)
    assert (kept.text, kept.stop_reason) == (texts[-1][:at + len(stop)], stop)


def test_stop_token_ids(llm: LLM, baseline: list[CompletionOutput]) -> None:
    tokens = baseline[-1].token_ids
    stop_token = tokens[5]
    out = complete(llm, stop_token_ids=[stop_token])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert out.token_ids == tokens[:tokens.index(stop_token) + 1]


def test_min_tokens_holds_back_eos(llm: LLM) -> None:
    question = [{"role": "user", "content": "What color is the sky? Answer in one word."}]
    eos = llm.engine.tokenizer.eos_token_ids
    natural = llm.chat(question, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in eos  # the test's premise
    n = len(natural.token_ids)

    longer = llm.chat(question, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 8),
                      use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 8
    assert not set(longer.token_ids[:n + 8]) & set(eos)
    assert longer.token_ids[:n - 1] == natural.token_ids[:n - 1]  # greedy until EOS was banned


def test_min_tokens_holds_back_stop_tokens(llm: LLM, baseline: list[CompletionOutput]) -> None:
    tokens = baseline[-1].token_ids
    stop_token = tokens[3]
    first = tokens.index(stop_token)
    out = complete(llm, stop_token_ids=[stop_token], min_tokens=first + 2)
    assert out.token_ids[:first] == tokens[:first]
    assert stop_token not in out.token_ids[:first + 2]  # banned where greedy would have picked it
    # Past min_tokens it stops the request again, if it comes.
    assert (stop_token in out.token_ids) == (out.stop_reason == stop_token)
    assert stop_token not in out.token_ids[:-1]


def test_max_model_len_ends_a_request_with_length(small_kv_llm: LLM) -> None:
    engine = small_kv_llm.engine
    prompt = (engine.tokenizer.encode(LONG_PROMPT) * 2)[:engine.max_model_len - 10]
    with pytest.raises(ValueError, match="at most 10 new tokens fit"):  # a limit that cannot be reached
        small_kv_llm.generate(prompt, SamplingParams(max_tokens=100), use_tqdm=False)
    for max_tokens in (10, None):
        out = small_kv_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                    use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == engine.max_model_len


# -- seeded sampling -------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_within_and_across_batches(small_kv_llm: LLM) -> None:
    """Alone, or beside other requests in a pool so small that it is preempted and recomputed."""
    prompt = "Once upon a time"
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=32, ignore_eos=True)
    alone = small_kv_llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert small_kv_llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids == alone

    others = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)  # unseeded: the shared generator
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=99, max_tokens=32, ignore_eos=True)
    batch = small_kv_llm.generate([prompt, LONG_PROMPT, CODE_PROMPT, prompt, prompt],
                                  [seeded, others, others, other_seed, seeded], use_tqdm=False)
    assert batch[4].metrics.num_preemptions > 0  # the premise: the latest arrival is the first victim
    assert batch[0].outputs[0].token_ids == alone
    assert batch[4].outputs[0].token_ids == alone
    assert batch[3].outputs[0].token_ids != alone


# -- abort -------------------------------------------------------------------------------------------
def test_abort_running_and_waiting_requests(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    running = engine.add_request("running", "Once upon a time", params)
    while not any(o.request_id == running and len(o.outputs[0].token_ids) >= 3 for o in engine.step()):
        pass
    waiting = engine.add_request("waiting", "Hello", params)  # added after the step: never scheduled
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks

    engine.abort_request(running)
    engine.abort_request(waiting)
    engine.abort_request(running)  # twice, and an unknown id: no-ops
    engine.abort_request("unknown")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    outs = {o.request_id: o for o in engine.step()}
    assert set(outs) == {running, waiting}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs.values())
    assert len(outs[running].outputs[0].token_ids) >= 3 and outs[waiting].outputs[0].token_ids == []
    assert_idle(engine)


# -- incremental detokenization --------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["Emojis: 😀😃😄😁😆", "日本の首都は"])
def test_streamed_deltas_never_split_a_character(llm: LLM, prompt: str) -> None:
    outs = stream(llm.engine, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    texts = [o.outputs[0].text for o in outs]
    deltas = []
    for before, after in zip([""] + texts, texts):
        assert after.startswith(before)  # streamed text only grows
        deltas.append(after[len(before):])
    final = outs[-1].outputs[0]
    assert "".join(deltas) == final.text
    assert "\ufffd" not in final.text
    assert any(ord(c) > 0x2E80 for c in final.text)  # the premise: CJK or emoji output...
    assert "" in deltas  # ...with a character split over tokens, held back until complete
    # Bytes of a character the request ended in the middle of are never shown.
    assert final.text == llm.engine.tokenizer.decode(final.token_ids).rstrip("\ufffd")
