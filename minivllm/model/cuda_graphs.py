"""Decode steps as CUDA graphs: the whole forward of a pure-decode step (embedding, every layer, the LM
head) captured once per batch-size bucket at start and replayed, so that a step costs one launch instead
of a few hundred from Python (vLLM's and nano-vllm's CUDA graphs; `--enforce-eager` turns them off).

Buckets are 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs. A step of n decodes replays the
smallest bucket >= n: its inputs are copied into the graph's static buffers, the rows past n padded
(token 0 at position 0, a KV slot of block -1, which the Triton write skips, so a padded row never
touches a real block) and their logits dropped. Only where the Triton kernels run (cuda_kernels.py):
there every kernel is batch-invariant, so a replayed step gives the same bits as the eager one, padded
rows or not. Anything else (a prefill or verify span, LoRA, prompt logprobs, a block table wider than
the buffers) runs eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.model.attention import AttentionMetadata
from minivllm.model.batch import BatchInputs
from minivllm.model.cuda_kernels import TritonAttention

MAX_CAPTURED_BATCH = 512


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then multiples of 8 up to max_num_seqs (itself included)."""
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 8))
    return sizes + [top]


_PADDING = (0, 0, -1, 0, 1)  # a padded row: token 0 at position 0, no KV write, a context of one token


@dataclass
class _Buffers:
    """The static inputs every graph reads (each bucket its first columns) and the logits they write."""
    # rows: input ids, positions, KV slot blocks (-1: no write), slot offsets, contexts; one column per span
    rows: torch.Tensor  # [5, max_batch]
    span_starts: torch.Tensor  # 0, 1, 2, ...: one row of the batch per span
    span_lens: torch.Tensor  # all 1
    block_tables: torch.Tensor  # [max_batch, max_blocks]
    logits: torch.Tensor  # [max_batch, vocab] float32

    def meta(self, batch: int, kernel: TritonAttention) -> AttentionMetadata:
        _, _, blocks, offsets, ctx = self.rows[:, :batch]
        return AttentionMetadata(slot_blocks=blocks, slot_offsets=offsets, span_starts=self.span_starts[:batch],
                                 span_lens=self.span_lens[:batch], span_ctx0=ctx,
                                 block_tables=self.block_tables[:batch], num_decodes=batch, kernel=kernel,
                                 max_span_len=1)


class DecodeGraphs:
    """The captured decode step of one runner, per bucket; `replay` runs a step through them or says None."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int) -> None:
        """runner: model.runner.ModelRunner, already holding its model and KV pool."""
        self.runner = runner
        self.block_size = runner.block_size
        self.buckets = batch_buckets(max_num_seqs)
        top, dev = self.buckets[-1], runner.device
        max_blocks = -(-max_model_len // self.block_size)
        rows = torch.tensor(_PADDING, dtype=torch.long, device=dev)[:, None].repeat(1, top)
        self.buffers = _Buffers(rows, torch.arange(top, device=dev), torch.ones(top, dtype=torch.long, device=dev),
                                torch.zeros(top, max_blocks, dtype=torch.long, device=dev),
                                torch.zeros(top, runner.model.config.vocab_size, dtype=torch.float32, device=dev))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    @staticmethod
    def applies(runner) -> bool:
        return runner.device.type == "cuda" and isinstance(runner.attention_kernel, TritonAttention)

    @torch.inference_mode()
    def _capture(self) -> None:
        model, kv, kernel, buf = self.runner.model, self.runner.kv_caches, self.runner.attention_kernel, self.buffers
        pool = None
        for batch in reversed(self.buckets):  # the largest first: the smaller ones reuse its memory pool
            meta = buf.meta(batch, kernel)

            def step(batch: int = batch, meta: AttentionMetadata = meta) -> None:
                hidden = model(buf.rows[0, :batch], buf.rows[1, :batch], kv, meta)
                buf.logits[:batch] = model.compute_logits(hidden)

            step()  # compiles the kernels and settles the allocator before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                step()
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def replay(self, batch: BatchInputs) -> torch.Tensor | None:
        """The step's logits (float32 [spans, vocab], in the order of batch.spans) from a captured graph, or
        None where the step is not a pure decode the graphs cover (the runner then runs it eagerly)."""
        spans = batch.spans
        n = len(spans)
        if not n or n > self.buckets[-1] or batch.num_padding_tokens or self.runner.model.lora is not None:
            return None
        max_blocks = self.buffers.block_tables.shape[1]
        for s in spans:
            if len(s.token_ids) != 1 or s.num_logits != 1 or s.prompt_logprob_positions or s.lora is not None \
                    or len(s.block_table) > max_blocks:
                return None
        size = next(b for b in self.buckets if b >= n)
        bs, buf = self.block_size, self.buffers
        rows = torch.tensor([_PADDING] * size, dtype=torch.long)
        rows[:n] = torch.tensor([[s.token_ids[0], s.start, s.block_table[s.start // bs], s.start % bs, s.start + 1]
                                 for s in spans], dtype=torch.long)
        width = max(len(s.block_table) for s in spans)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in spans], dtype=torch.long)
        buf.rows[:, :size].copy_(rows.T)
        buf.block_tables[:n, :width].copy_(tables)
        self.graphs[size].replay()
        return buf.logits[:n].clone()
