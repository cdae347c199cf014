"""Draftless speculative decoding: proposers that guess a sequence's next tokens from text it has seen.

A proposer is one small object per method (vLLM's `speculative_config` "method"):

    ngram   prompt lookup (vLLM's ngram_proposer): the longest suffix of prompt + output, of
            prompt_lookup_max down to prompt_lookup_min tokens, found earlier in that text; the
            tokens that followed its latest occurrence are the draft.
    suffix  suffix decoding (vLLM's "suffix", Oliaro et al.): a table of every context of up to
            suffix_decoding_max_tree_depth tokens -> counts of the token that followed it, over the
            request's own prompt and output and over the outputs of recent requests (a bounded cache
            shared across requests, so that an agent's loop learns from its earlier turns). The draft
            follows the likeliest continuation of the longest matching context while its probability
            stays above suffix_decoding_min_token_prob, for at most max_spec_factor x the match length.

A draft is only a guess: the engine verifies it in the same step as everything else and keeps a
draft token only if it equals what the target model samples at its position (llm_engine.py). So a
proposer may be wrong (a hash collision here only costs a rejected draft) but never makes the output
wrong. How many of a draft's tokens a step verifies is the scheduler's call (scheduler.py).
"""
from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from minivllm.engine.sequence import Sequence

METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys for the draftless methods."""

    method: str
    num_speculative_tokens: int = 4  # the most draft tokens verified per sequence and step
    prompt_lookup_min: int = 1  # ngram
    prompt_lookup_max: int = 4  # ngram
    suffix_decoding_max_tree_depth: int = 24  # suffix: longest context matched
    # suffix: requests whose outputs the shared table keeps (vLLM's default is 10000; each cached token
    # costs max_tree_depth table entries in Python here, so the default is smaller)
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: draft at most this x the matched length
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop the draft below this probability

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From `--speculative-config` JSON text or a dict; a ValueError names what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        if value.get("method") not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, "
                             f"got {value.get('method')!r}")
        config = cls(**value)
        config._validate()
        return config

    def _validate(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")

        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            positive_int(name)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1]")


class Proposer(Protocol):
    def propose(self, seq: Sequence, max_len: int) -> list[int]:
        """Up to `max_len` tokens that may follow `seq.token_ids` (possibly none)."""

    def on_finish(self, seq: Sequence) -> None:
        """`seq` has ended: drop its state (and learn from its output)."""


@dataclass
class _NgramIndex:
    """One request's n-grams -> where their latest occurrence ends, over its first `num_indexed` tokens."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._index: dict[str, _NgramIndex] = {}  # per live request, grown with its tokens

    def propose(self, seq: Sequence, max_len: int) -> list[int]:
        tokens = seq.token_ids
        index = self._index.setdefault(seq.request_id, _NgramIndex())
        # Index every n-gram that ends before the last token, so that a lookup of the text's own
        # suffix finds an earlier occurrence (never itself) and has at least one token after it.
        for end in range(max(index.num_indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.ends[tuple(tokens[end - n:end])] = end
        index.num_indexed = max(index.num_indexed, len(tokens))
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = index.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end:end + max_len]
        return []

    def on_finish(self, seq: Sequence) -> None:
        self._index.pop(seq.request_id, None)


class _ContextTable:
    """context hash -> {next token: count}, for every context of 1..depth tokens of the texts added.

    A context is keyed by a chain hash built backwards from its last token, so that all the contexts
    that end at one position cost `depth` hashes, not depth^2 tokens."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.next: dict[int, dict[int, int]] = {}
        self.num_added = 0  # for a request's own table: how many of its tokens are counted

    def contexts(self, tokens: list[int], end: int) -> list[int]:
        """Keys of the contexts tokens[end - d:end], d = 1..depth (fewer near the start)."""
        keys, h = [], None
        for i in range(end - 1, max(end - self.depth, 0) - 1, -1):
            h = hash((h, tokens[i]))
            keys.append(h)
        return keys

    def add(self, tokens: list[int], start: int, end: int, sign: int = 1) -> None:
        """Count (or with sign -1, forget) each token of tokens[start:end] after its contexts."""
        for pos in range(max(start, 1), end):
            token = tokens[pos]
            for key in self.contexts(tokens, pos):
                counts = self.next.setdefault(key, {})
                counts[token] = counts.get(token, 0) + sign
                if counts[token] <= 0:
                    del counts[token]
                    if not counts:
                        del self.next[key]

    def draft(self, tokens: list[int], max_len: int, max_spec_factor: float, min_prob: float) -> tuple[list[int], float]:
        """The greedy path from the longest context of `tokens` found here, and its score (the sum
        of the path's probabilities, as suffix decoding scores a candidate)."""
        keys = self.contexts(tokens, len(tokens))
        match = next((d for d in range(len(keys), 0, -1) if keys[d - 1] in self.next), 0)
        if not match:
            return [], 0.0
        length = min(max_len, math.ceil(max_spec_factor * match))
        path, prob, score, key = list(tokens[-match:]), 1.0, 0.0, keys[match - 1]
        draft: list[int] = []
        while len(draft) < length and (counts := self.next.get(key)):
            token, count = max(counts.items(), key=lambda kv: kv[1])
            prob *= count / sum(counts.values())
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            path.append(token)
            # One step down the suffix tree: the context grows by the token (up to the depth kept).
            key = self.contexts(path, len(path))[min(len(path), self.depth) - 1]
        return draft, score


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.depth = config.suffix_decoding_max_tree_depth
        self.shared = _ContextTable(self.depth)  # recent requests' outputs
        # Their texts and where each output starts, oldest first (keyed by arrival: ids may repeat).
        self._cached: OrderedDict[int, tuple[list[int], int]] = OrderedDict()
        self._num_finished = 0
        self._local: dict[str, _ContextTable] = {}  # per live request: its own prompt and output

    def propose(self, seq: Sequence, max_len: int) -> list[int]:
        c = self.config
        table = self._local.setdefault(seq.request_id, _ContextTable(self.depth))
        table.add(seq.token_ids, table.num_added, len(seq.token_ids))
        table.num_added = len(seq.token_ids)
        args = (max_len, c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob)
        own, own_score = table.draft(seq.token_ids, *args)
        other, other_score = self.shared.draft(seq.token_ids, *args)
        return own if own_score >= other_score else other

    def on_finish(self, seq: Sequence) -> None:
        self._local.pop(seq.request_id, None)
        if not seq.output_token_ids:
            return
        # The output with the end of the prompt before it, so that its first tokens have contexts.
        tokens = seq.token_ids[max(0, seq.num_prompt_tokens - self.depth):]
        start = len(tokens) - seq.num_output_tokens
        self.shared.add(tokens, start, len(tokens))
        self._cached[self._num_finished] = (tokens, start)
        self._num_finished += 1
        while len(self._cached) > self.config.suffix_decoding_max_cached_requests:
            _, (old, old_start) = self._cached.popitem(last=False)
            self.shared.add(old, old_start, len(old), sign=-1)  # the table stays bounded


PROPOSERS = {"ngram": NgramProposer, "suffix": SuffixProposer}


# -- when drafting pays ------------------------------------------------------------------------------
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
