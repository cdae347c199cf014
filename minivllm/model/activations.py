"""The MLP's activations in torch: act(gate) * up from the fused gate_up output, the twins of
csrc/layer_ops.c's `*_and_mul` (model_config.ACTIVATIONS). Element by element, so batch-invariant as
they are: the CUDA path runs gpt-oss's clamped SwiGLU from here."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.model.model_config import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "swiglu_oai":  # as transformers' GptOssExperts, each op rounded to the dtype
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return gate * up
