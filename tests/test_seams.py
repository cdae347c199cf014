"""The step's two seams (engine/seams.py), proven from outside: a toy admission gate and toy step
extensions, written here alone and added to a real engine on the default model, change what the
engine does without a line of the loop or the scheduler knowing them."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.seams import NewTokens, StepExtension
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.model.batch import SamplingRow
from minivllm.model.sampler import SamplerOutput
from tests.helpers import greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Die wichtigsten Flüsse in Deutschland sind"]


class HoldGate:
    """Holds back the requests whose ids it holds, until released."""

    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.asked: list[str] = []

    def admits(self, seq: Sequence, running: list[Sequence]) -> bool:
        self.asked.append(seq.request_id)
        return seq.request_id not in self.held


class OnlyToken(StepExtension):
    """Lets the tagged requests (add_request's `only_token=` option) sample nothing but one token, and
    records every step and token it is told of."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.token_of: dict[str, int] = {}
        self.steps: list[int] = []  # each step's scheduled tokens
        self.tokens: list[tuple[str, int]] = []
        self.finished: list[str] = []

    def on_add(self, seq: Sequence, options: dict[str, Any]) -> None:
        if (token := options.pop("only_token", None)) is not None:
            self.token_of[seq.request_id] = token

    def prepare_sampling(self, rows: list[tuple[Sequence, SamplingRow]]) -> None:
        for seq, row in rows:
            if (token := self.token_of.get(seq.request_id)) is not None:
                mask = torch.zeros(self.vocab_size, dtype=torch.bool)
                mask[token] = True
                row.grammar_mask = mask

    def on_token(self, seq: Sequence, token: int) -> None:
        self.tokens.append((seq.request_id, token))

    def after_step(self, sched: SchedulerOutput, sampling: list[Sequence], t_scheduled: float) -> None:
        self.steps.append(sched.num_scheduled_tokens)

    def on_finish(self, seq: Sequence) -> None:
        self.finished.append(seq.request_id)

    def stats(self) -> dict[str, Any]:
        return {"toy_steps": len(self.steps)}


class OracleDrafts(StepExtension):
    """Drafts each request's known continuation (a draftless proposer that has read the answer) and keeps
    the sampled tokens up to the first that differs from the draft, as speculative decoding does."""

    def __init__(self, answers: dict[str, list[int]], k: int) -> None:
        self.answers, self.k = answers, k
        self.verified_steps = 0

    def after_step(self, sched: SchedulerOutput, sampling: list[Sequence], t_scheduled: float) -> None:
        for seq in sampling:
            answer = self.answers.get(seq.request_id)
            if answer is not None and not seq.is_finished:
                done = seq.num_output_tokens
                seq.spec_token_ids = answer[done:min(done + self.k, len(answer) - 1)]

    def verify(self, sampling: list[Sequence], drafts: dict[str, list[int]],
               sampled: SamplerOutput) -> tuple[NewTokens, dict[str, int]]:
        self.verified_steps += 1
        new_tokens, rejected, row = [], {}, 0
        for seq in sampling:
            draft = drafts.get(seq.request_id, [])
            tokens = sampled.token_ids[row:row + len(draft) + 1]
            kept = next((i for i, (t, d) in enumerate(zip(tokens, draft)) if t != d), len(draft))
            new_tokens.append((seq, tokens[:kept + 1], sampled.logprobs[row:row + kept + 1]))
            rejected[seq.request_id] = len(draft) - kept
            row += len(draft) + 1
        return new_tokens, rejected


def run(engine: Any) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def test_a_gate_holds_a_request_back_while_the_others_run_and_finish(llm: Any) -> None:
    engine = llm.engine
    alone = run_alone(engine, PROMPTS[0], 8)
    gate = HoldGate({"held"})
    engine.gates.append(gate)
    try:
        engine.add_request("held", PROMPTS[0], greedy(8))
        engine.add_request("a", PROMPTS[1], greedy(8))
        engine.add_request("b", PROMPTS[2], greedy(8))
        finished: dict[str, list[int]] = {}
        held = engine.requests["held"]
        for _ in range(40):
            finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
            if {"a", "b"} <= set(finished):
                break
        assert set(finished) == {"a", "b"} and all(len(t) == 8 for t in finished.values())
        assert held.status is SequenceStatus.WAITING and held.num_computed_tokens == 0 and not held.block_table
        assert held.metrics.first_scheduled_time is None
        assert "held" in gate.asked
        for _ in range(3):  # alone and held: the steps schedule nothing
            assert engine.step() == [] and held.status is SequenceStatus.WAITING
        gate.held.clear()
        assert run(engine) == {"held": alone}  # released: it runs, to the tokens it makes alone
    finally:
        engine.gates.remove(gate)


def test_an_extension_sees_every_step_and_token_and_changes_what_is_sampled(llm: Any) -> None:
    engine = llm.engine
    forced = engine.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    toy = OnlyToken(engine.model_config.vocab_size)
    engine.extensions.append(toy)
    try:
        with pytest.raises(ValueError, match="unknown request options: colour"):
            engine.add_request("bad", PROMPTS[0], greedy(4), colour="blue")
        before = dict(engine.stats)
        engine.add_request("forced", PROMPTS[1], greedy(6), only_token=forced)
        engine.add_request("free", PROMPTS[2], greedy(6))
        outputs = run(engine)
        counted = {k: engine.stats[k] - before[k] for k in before}
        assert outputs["forced"] == [forced] * 6
        # every step, and every token it computed: the prompts' and the decodes' (each request's first
        # token comes from its prefill step)
        assert len(toy.steps) == counted["num_steps"] == engine.get_stats()["toy_steps"]
        assert sum(toy.steps) == counted["prompt_tokens"] + counted["generation_tokens"] - 2
        assert [t for r, t in toy.tokens if r == "forced"] == [forced] * 6
        assert [t for r, t in toy.tokens if r == "free"] == outputs["free"]
        assert sorted(toy.finished) == ["forced", "free"]
        assert outputs["free"] == run_alone(engine, PROMPTS[2], 6) != [forced] * 6
    finally:
        engine.extensions.remove(toy)


def test_an_extension_drafts_and_verifies_through_the_step(llm: Any) -> None:
    """Draft tokens scheduled and verified in chunks of 1 + k: the same tokens as plain decoding, in
    fewer steps; a wrong draft is rolled back (its K/V dropped) and costs nothing but the step."""
    engine = llm.engine
    answer = run_alone(engine, PROMPTS[0], 16)
    wrong = [(t + 1) % engine.model_config.vocab_size for t in answer]
    oracle = OracleDrafts({"right": answer, "wrong": wrong}, k=4)
    engine.extensions.append(oracle)
    try:
        for request_id in ("right", "wrong"):
            steps_before = engine.stats["num_steps"]
            engine.add_request(request_id, PROMPTS[0], greedy(16))
            assert run(engine) == {request_id: answer}
            steps = engine.stats["num_steps"] - steps_before
            assert steps < 16 if request_id == "right" else steps == 16
        assert oracle.verified_steps > 0
    finally:
        engine.extensions.remove(oracle)


def run_alone(engine: Any, prompt: str, num_tokens: int) -> list[int]:
    engine.add_request("alone", prompt, greedy(num_tokens))
    return run(engine)["alone"]
