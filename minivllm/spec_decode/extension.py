"""Speculative decoding's part in the step (a seams.StepExtension): after each step, propose the next
drafts of the sequences that sampled, as many tokens as pay; when a step verified drafts, keep of each
the tokens up to and including the first that differs from its draft. A draft token is accepted iff
it is what the target sampled there (with that position's noise), so the tokens are those plain
decoding would give; the rejected ones' K/V is rolled back by the scheduler (on_step_done).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from minivllm.config import SpeculativeConfig
from minivllm.engine.scheduler import SchedulerBase
from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.seams import NewTokens, StepExtension
from minivllm.engine.sequence import Sequence
from minivllm.model.sampler import SamplerOutput
from minivllm.spec_decode.proposers import PROPOSERS

logger = logging.getLogger(__name__)

# vLLM's counters: drafts verified, their tokens, and of those the ones accepted; and the trace's columns.
COUNTERS = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "num_draft_tokens",
            "spec_decode_num_accepted_tokens": "num_accepted_tokens"}


class StepCostModel:
    """A step's seconds ~ fixed + per_token x tokens, fitted online (exponentially weighted least
    squares over the recent steps). `fixed` is what a step costs whatever it computes (reading every
    weight once, launching the layers), `per_token` what each token adds (its GEMM rows, attention,
    sampling). On a CPU the fixed part is a few tokens' worth; on a GPU it is hundreds."""

    DECAY = 0.98  # about the last 50 steps
    PRIOR_KNEE = 4.0  # tokens, until the steps seen differ enough in size to fit a line

    def __init__(self) -> None:
        self._w = self._t = self._s = self._tt = self._ts = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.DECAY
        self._w = d * self._w + 1
        self._t = d * self._t + num_tokens
        self._s = d * self._s + seconds
        self._tt = d * self._tt + num_tokens * num_tokens
        self._ts = d * self._ts + num_tokens * seconds

    @property
    def knee(self) -> float:
        """fixed / per_token: the tokens per step at which computing them costs what the fixed part does."""
        w = self._w
        var = self._tt / w - (self._t / w) ** 2 if w else 0.0
        if var < 1.0:
            return self.PRIOR_KNEE
        per_token = (self._ts / w - self._t / w * self._s / w) / var
        fixed = self._s / w - per_token * self._t / w
        if per_token <= 0:
            return self.PRIOR_KNEE
        return min(max(fixed / per_token, 0.0), 4096.0)


def draft_length(acceptance: float, max_len: int, num_running: int, knee: float) -> int:
    """How many draft tokens a sequence should verify next step: the k that maximizes tokens per second.

    With B sequences in a step, verifying k more tokens for each makes the step cost
    fixed + per_token * B * (1 + k), i.e. (1 + k x) times a plain step with x = B / (knee + B), and
    yields 1 + E_k tokens per sequence, E_k = a + a^2 + ... + a^k when each draft token is accepted
    with probability a given the ones before it. So drafting k pays iff (1 + E_k) / (1 + k x) > 1: at
    one stream x is small and even a modest acceptance pays; as the batch grows, x -> 1 and only
    near-certain drafts do, so a saturated server stops drafting by itself."""
    x = num_running / (knee + num_running)
    best, best_gain, expected = 0, 1.0, 0.0
    for k in range(1, max_len + 1):
        expected += acceptance ** k
        gain = (1 + expected) / (1 + k * x)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def spec_decode_stats(stats: dict[str, Any], since: dict[str, Any] | None = None) -> dict[str, float | None]:
    """Acceptance rate (accepted of the draft tokens verified) and mean accepted length (tokens a verify
    step yields: the accepted ones plus the one sampled after them), as vLLM reports them, from the
    engine's `stats`; over the steps after the snapshot `since` of them, if given."""
    drafts, tokens, accepted = (stats.get(k, 0) - (since or {}).get(k, 0) for k in COUNTERS)
    return {"spec_acceptance_rate": accepted / tokens if tokens else None,
            "spec_mean_accepted_length": 1 + accepted / drafts if drafts else None}


