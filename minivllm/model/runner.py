"""Turns a step's BatchInputs into one forward pass over a packed batch, and returns the logits of
the sequences that sample this step (and of the prompt positions that prompt_logprobs scores)."""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from minivllm.model.attention import AttentionMetadata, PrefillSpan, decode_mask, kv_cache_shapes
from minivllm.model.batch import BatchInputs
from minivllm.model.cuda_graphs import DecodeGraphs
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
        self.num_blocks = num_blocks  # the KV pool's, in blocks of block_size tokens
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
        self.graphs: DecodeGraphs | None = None  # captured decode steps (CUDA), see use_cuda_graphs

    def use_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode step per batch-size bucket (cuda_graphs.py), where the device and kernels allow."""
        if DecodeGraphs.applies(self):
            self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)

    def stats(self) -> dict[str, Any]:
        """What the model counts, for the engine's stats: a mixture of experts' tokens per expert and layer."""
        return {"moe_expert_tokens": self.model.expert_load()} if self.model.config.num_experts else {}

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """Logits (float32): the last `num_logits` rows of each span that has them, in the order of
        `batch.spans` (a verify's: its last token's, then each draft token's), then one row per position
        of each span's `prompt_logprob_positions`, in the same order."""
        if self.graphs is not None and (logits := self.graphs.replay(batch)) is not None:
            return logits
        start = time.perf_counter()
        input_ids, positions, meta, sample_idx, lora_spans = self._prepare(batch)
        self.prepare_time += time.perf_counter() - start
        with self.model.lora.step(lora_spans) if lora_spans else contextlib.nullcontext():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[sample_idx])

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's logits are the same bits whatever else shares its steps: true when every
        GEMM, layer op and the attention run the native kernels (kernels.py), not the torch twins."""
        lora = self.model.lora
        return (self.attention_kernel is not None and self.model.uses_native_kernels
                and (lora is None or lora.kernel is not None))

    def _prepare(self, batch: BatchInputs):
        # Decodes (one-row spans) first, grouped by LoRA adapter, the base's first; then the longer
        # spans (prefill chunks, verifies); then padding.
        decodes = sorted((s for s in batch.spans if len(s.token_ids) == 1),
                         key=lambda s: (s.lora is not None, id(s.lora)))
        prefills = [s for s in batch.spans if len(s.token_ids) > 1]
        spans = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        rows: list[tuple[int, int, int]] = []  # (first row, rows, context of the first query)
        first_row: dict[int, int] = {}  # id(span) -> its first row in the packed batch
        bs = self.block_size
        for span in spans:  # runs per sequence per step
            start, n, table = span.start, len(span.token_ids), span.block_table
            first_row[id(span)] = len(ids)
            rows.append((len(ids), n, start + 1))
            ids += span.token_ids
            if n == 1:  # a decode: most spans
                pos.append(start)
                slot_blocks.append(table[start // bs])
                slot_offsets.append(start % bs)
            else:
                positions = range(start, start + n)
                pos += positions
                slot_blocks += [table[p // bs] for p in positions]
                slot_offsets += [p % bs for p in positions]
        ids += [0] * batch.num_padding_tokens
        pos += [0] * batch.num_padding_tokens

        dev = self.device
        max_blocks = max((len(s.block_table) for s in spans), default=0)
        span_starts, span_lens, span_ctx0 = torch.tensor(rows, dtype=torch.long, device=dev).view(-1, 3).T.contiguous()
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            span_starts=span_starts, span_lens=span_lens,
            span_ctx0=span_ctx0, num_decodes=len(decodes), kernel=self.attention_kernel,
            max_span_len=max((n for _, n, _ in rows), default=1),
            block_tables=torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in spans],
                                      dtype=torch.long, device=dev).view(len(spans), max_blocks))
        if any(s.long_rope for s in prefills):  # decodes are past the threshold: long by position already
            meta.long_rope = torch.tensor([s.long_rope for s in spans for _ in s.token_ids] +
                                          [False] * batch.num_padding_tokens, dtype=torch.bool, device=dev)
        if self.attention_kernel is None:  # what the torch path needs besides
            meta.decode_mask = decode_mask(span_ctx0[:len(decodes)], max_blocks * bs)
            meta.prefills = [self._prefill_span(s.block_table, first, s.start, s.start + len(s.token_ids))
                             for s, (first, _, _) in zip(prefills, rows[len(decodes):])]
        # The last num_logits rows of each span, then the rows of the prompt positions that
        # prompt_logprobs scores (row = first row + position - start).
        sample_idx = [i for s in batch.spans if s.num_logits
                      for i in range(first_row[id(s)] + len(s.token_ids) - s.num_logits, first_row[id(s)] + len(s.token_ids))]
        sample_idx += [first_row[id(s)] + p - s.start for s in batch.spans for p in s.prompt_logprob_positions]
        # (first row, rows, adapter) of each span that runs under a LoRA adapter (lora/layers.py)
        lora_spans = [(first, n, s.lora) for s, (first, n, _) in zip(spans, rows) if s.lora is not None]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, torch.tensor(sample_idx, dtype=torch.long, device=dev), lora_spans)

    def _prefill_span(self, block_table: list[int], offset: int, start: int, end: int) -> PrefillSpan:
        span = PrefillSpan(start=offset, num_tokens=end - start, context_len=end)
        if start > 0:  # part of the context is in the cache already: read it through the block table
            num_blocks = -(-end // self.block_size)
            span.block_table = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=self.device)
            q_pos = torch.arange(start, end, device=self.device)[:, None]
            span.mask = torch.arange(end, device=self.device)[None, :] <= q_pos
        return span
