"""What the scheduler decided for one step: which sequences compute how many tokens (vLLM v1's
SchedulerOutput); the loop, the model inputs, the step extensions and the trace read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.engine.sequence import Sequence


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, num_new_tokens)
    # Whether each scheduled entry is a decode, fixed when scheduled (computed counts move on later).
    decode_flags: list[bool] = field(default_factory=list)
    # Tokens computed for nothing: static batching's prompt padding and its finished members' slots.
    num_padding_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    # request_id -> the draft tokens its decode verifies this step (vLLM v1's name); they are the last
    # of the sequence's num_new_tokens, after its one uncomputed token.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.scheduled_spec_decode_tokens.values()))

    @property
    def num_decode_tokens(self) -> int:
        """Decodes and the draft tokens they verify."""
        return sum(self.decode_flags) + self.num_draft_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_decode_tokens
