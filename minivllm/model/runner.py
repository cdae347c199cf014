"""Turns a SchedulerOutput into one forward pass over a packed batch, and returns the logits of
the sequences that sample this step (and of the prompt positions that prompt_logprobs scores)."""
from __future__ import annotations

import contextlib
import time

import torch

from minivllm.engine.scheduler import SchedulerOutput, prompt_logprob_positions, will_sample
from minivllm.engine.sequence import Sequence
from minivllm.model.attention import AttentionMetadata, PrefillSpan, decode_mask, kv_cache_shapes
from minivllm.model.kernels import attention_kernel
from minivllm.model.kv_cache import allocate_kv_caches, kv_bytes_per_token, kv_format
from minivllm.model.decoder import CausalLM
from minivllm.model.model_config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Pool bytes per block over all layers, scales included (kv_cache.py)."""
    return block_size * kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                           dtype, kv_format(kv_cache_dtype))


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.prepare_time = 0.0  # seconds spent building inputs, for the engine's step breakdown
        cfg = model.config
        k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.attention_kernel = attention_kernel(device, dtype, cfg.head_dim,
                                                 cfg.num_attention_heads // cfg.num_key_value_heads, block_size,
                                                 kv_cache_dtype)
        self.kv_caches = allocate_kv_caches(cfg.num_hidden_layers, k_shape, v_shape, dtype, device,
                                            kv_format(kv_cache_dtype))

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits (float32): one row per sequence that samples, in the order of `output.scheduled` (1 + k
        rows for one that verifies k draft tokens: its last token's, then each draft token's), then one
        row per position that scores a prompt token (`prompt_logprob_positions`), in the same order."""
        start = time.perf_counter()
        input_ids, positions, meta, sample_idx, lora_spans = self._prepare(output)
        self.prepare_time += time.perf_counter() - start
        with self.model.lora.step(lora_spans) if lora_spans else contextlib.nullcontext():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[sample_idx])

    def _slot(self, seq: Sequence, position: int) -> tuple[int, int]:
        """Where the K/V of `seq`'s token at `position` lives in the pool: (block, offset in it)."""
        return seq.block_table[position // self.block_size], position % self.block_size

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's logits are the same bits whatever else shares its steps: true when every
        GEMM, layer op and the attention run the native kernels (kernels.py), not the torch twins."""
        lora = self.model.lora
        return (self.attention_kernel is not None and self.model.uses_native_kernels
                and (lora is None or lora.kernel is not None))

    def _prepare(self, output: SchedulerOutput):
        # Decodes first (grouped by LoRA adapter, the base's first), then prefill chunks, then padding;
        # one span of rows per sequence.
        decodes = sorted(((s, n) for s, n in output.scheduled if n == 1),
                         key=lambda e: (e[0].lora is not None, id(e[0].lora)))
        prefills = [(s, n) for s, n in output.scheduled if n > 1]
        scheduled = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        slots: list[tuple[int, int]] = []
        spans: list[tuple[int, int, int]] = []  # (first row, rows, context of the first query)
        row_of_position_0: dict[int, int] = {}  # id(seq) -> row p - p of its tokens in the packed batch
        drafts = output.scheduled_spec_decode_tokens
        for seq, n in scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            spans.append((len(ids), n, start + 1))
            ids.extend(seq.token_ids[start:end])
            if drafts:  # a verify: the draft tokens follow the sequence's last one, as a chunk
                ids.extend(drafts.get(seq.request_id, ()))
            pos.extend(range(start, end))
            slots.extend(self._slot(seq, p) for p in range(start, end))
            row_of_position_0[id(seq)] = len(ids) - end
        ids.extend([0] * output.num_padding_tokens)
        pos.extend([0] * output.num_padding_tokens)

        dev = self.device
        slot_blocks, slot_offsets = torch.tensor(slots, dtype=torch.long, device=dev).view(-1, 2).T.contiguous()
        max_blocks = max((len(s.block_table) for s, _ in scheduled), default=0)
        span_starts, span_lens, span_ctx0 = torch.tensor(spans, dtype=torch.long, device=dev).view(-1, 3).T.contiguous()
        meta = AttentionMetadata(
            slot_blocks=slot_blocks, slot_offsets=slot_offsets, span_starts=span_starts, span_lens=span_lens,
            span_ctx0=span_ctx0, num_decodes=len(decodes), kernel=self.attention_kernel,
            block_tables=torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s, _ in scheduled],
                                      dtype=torch.long, device=dev).view(len(scheduled), max_blocks))
        if self.attention_kernel is None:  # what the torch path needs besides
            meta.decode_mask = decode_mask(span_ctx0[:len(decodes)], max_blocks * self.block_size)
            meta.prefills = [self._prefill_span(seq, first, seq.num_computed_tokens, seq.num_computed_tokens + n)
                             for (seq, n), (first, _, _) in zip(prefills, spans[len(decodes):])]
        # The last token (and each draft token) of each sequence that samples, then the prompt positions
        # that prompt_logprobs scores.
        sample_idx = [row_of_position_0[id(s)] + p for s, n in output.scheduled if will_sample(s, n)
                      for p in range(len(s.token_ids) - 1, s.num_computed_tokens + n)]
        sample_idx += [row_of_position_0[id(s)] + p for s, n in output.scheduled for p in prompt_logprob_positions(s, n)]
        # (first row, rows, adapter) of each sequence that runs under a LoRA adapter (lora/layers.py)
        lora_spans = [(first, n, seq.lora) for (seq, _), (first, n, _) in zip(scheduled, spans) if seq.lora is not None]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, torch.tensor(sample_idx, dtype=torch.long, device=dev), lora_spans)

    def _prefill_span(self, seq: Sequence, offset: int, start: int, end: int) -> PrefillSpan:
        span = PrefillSpan(start=offset, num_tokens=end - start, context_len=end)
        if start > 0:  # part of the context is in the cache already: read it through the block table
            num_blocks = -(-end // self.block_size)
            span.block_table = torch.tensor(seq.block_table[:num_blocks], dtype=torch.long, device=self.device)
            q_pos = torch.arange(start, end, device=self.device)[:, None]
            span.mask = torch.arange(end, device=self.device)[None, :] <= q_pos
        return span
