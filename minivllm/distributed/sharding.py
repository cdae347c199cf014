"""Megatron-style shards of a Llama-family checkpoint, cut from a reader's (name, tensor) stream
before model/weights.py fuses q/k/v and gate/up.

Column-parallel (each rank keeps a slice of the output rows, dim 0): q/k/v (and their biases) by
heads, gate/up by intermediate rows. Row-parallel (a slice of the input columns, dim 1): o_proj and
down_proj, whose partial outputs one all_reduce per layer sums. The embedding, the norms and the LM
head are replicated: only rank 0 computes logits, so a replicated LM head costs the workers nothing
and sampling needs no gather (a vocab-parallel head would split rank 0's GEMM but add an all-gather).

Heads: the query heads must divide evenly, as in vLLM. KV heads divide evenly too, or, when fewer
than the ranks, each is replicated on tensor_parallel_size / num_kv_heads ranks.

Every cut is `tensor.narrow(dim, start, length)`, so a quantized weight object that supports
narrow (at its block boundaries) shards the same way.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.model.model_config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    """(start, length) along its dimension of each kind of slice that `rank` keeps."""

    q_rows: tuple[int, int]
    kv_rows: tuple[int, int]
    mlp_rows: tuple[int, int]

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
        check_divisible(config, world_size)
        d = config.head_dim
        q_heads = config.num_attention_heads // world_size
        kv_heads = max(1, config.num_key_value_heads // world_size)
        # With fewer KV heads than ranks, ranks r .. r + replicas - 1 share KV head r // replicas: the
        # one their query heads attend with.
        kv_first = rank * kv_heads if config.num_key_value_heads >= world_size else \
            rank // (world_size // config.num_key_value_heads)
        mlp = config.intermediate_size // world_size
        return cls((rank * q_heads * d, q_heads * d), (kv_first * d, kv_heads * d), (rank * mlp, mlp))

    def cuts(self) -> dict[str, tuple[int, tuple[int, int]]]:
        """Projection name -> (the dimension it is cut along, (start, length))."""
        return {"q_proj": (0, self.q_rows), "k_proj": (0, self.kv_rows), "v_proj": (0, self.kv_rows),
                "gate_proj": (0, self.mlp_rows), "up_proj": (0, self.mlp_rows),
                "o_proj": (1, self.q_rows), "down_proj": (1, self.mlp_rows)}


def check_divisible(config: ModelConfig, world_size: int) -> None:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's {heads} attention "
                         f"heads ({kv_heads} KV heads): each rank must hold whole heads; use a size that "
                         f"divides {heads}")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} and the model's {kv_heads} KV heads: one must "
                         "divide the other (KV heads are split, or replicated when fewer than the ranks)")
    if config.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's intermediate size "
                         f"{config.intermediate_size}")


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's model: its heads and its slice of the MLP; the rest unchanged."""
    check_divisible(config, world_size)
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                               num_key_value_heads=max(1, config.num_key_value_heads // world_size),
                               intermediate_size=config.intermediate_size // world_size)


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, rank: int,
                  world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The loader's stream with every column- and row-parallel tensor cut to `rank`'s slice."""
    cuts = ShardPlan.of(config, rank, world_size).cuts()
    for name, tensor in weights:
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if module in cuts:
            dim, (start, length) = cuts[module]
            tensor = tensor.narrow(dim, start, length)  # (o_proj and down_proj have no bias in this family)
            if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                tensor = tensor.contiguous()  # the slice alone, not a view that keeps the whole alive
        yield name, tensor


class RowParallel(nn.Module):
    """A row-parallel projection: the rank's partial product, summed over the ranks in place."""

    def __init__(self, linear: nn.Module, group) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


def make_row_parallel(model: nn.Module, group) -> None:
    """Wrap every layer's o_proj and down_proj (the model file stays single-rank). The native layer
    loop (native_forward.py) runs all layers in one C call with no all_reduce between them, so a
    rank runs decoder.py's Python loop over the same kernels instead."""
    model.native_forward = None
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
