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
draft token only if it equals what the target model samples at its position (extension.py). So a
proposer may be wrong (a hash collision here only costs a rejected draft) but never makes the output
wrong. How many draft tokens pay is extension.py's call, how many fit the step the scheduler's.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from minivllm.config import SpeculativeConfig
from minivllm.engine.sequence import Sequence

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
