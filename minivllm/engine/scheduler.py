"""Continuous batching: every step the scheduler rebuilds the batch under three budgets.

Budgets: tokens per step (`max_num_batched_tokens`), running sequences (`max_num_seqs`) and free
KV-cache blocks. One rule covers prefill and decode: a scheduled sequence gets `num_new_tokens` =
what it still lacks (`num_tokens - num_computed_tokens`), cut to the budget left. A decode is the
case where that is 1. The policy (policies.py) decides the order of the waiting queue and the
preemption victims; this file decides how budgets are spent, draft tokens included: a decode may
carry the draft tokens a step extension proposed for it (`seq.spec_token_ids`), verified in the same
step as a chunk of 1 + k tokens, when the budget and the blocks allow. Drafts never preempt anyone.
Before a waiting request starts, every admission gate (seams.py) must admit it; one held back lets
the others go ahead.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.policies import SchedulingPolicy
from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.seams import AdmissionGate
from minivllm.engine.sequence import Sequence, SequenceStatus


def is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    return num_new_tokens == 1 and seq.num_output_tokens > 0 and seq.num_uncomputed_tokens == 1


def will_sample(seq: Sequence, num_new_tokens: int) -> bool:
    """A sequence samples once the step computes its last token (past it: the draft tokens it verifies,
    each of which samples too)."""
    return seq.num_computed_tokens + num_new_tokens >= len(seq.token_ids)


def prompt_logprob_positions(seq: Sequence, num_new_tokens: int) -> range:
    """The positions this step computes whose logits score a prompt token not yet scored (position p
    scores token p + 1), for a request that asks for prompt_logprobs; after a preemption the recomputed
    positions are not scored twice."""
    if seq.prompt_logprobs is None:
        return range(0)
    start = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
    return range(start, min(seq.num_computed_tokens + num_new_tokens, seq.num_prompt_tokens - 1))


class SchedulerBase:
    """Queues, admission, preemption and finishing: what every scheduler shares."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, policy: SchedulingPolicy,
                 clock: Callable[[], float] = time.perf_counter, gates: Iterable[AdmissionGate] = ()) -> None:
        self.config = config
        self.block_manager = block_manager
        self.policy = policy
        self.clock = clock  # tests drive time by hand
        self.gates = list(gates)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admits(self, seq: Sequence) -> bool:
        """Whether every admission gate lets waiting `seq` start now."""
        return all(gate.admits(seq, self.running) for gate in self.gates)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.policy.on_add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` in any state, freeing its blocks. Finishing twice is a no-op."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = self.clock()
        self.policy.on_finish(seq)

    def on_step_done(self, output: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        """The runner has written K/V for every scheduled token; `num_rejected` (request_id -> count)
        says how many draft tokens at the end of a sequence's chunk were rejected. Their K/V is rolled
        back: they no longer count as computed, and blocks that hold only them are freed (never cached:
        only blocks full of computed tokens are)."""
        bm = self.block_manager
        caching, block_size = bm.enable_prefix_caching, bm.block_size
        for seq, n in output.scheduled:
            seq.num_computed_tokens += n
            if num_rejected and (rejected := num_rejected.get(seq.request_id)):
                seq.num_computed_tokens -= rejected
                bm.free_tail(seq)
            # Only when a block has filled (a decode fills one every block_size steps).
            if caching and seq.num_computed_tokens >= (seq.num_cached_blocks + 1) * block_size:
                bm.cache_full_blocks(seq)

    def _admit(self, seq: Sequence, num_new_tokens: int, hits: list[int], output: SchedulerOutput) -> None:
        self.block_manager.allocate(seq, num_new_tokens, hits)
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = self.clock()
        self._record(seq, num_new_tokens, output)

    def _record(self, seq: Sequence, num_new_tokens: int, output: SchedulerOutput,
                decode: bool | None = None) -> None:
        output.scheduled.append((seq, num_new_tokens))
        output.decode_flags.append(is_decode(seq, num_new_tokens) if decode is None else decode)
        self.policy.on_scheduled(seq, num_new_tokens)

    def _preempt(self, seq: Sequence, output: SchedulerOutput) -> int:
        """Preempt by recompute: drop `seq`'s K/V and send it to the front of the queue; its
        output so far is kept. Returns the tokens it had been granted this step (to refund)."""
        refund = 0
        for i, (s, n) in enumerate(output.scheduled):
            if s is seq:
                refund = n
                del output.scheduled[i]
                del output.decode_flags[i]
                output.scheduled_spec_decode_tokens.pop(seq.request_id, None)
                break
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, seq)
        output.preempted.append(seq)
        return refund


class Scheduler(SchedulerBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reserve_blocks = int(self.config.watermark * self.block_manager.num_blocks)
        # Without chunking, a prompt that found no room after the decodes gets the next step first.
        self._prefill_next = False
        self.num_steps = 0
        self._beside_decodes = False  # whether this step has decodes (a long prompt's chunk waits its turn)

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        output = SchedulerOutput()
        self.budget = self.config.max_num_batched_tokens
        self.num_partial = 0
        decodes, prefills = [], []
        for s in self.running:  # one pass, in running order (s.is_prefilling, inlined: it runs per sequence)
            (prefills if len(s.token_ids) - s.num_computed_tokens > 1 else decodes).append(s)
        self.num_steps += 1
        self._beside_decodes = bool(decodes)
        if self.config.schedule_order == "prefill-first" or self._prefill_next:
            self._prefill_next = False
            self._schedule_running(prefills, output)
            self._schedule_waiting(output, now)
            self._schedule_running(decodes, output)
        else:
            self._schedule_running(decodes + prefills, output)
            self._schedule_waiting(output, now)
        return output

    def _chunk(self, seq: Sequence, num_uncomputed: int) -> int:
        """How many of `num_uncomputed` tokens `seq` gets this step (0: none)."""
        n = min(num_uncomputed, self.budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_uncomputed > 1:
            n = min(n, threshold)
        if n < num_uncomputed:
            if not self.config.enable_chunked_prefill or self.num_partial >= self.config.max_num_partial_prefills:
                return 0
        return n

    def _waits_its_turn(self, seq: Sequence, num_uncomputed: int) -> bool:
        """Whether a partial prompt over the long-prefill threshold sits this step out: beside decodes it
        gets a chunk every `long_prefill_interval` steps. Each chunk reads the whole context so far, so a
        bigger chunk less often costs the decodes less per prompt token than a small one every step."""
        interval, threshold = self.config.long_prefill_interval, self.config.long_prefill_token_threshold
        return (interval > 1 and bool(threshold) and num_uncomputed > threshold and self._beside_decodes
                and seq.last_chunk_step is not None and self.num_steps - seq.last_chunk_step < interval)

    def _schedule_running(self, candidates: list[Sequence], output: SchedulerOutput) -> None:
        # Runs for every running sequence every step: properties are read once into locals.
        running, try_append = SequenceStatus.RUNNING, self.block_manager.try_append
        for seq in candidates:
            if seq.status is not running:  # preempted earlier in this step
                continue
            num_uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            if num_uncomputed == 1:  # _chunk's answer for one token
                n = 1 if self.budget > 0 else 0
                if n and seq.spec_token_ids and self._schedule_draft(seq, output):
                    continue
            else:
                n = 0 if self._waits_its_turn(seq, num_uncomputed) else self._chunk(seq, num_uncomputed)
            if n == 0:
                continue
            while not try_append(seq, n):
                victim = self.policy.pick_victim(self.running)
                self.budget += self._preempt(victim, output)
                if victim is seq:
                    break
            else:
                self.num_partial += n < num_uncomputed
                self.budget -= n
                if num_uncomputed > 1:
                    seq.last_chunk_step = self.num_steps
                self._record(seq, n, output, n == 1 and num_uncomputed == 1 and len(seq.output_token_ids) > 0)

    def _schedule_draft(self, seq: Sequence, output: SchedulerOutput) -> bool:
        """Schedule `seq`'s decode with as much of its draft as the budget and the free blocks hold;
        False (nothing scheduled) when none fits, and the decode goes on alone."""
        k = min(len(seq.spec_token_ids), self.budget - 1)
        if k <= 0 or not self.block_manager.try_append(seq, 1 + k):
            return False
        self.budget -= 1 + k
        output.scheduled_spec_decode_tokens[seq.request_id] = seq.spec_token_ids[:k]
        self._record(seq, 1 + k, output, True)
        return True

    def _schedule_waiting(self, output: SchedulerOutput, now: float) -> None:
        if output.preempted:  # memory is short: let the running sequences drain first
            return
        self.policy.sort_waiting(self.waiting, now)
        bs = self.block_manager.block_size
        for seq in list(self.waiting):
            if self.budget == 0:
                return
            if self.gates and not self.admits(seq):  # held back: the others go ahead (as in vLLM v1)
                continue
            hits = self.block_manager.match_prefix(seq)
            store = self.block_manager.block_store
            if store is not None and self._room_for(seq, seq.num_tokens - len(hits) * bs, hits):
                # The blocks that follow, copied back from the block store (a fraction of what computing
                # them costs); only for a prompt that fits, so that every load is used.
                if self.block_manager.reading_from_store(seq, hits):
                    continue  # its blocks are being read from disk: the others go ahead meanwhile
                hits = self.block_manager.load_from_store(seq, hits)
            num_uncomputed = seq.num_tokens - len(hits) * bs
            n = self._chunk(seq, num_uncomputed)
            if n == 0 and not self.config.enable_chunked_prefill:
                if output.scheduled:  # the whole prompt does not fit beside the others
                    self._prefill_next = True
                    return
                n = num_uncomputed  # longer than the whole budget: it runs alone
            if n == 0:
                return
            while len(self.running) >= self.config.max_num_seqs or not self._room_for(seq, num_uncomputed, hits):
                if not self._preempt_for(seq, output, now):
                    return  # keep the policy's order: nobody jumps the head of the queue
            self.num_partial += n < num_uncomputed
            self.budget -= n
            seq.last_chunk_step = self.num_steps
            self._admit(seq, n, hits, output)

    def _room_for(self, seq: Sequence, num_uncomputed: int, hits: list[int]) -> bool:
        """Admit only with blocks for the whole rest of the prompt plus the watermark, even when
        this step computes only a chunk: else the prompt grows into a preempt-readmit loop."""
        reserve = self.reserve_blocks if self.running else 0
        return self.block_manager.can_allocate(seq, num_uncomputed, hits, reserve)

    def _preempt_for(self, seq: Sequence, output: SchedulerOutput, now: float) -> bool:
        """Make room for a blocked waiting `seq` if the policy ranks it above a running one."""
        if not self.running:
            return False
        victim = self.policy.pick_victim(self.running)
        if not self.policy.may_preempt_for(seq, victim, now):
            return False
        self.budget += self._preempt(victim, output)
        self.waiting.remove(victim)  # behind `seq`, which is being admitted: keep queue order sane
        self.waiting.append(victim)
        return True
