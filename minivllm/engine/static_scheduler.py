"""Static batching, kept as the baseline that continuous batching is measured against.

It takes `static_batch_size` requests in arrival order and admits nobody else until every one of
them has finished. It computes what static batching computes: each prompt is padded to the batch's
longest, and a finished member keeps its slot, computing a dummy token every step, until the batch
ends. Padding tokens pass through every weight of the model but attend to nothing, so the model
runner charges them the GEMM cost, which is most of the cost.
"""
from __future__ import annotations

from minivllm.engine.scheduler import SchedulerBase
from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.sequence import Sequence


class StaticBatchScheduler(SchedulerBase):
    def __init__(self, *args, max_model_len: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_model_len = max_model_len
        self.batch: list[Sequence] = []  # members of the current batch, finished ones included

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        if all(s.is_finished for s in self.batch):
            self._start_batch(output)
            return output
        for seq in self.batch:
            if seq.is_finished:
                output.num_padding_tokens += 1  # the slot of a finished member still computes
            else:
                self._record(seq, 1, output)
        return output

    def _start_batch(self, output: SchedulerOutput) -> None:
        self.batch = []
        self.waiting.sort(key=lambda s: s.metrics.arrival_time)
        for seq in list(self.waiting):
            if len(self.batch) == self.config.static_batch_size:
                break
            if not self.admits(seq):  # held back by a gate: the others go ahead
                continue
            # Reserve the whole sequence up front, as a static batch does: nobody is preempted.
            full_len = min(seq.num_prompt_tokens + (seq.params.max_tokens or self.max_model_len),
                           self.max_model_len)
            if not self.block_manager.can_allocate(seq, full_len, []):
                break
            self._admit(seq, seq.num_prompt_tokens, [], output)
            self.block_manager.append_slots(seq, full_len)
            self.batch.append(seq)
        if self.batch:
            longest = max(s.num_prompt_tokens for s in self.batch)
            output.num_padding_tokens = sum(longest - s.num_prompt_tokens for s in self.batch)
