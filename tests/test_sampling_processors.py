"""Penalties, min_p, logit_bias, bad_words and allowed_token_ids on the real model (float32, greedy
where a reference exists): repetition_penalty against Hugging Face's own `generate`, presence and
frequency penalties against a reference computed here from the model's logits, the rest by what
they must do. Each feature is per row: a request's tokens do not depend on its batch."""
from __future__ import annotations

import pytest
import torch

from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers import EQUALITY_PROMPTS

NUM_TOKENS = 16
PROMPTS = ["Write a haiku about the sea.", "One, two, three, one, two, three,", EQUALITY_PROMPTS[2]]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, ignore_eos=True, **kwargs)


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(_default_llm) -> list:
    """The prompts' plain greedy outputs (one batch, run once for the module): what each feature must change,
    or leave as it is. A row's tokens do not depend on its batch (test_features_are_per_row_in_a_mixed_batch)."""
    return [o.outputs[0] for o in _default_llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def test_repetition_penalty_equals_hf_generate(llm, hf_model, plain) -> None:
    penalty = 1.3
    ours = _tokens(llm, PROMPTS, greedy(repetition_penalty=penalty))
    for prompt, tokens in zip(PROMPTS, ours):
        ids = torch.tensor([llm.engine.tokenizer.encode(prompt)])
        reference = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      repetition_penalty=penalty, max_new_tokens=NUM_TOKENS,
                                      min_new_tokens=NUM_TOKENS, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert tokens == reference, prompt
    assert ours != [c.token_ids for c in plain]  # the penalty changed something


def test_presence_and_frequency_penalties_against_hand_reference(llm, hf_model, plain) -> None:
    """OpenAI's definition: logit - frequency * count - presence * (count > 0), counts over the output
    so far. The reference applies it to the model's logits along our output (teacher forcing)."""
    presence, frequency = 1.5, 1.0
    prompt = PROMPTS[1]
    tokens = _tokens(llm, [prompt], greedy(presence_penalty=presence, frequency_penalty=frequency))[0]
    prompt_ids = llm.engine.tokenizer.encode(prompt)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1:-1]
    counts = torch.zeros(logits.shape[-1])
    for step, token in enumerate(tokens):
        penalized = logits[step] - frequency * counts - presence * (counts > 0)
        top2 = penalized.topk(2)
        if top2.values[0] - top2.values[1] > 1e-3:  # not a near tie that float rounding may flip
            assert token == top2.indices[0].item(), f"step {step}"
        counts[token] += 1
    assert tokens != plain[1].token_ids


def test_features_are_per_row_in_a_mixed_batch(llm) -> None:
    """Each request's tokens alone equal its tokens in a batch with requests using other features."""
    params = [greedy(), greedy(repetition_penalty=1.2), greedy(presence_penalty=1.0, frequency_penalty=0.5),
              greedy(logit_bias={11: 3.0}, bad_words=["the"]), greedy(allowed_token_ids=list(range(200, 4000)))]
    prompts = [PROMPTS[0]] * len(params)
    together = _tokens(llm, prompts, params)
    alone = [_tokens(llm, [p], q)[0] for p, q in zip(prompts, params)]
    assert together == alone
    assert len({tuple(t) for t in together}) == len(params)  # every feature changed the output


def test_logit_bias_and_allowed_token_ids(llm) -> None:
    comma = llm.engine.tokenizer.encode(",")[0]
    assert set(_tokens(llm, [PROMPTS[0]], greedy(logit_bias={comma: 100.0}))[0]) == {comma}
    allowed = list(range(300, 310))
    out = _tokens(llm, PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=NUM_TOKENS, allowed_token_ids=allowed))
    assert all(set(t) <= set(allowed) for t in out)


def test_bad_words_never_appear(llm, plain) -> None:
    reference = plain[0]
    word = max(reference.text.split(), key=len).strip(".,;:!?")
    banned = llm.engine._bad_words([word])
    out = _tokens(llm, [PROMPTS[0]], greedy(bad_words=[word]))[0]
    assert out != reference.token_ids
    for seq in banned:
        assert not any(out[i:i + len(seq)] == seq for i in range(len(out))), (word, seq)


def test_min_p(llm, plain) -> None:
    # min_p = 1 keeps only the likeliest token: sampling becomes greedy.
    sampled = _tokens(llm, PROMPTS, SamplingParams(temperature=1.0, seed=5, min_p=1.0, max_tokens=NUM_TOKENS,
                                                   min_tokens=NUM_TOKENS, ignore_eos=True))
    assert sampled == [c.token_ids for c in plain]
    # Every drawn token is at least min_p times as likely as the likeliest (logprobs are the raw ones).
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=6, min_p=0.3, max_tokens=NUM_TOKENS, logprobs=1),
                       use_tqdm=False)
    for o in out:
        for token, entry in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
            assert entry[token] >= max(entry.values()) + torch.log(torch.tensor(0.3)).item() - 1e-4


def test_structured_output_offline(llm) -> None:
    choices = ["red", "green", "blue"]
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                                               structured_outputs=StructuredOutputsParams(choice=choices)),
                       use_tqdm=False)
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in out)


@pytest.mark.parametrize("kwargs,field", [
    (dict(best_of=3), "best_of"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={5: 500.0}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(prompt_logprobs=50), "prompt_logprobs"),
])
def test_invalid_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_invalid_grammar_and_token_ids_are_value_errors(llm) -> None:
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab")), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_prompt_logprobs_match_transformers_and_chunking(llm, small_budget_llm, hf_model) -> None:
    """Each prompt token's logprob (and the top 3) as transformers computes them; the same floats when the
    prompt is chunked 32 tokens at a time (batch invariance) and on a repeat, which skips the prefix cache
    (cached positions have no logits)."""
    prompt = EQUALITY_PROMPTS[-1]  # 200+ tokens: many chunks at a budget of 32
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert abs(entry[ids[p]] - reference[p - 1, ids[p]].item()) < 1e-4, p
        top = reference[p - 1].topk(3)
        assert set(top.indices.tolist()) <= set(entry), p
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.prompt_logprobs == out.prompt_logprobs and again.metrics.num_cached_tokens == 0
    chunked = small_budget_llm.generate(prompt, params, use_tqdm=False)[0]
    assert chunked.prompt_logprobs == out.prompt_logprobs