class SpeculativeDecoding(StepExtension):
    """Without a `config`, it only reports its (zero) counters, so that every engine's stats have them."""

    def __init__(self, config: SpeculativeConfig | None, scheduler: SchedulerBase, max_model_len: int,
                 clock: Callable[[], float], stats: dict[str, Any], batch_invariant: bool) -> None:
        self.proposer = PROPOSERS[config.method](config) if config else None
        self.max_len = config.num_speculative_tokens if config else 0
        self.scheduler, self.max_model_len, self.clock, self.counts = scheduler, max_model_len, clock, stats
        stats.update(dict.fromkeys(COUNTERS, 0))
        self.step_cost = StepCostModel()  # what a step costs; told each step's time
        if config and not batch_invariant:
            logger.warning("speculative decoding is not exact here: the torch kernels (no compiler, CUDA or "
                           "MINIVLLM_NO_KERNELS) are not batch-invariant, so a verified chunk's logits may differ "
                           "by rounding from a plain decode's and a greedy output from the non-speculative one")

    def verify(self, sampling: list[Sequence], drafts: dict[str, list[int]],
               sampled: SamplerOutput) -> tuple[NewTokens, dict[str, int]] | None:
        """Per sequence, the tokens it gets: the sampled ones up to and including the first that differs
        from its draft; and per request the draft tokens rejected. None when it proposed none."""
        if self.proposer is None:
            return None
        tokens, logprobs, counts = sampled.token_ids, sampled.logprobs, self.counts
        new_tokens, rejected, row = [], {}, 0
        for seq in sampling:
            draft = drafts.get(seq.request_id, [])
            sampled_here = tokens[row:row + len(draft) + 1]
            accepted = 0
            while accepted < len(draft) and sampled_here[accepted] == draft[accepted]:
                accepted += 1
            new_tokens.append((seq, sampled_here[:accepted + 1], logprobs[row:row + accepted + 1]))
            row += len(draft) + 1
            if draft:
                rejected[seq.request_id] = len(draft) - accepted
                seq.num_spec_verified += min(accepted + 1, len(draft))
                seq.num_spec_accepted += accepted
                counts["spec_decode_num_drafts"] += 1
                counts["spec_decode_num_draft_tokens"] += len(draft)
                counts["spec_decode_num_accepted_tokens"] += accepted
        return new_tokens, rejected

    def after_step(self, sched: SchedulerOutput, sampling: list[Sequence], t_scheduled: float) -> None:
        if self.proposer is None:
            return
        self._propose(sampling)
        self.step_cost.observe(sched.num_scheduled_tokens, self.clock() - t_scheduled)

    def draft_length(self, seq: Sequence) -> int:
        """How many tokens to draft for `seq`'s next step (0: none), before the budget's cut: what pays
        at the current batch size and the request's acceptance rate (draft_length). A structured-output
        request drafts none (its grammar would have to be advanced through each draft prefix and rolled
        back)."""
        if not self.max_len or seq.params.structured_outputs is not None:
            return 0
        return draft_length(seq.spec_acceptance, self.max_len, self.scheduler.num_running, self.step_cost.knee)

    def _propose(self, sampled: list[Sequence]) -> None:
        """Draft the next tokens of each sequence that just sampled, as long as draft_length says pays,
        and never past max_tokens or max_model_len (every draft token accepted, plus the bonus one)."""
        for seq in sampled:
            k = 0 if seq.is_finished else self.draft_length(seq)
            if k:
                room = self.max_model_len - seq.num_tokens
                if seq.params.max_tokens is not None:
                    room = min(room, seq.params.max_tokens - seq.num_output_tokens)
                k = min(k, room - 1)
            seq.spec_token_ids = self.proposer.propose(seq, k) if k > 0 else []

    def on_finish(self, seq: Sequence) -> None:
        if self.proposer is not None:
            self.proposer.on_finish(seq)

    def trace_counts(self) -> dict[str, int]:
        return {column: self.counts[key] for key, column in COUNTERS.items()}

    def stats(self) -> dict[str, Any]:
        return spec_decode_stats(self.counts)
