"""Mixture of experts: the router's choice and the experts' run, for decoder.py's SparseMoE.

A token reads only the `k` experts its router picks, so a step groups its tokens by expert and runs
each chosen expert once over all the tokens that chose it: every expert's weights are read once per
step, however many tokens share it (llama.cpp's `mul_mat_id`, vLLM's fused MoE). Batch-invariant as
the rest of the engine: an expert's rows go through the same row-independent kernels whatever their
number, and a token's k outputs are summed in its own top-k order, never in an order that depends on
which other tokens share the step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def route(logits: torch.Tensor, k: int, routing: str, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits [tokens, experts] -> (weights [tokens, k] float32, expert ids [tokens, k]),
    best first, as transformers computes them (model_config.ROUTINGS)."""
    logits = logits.float()
    if routing == "topk_softmax":
        top, ids = logits.topk(k, dim=-1)
        return top.softmax(dim=-1), ids
    weights, ids = logits.softmax(dim=-1).topk(k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                experts: Sequence[Callable[[torch.Tensor], torch.Tensor]], load: torch.Tensor | None = None
                ) -> torch.Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every token t. Each chosen expert runs once,
    over the rows routed to it; `load` [experts], if given, counts the tokens each expert took."""
    tokens, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=len(experts))
    if load is not None:
        load += counts
    outputs = x.new_empty(tokens * k, x.shape[-1])
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows = order[start:start + count]
            outputs[rows] = experts[expert](x[rows // k])
            start += count
    outputs = outputs.view(tokens, k, -1)
    weights = weights.to(x.dtype)  # as transformers weighs each expert's output, in the model's dtype
    out = outputs[:, 0] * weights[:, :1]
    for slot in range(1, k):  # in each token's own top-k order: the same sum whatever else is in the step
        out = out + outputs[:, slot] * weights[:, slot:slot + 1]
    return out
