"""Turns a SchedulerOutput into one forward pass over a packed batch, and returns the logits of
the sequences that sample this step."""
from __future__ import annotations

import time

import torch

from minivllm.engine.scheduler import SchedulerOutput, will_sample
from minivllm.engine.sequence import Sequence
from minivllm.model.attention import AttentionMetadata, PrefillSpan, decode_mask, kv_cache_shapes
from minivllm.model.kernels import decode_attention_kernel
from minivllm.model.kv_cache import allocate_kv_caches
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.prepare_time = 0.0  # seconds spent building inputs, for the engine's step breakdown
        cfg = model.config
        k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.decode_kernel = decode_attention_kernel(device, dtype, cfg.head_dim,
                                                     cfg.num_attention_heads // cfg.num_key_value_heads, block_size)
        self.kv_caches = allocate_kv_caches(cfg.num_hidden_layers, k_shape, v_shape, dtype, device)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits [num_sampling, vocab] (float32), in the order of `output.scheduled`."""
        start = time.perf_counter()
        input_ids, positions, meta, sample_idx = self._prepare(output)
        self.prepare_time += time.perf_counter() - start
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[sample_idx])

    def _slot(self, seq: Sequence, position: int) -> tuple[int, int]:
        """Where the K/V of `seq`'s token at `position` lives in the pool: (block, offset in it)."""
        return seq.block_table[position // self.block_size], position % self.block_size

    def _prepare(self, output: SchedulerOutput):
        # Decodes first (one batched attention call), then prefill chunks, then padding.
        decodes = [(s, n) for s, n in output.scheduled if n == 1]
        prefills = [(s, n) for s, n in output.scheduled if n > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[tuple[int, int]] = []
        where: dict[int, int] = {}  # id(seq) -> index of its last token in the packed batch
        for seq, _ in decodes:
            p = seq.num_computed_tokens
            where[id(seq)] = len(ids)
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(self._slot(seq, p))
        spans = []
        for seq, n in prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            spans.append(self._prefill_span(seq, len(ids), start, end))
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(self._slot(seq, p) for p in range(start, end))
            where[id(seq)] = len(ids) - 1
        ids.extend([0] * output.num_padding_tokens)
        pos.extend([0] * output.num_padding_tokens)

        dev = self.device
        slot_blocks, slot_offsets = torch.tensor(slots, dtype=torch.long, device=dev).view(-1, 2).T.contiguous()
        meta = AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=slot_offsets,
                                 num_decodes=len(decodes), prefills=spans, decode_kernel=self.decode_kernel)
        if decodes:
            max_blocks = max(len(s.block_table) for s, _ in decodes)
            meta.decode_block_tables = torch.tensor(
                [s.block_table + [0] * (max_blocks - len(s.block_table)) for s, _ in decodes],
                dtype=torch.long, device=dev)
            meta.decode_context_lens = torch.tensor([s.num_computed_tokens + 1 for s, _ in decodes],
                                                    dtype=torch.long, device=dev)
            if self.decode_kernel is None:
                meta.decode_mask = decode_mask(meta.decode_context_lens, max_blocks * self.block_size)
        sample_idx = [where[id(s)] for s, n in output.scheduled if will_sample(s, n)]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, torch.tensor(sample_idx, dtype=torch.long, device=dev))

    def _prefill_span(self, seq: Sequence, offset: int, start: int, end: int) -> PrefillSpan:
        span = PrefillSpan(start=offset, num_tokens=end - start, context_len=end)
        if start > 0:  # part of the context is in the cache already: read it through the block table
            num_blocks = -(-end // self.block_size)
            span.block_table = torch.tensor(seq.block_table[:num_blocks], dtype=torch.long, device=self.device)
            q_pos = torch.arange(start, end, device=self.device)[:, None]
            span.mask = torch.arange(end, device=self.device)[None, :] <= q_pos
        return span
