"""One request's state as the scheduler, block manager and runner see it."""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any

from minivllm.outputs import RequestMetrics
from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # a preempted sequence is WAITING again, with its computed work dropped
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    priority: int = 0
    tenant: str = "default"
    eos_token_ids: tuple[int, ...] = ()
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # How many of `token_ids` already have their K/V in the cache.
    num_computed_tokens: int = 0
    last_chunk_step: int | None = None  # the scheduler's step that last gave it prompt tokens
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of this sequence's full blocks (prefix caching), in block order.
    block_hashes: list[bytes] = field(default_factory=list)
    # How many leading blocks of `block_table` the block manager has registered in the prefix cache.
    num_cached_blocks: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    # params.prompt_logprobs: per prompt token, its logprob and the top ones (None for the first token)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float = 0.0
    detokenizer: Any = None  # the engine's IncrementalDetokenizer
    # Structured outputs: the grammar compiling (a Future) until structured_output/extension.py turns it
    # into `grammar` (structured_output/grammar.Grammar), the request's parse state.
    grammar_future: Any = None
    grammar: Any = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    # Speculative decoding: the draft proposed after the last step (tokens that may follow token_ids),
    # and this request's record of draft positions verified and accepted (its acceptance rate).
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_verified: int = 0
    num_spec_accepted: int = 0
    lora: Any = None  # the LoRA adapter it runs under (lora/layers.LoadedAdapter), or None for the base
    cache_salt: bytes | None = None  # folded into its first prefix-cache block hash (add_cache_salt)
    long_rope: bool = False  # ModelConfig.long_rope: Phi-3's long rotary factors at every position

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def add_cache_salt(self, salt: bytes) -> None:
        """Fold `salt` into what names this request's prefix-cache blocks: K/V computed otherwise (under a
        LoRA adapter, with longrope's long factors) is never shared with requests of the same tokens."""
        self.cache_salt = salt if self.cache_salt is None else hashlib.sha256(self.cache_salt + salt).digest()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token lacks K/V (the prompt, or work dropped by preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def spec_acceptance(self) -> float:
        """The chance that a draft token is accepted given the ones before it were: a Beta(1, 1)
        posterior mean, so that a new request starts at 1/2 and a few rejections soon weigh."""
        return (self.num_spec_accepted + 1) / (self.num_spec_verified + 2)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
