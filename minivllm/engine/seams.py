"""The seams through which a feature joins the step, so that the loop and the scheduler never name one.

    AdmissionGate   the scheduler asks every gate before a waiting request starts; one that says "not
                    yet" holds that request back and the others go ahead (a grammar compiling, an
                    adapter beyond --max-loras).
    StepExtension   the loop (llm_engine.py) calls every extension around each step: when a request
                    arrives, before scheduling, on the sampler's rows, on each new token, after the
                    step, when a request ends, for statistics and at close (speculative decoding
                    proposes and verifies here, structured outputs start and advance grammars).
    KVBlockStore    the block manager's: where the prefix blocks the pool evicts go, and whence a
                    waiting prompt's next blocks come back (the KV tier; vLLM's KV connector).

Which gates and extensions an engine has is decided above the engine (minivllm/features.py), from
its config; a test or a user may add their own (LLMEngine(gates=..., extensions=...)).
"""
from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

    from minivllm.model.batch import SamplingRow
    from minivllm.model.sampler import SamplerOutput

# Per sequence that sampled: the tokens it gets this step and their logprobs (None where not asked).
NewTokens = list[tuple[Sequence, list[int], list[Any]]]


class AdmissionGate(Protocol):
    def admits(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether waiting `seq` may start now, beside the `running` ones."""


class StepExtension:
    """A feature's part in the step. Every hook does nothing by default: override those you need."""

    def on_add(self, seq: Sequence, options: dict[str, Any]) -> None:
        """`seq` is being added; take (pop) the request options that are yours, or raise ValueError."""

    def before_schedule(self) -> None:
        """A step begins (make ready what waiting requests wait for)."""

    def pending(self) -> list[Future]:
        """Work in flight that a waiting request waits for: the loop sleeps on it when nothing runs."""
        return []

    def prepare_sampling(self, rows: list[tuple[Sequence, SamplingRow]]) -> None:
        """Each sampling sequence with its own sampler row (its drafts' rows follow it there)."""

    def verify(self, sampling: list[Sequence], drafts: dict[str, list[int]],
               sampled: SamplerOutput) -> tuple[NewTokens, dict[str, int]] | None:
        """For a step that verified draft tokens (yours): per sequence the tokens it keeps, and per
        request the draft tokens rejected (their K/V is rolled back); None if the drafts are not yours."""
        return None

    def on_token(self, seq: Sequence, token: int) -> None:
        """`token` was appended to `seq`."""

    def after_step(self, sched: SchedulerOutput, sampling: list[Sequence], t_scheduled: float) -> None:
        """The step's tokens are appended (`t_scheduled`: when its schedule was made, on the engine's clock)."""

    def on_finish(self, seq: Sequence) -> None:
        """`seq` ended (stopped or aborted): drop its state."""

    def trace_counts(self) -> dict[str, int]:
        """Counters so far, named as tracing.trace.StepRow's columns; each row gets the step's increase."""
        return {}

    def stats(self) -> dict[str, Any]:
        """What LLMEngine.get_stats() adds for this feature."""
        return {}

    def close(self) -> None:
        """The engine closes."""


class KVBlockStore(Protocol):
    """A second tier for the prefix cache, keyed by the blocks' hashes (block_manager.block_hash)."""

    def store(self, key: bytes, tokens: tuple[int, ...], block_id: int) -> None:
        """Keep the K/V of pool block `block_id`, about to be evicted."""

    def ready(self, key: bytes, tokens: tuple[int, ...]) -> bool | None:
        """True: fetchable now; None: being read (asking starts the read); False: not held."""

    def fetch(self, key: bytes, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The block's bytes, checked; None if not held intact."""

    def copy_into(self, block_id: int, data: torch.Tensor) -> None:
        """Write fetched bytes into pool block `block_id`."""

    def pending_reads(self) -> list[Future]:
        """Reads in flight."""

    def persist(self, blocks: Iterable[tuple[bytes, tuple[int, ...], int]]) -> None:
        """Keep (hash, tokens, block id) of the blocks the pool still caches (at close)."""
