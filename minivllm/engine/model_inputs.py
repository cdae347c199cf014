"""The engine's requests as the model package takes them (model/batch.py): a SchedulerOutput as the
runner's BatchInputs, and the sequences that sample as the sampler's rows."""
from __future__ import annotations

from minivllm.engine.scheduler import prompt_logprob_positions
from minivllm.engine.scheduler_output import SchedulerOutput
from minivllm.engine.sequence import Sequence
from minivllm.model.batch import NO_POSITIONS, BatchInputs, SamplingRow, SeqSpan


def batch_inputs(sched: SchedulerOutput) -> BatchInputs:
    """One span per scheduled sequence, in the scheduler's order: its uncomputed tokens this step
    computes, then the draft tokens it verifies (the last of its num_new_tokens)."""
    drafts = sched.scheduled_spec_decode_tokens
    spans = []
    for (seq, n), decode in zip(sched.scheduled, sched.decode_flags):  # runs per sequence per step
        start, token_ids = seq.num_computed_tokens, seq.token_ids
        ids = token_ids[start:start + n]
        if drafts and (draft := drafts.get(seq.request_id)):
            ids += draft
        # It samples once the step computes its last token (scheduler.will_sample), and at each draft token.
        num_logits = start + n - len(token_ids) + 1 if start + n >= len(token_ids) else 0
        scored = NO_POSITIONS if seq.prompt_logprobs is None else prompt_logprob_positions(seq, n)
        spans.append(SeqSpan(ids, start, seq.block_table, num_logits, scored, seq.lora, decode, seq.long_rope))
    return BatchInputs(spans, sched.num_padding_tokens)


def sampling_rows(sampling: list[Sequence],
                  drafts: dict[str, list[int]]) -> tuple[list[SamplingRow], list[SamplingRow]]:
    """The sampler's rows, as the runner's logits come: per sequence its own, then one per draft token
    it verifies (with the draft tokens before that row taken as output, so that penalties count them,
    min_tokens and bad_words see them, and a seeded request draws the noise of the row's position);
    and each sequence's own row, in `sampling`'s order."""
    rows, own = [], []
    for seq in sampling:
        row = SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.eos_token_ids,
                          seq.bad_words_token_ids)
        rows.append(row)
        own.append(row)
        if draft := drafts.get(seq.request_id):
            rows += [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids + draft[:j],
                                 seq.eos_token_ids, seq.bad_words_token_ids) for j in range(1, len(draft) + 1)]
    return rows, own
