"""The plain inputs of one step, as the runner and the sampler take them: the engine builds them from
its scheduler's output and its requests (engine/model_inputs.py), so that the model package knows
nothing of the engine (data flows request -> scheduler -> runner -> sampler -> outputs).

One `SeqSpan` per scheduled sequence, one `SamplingRow` per token to draw; both hold references to the
engine's own lists (token ids, block table, output so far), read and never changed here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm.sampling_params import SamplingParams

NO_POSITIONS = range(0)


@dataclass(slots=True)
class SeqSpan:
    """One sequence's rows of the packed batch."""

    token_ids: list[int]  # what this step computes: its uncomputed tokens, then the draft tokens it verifies
    start: int  # the position of token_ids[0]: the K/V of every position before it is in the pool
    block_table: list[int]  # the sequence's KV blocks, in position order
    # How many of the span's last rows give logits to sample: 1 once the step completes the sequence's
    # tokens (1 + k for a verify of k draft tokens), 0 for a prompt chunk that does not complete it.
    num_logits: int = 0
    # The positions whose logits score a prompt token (position p scores token p + 1): prompt_logprobs.
    prompt_logprob_positions: range = NO_POSITIONS
    lora: Any = None  # the LoRA adapter it runs under (lora/manager.LoadedAdapter), or None for the base
    # Whether the scheduler counts it a decode (a verify of draft tokens included): the runner goes by
    # the span's length, the step's cost model (bench/cost_model.py) by this.
    decode: bool = False
    long_rope: bool = False  # Phi-3's longrope: the long rotary factors at every position (ModelConfig.long_rope)


@dataclass(slots=True)
class BatchInputs:
    """One step's forward: the spans in the scheduler's order (the logits come in that order), then
    `num_padding_tokens` rows that compute nothing (static batching's padding)."""

    spans: list[SeqSpan] = field(default_factory=list)
    num_padding_tokens: int = 0


@dataclass(slots=True)
class SamplingRow:
    """What the sampler reads to draw one token of one request."""

    params: SamplingParams
    prompt_token_ids: list[int]
    # Its output before the token drawn here (at a verify row: the draft tokens before the row
    # included), which penalties, min_tokens and bad_words read.
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    grammar_mask: torch.Tensor | None = None  # bool [vocab]: what its grammar allows next (structured outputs)

    @property
    def position(self) -> int:
        """Where the token drawn here goes in the request's sequence (a seeded request's noise is keyed by it)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)
