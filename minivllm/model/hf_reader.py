"""A Hugging Face checkpoint directory -> its `ModelConfig` and its weights, through the family's
registry entry (registry.py): config.json's architecture names the entry, whose switches and
conventions complete the common fields (Gemma's norm weights get the +1 that its forward adds; Mixtral's
and Granite-MoE's expert tensors get the names the decoder has, and stacked experts are split per expert).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from minivllm.model.model_config import ModelConfig
from minivllm.model.quant import MXFP4, QuantizedTensor
from minivllm.model.registry import Family, Switches, family, hf_family, rope_parameters

logger = logging.getLogger(__name__)

ACTIVATION_NAMES = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

# A multimodal checkpoint's language model (Gemma3ForConditionalGeneration), named as a plain one's.
_LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                            "language_model.lm_head.": "lm_head."}


def read_hf_checkpoint(path: Path, dtype: torch.dtype | None) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The directory's config and its weights under HF names, read lazily (loader.load_checkpoint)."""
    eos = None
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    config = read_hf_config(json.loads((path / "config.json").read_text()), eos, f"{path}/config.json")
    return config, _hf_weights(path, dtype, family(config.architecture))


def read_hf_config(cfg: dict, eos: int | list[int] | None, where: str) -> ModelConfig:
    """A config.json (its generation_config's eos, if any) -> ModelConfig. A multimodal Gemma 3 nests
    the language model's settings in `text_config`: that model is loaded, the vision tower left out."""
    fam = hf_family(cfg.get("architectures") or [], where)
    if "text_config" in cfg:
        logger.warning("%s: %s is multimodal; minivllm loads its language model and ignores the vision tower",
                       where, cfg["architectures"][0])
        cfg = {**cfg["text_config"], "architectures": cfg["architectures"],
               "tie_word_embeddings": cfg["text_config"].get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))}
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if activation not in ACTIVATION_NAMES:
        raise ValueError(f"{where}: activation {activation!r} is not supported; minivllm runs {', '.join(ACTIVATION_NAMES)}")
    heads = cfg["num_attention_heads"]
    rope = rope_parameters(cfg)
    eos = cfg.get("eos_token_id") if eos is None else eos
    fields: Switches = dict(
        architecture=fam.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        rope_scaling=cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
        attention_bias=cfg.get("attention_bias", False),
        hidden_act=ACTIVATION_NAMES[activation],
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
    )
    fields.update(fam.switches)
    fields.update({k: v for k, v in fam.hf_switches(cfg).items() if v is not None})
    return ModelConfig(**fields)


def _hf_weights(path: Path, dtype: torch.dtype | None, fam: Family) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        # safetensors maps the file (privately) and hands out views of it.
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("_scales"):  # read with its _blocks
                    continue
                tensor = f.get_tensor(name)
                if name.endswith("_blocks"):
                    yield from _mxfp4_experts(name, tensor, _partner(f, name, file))
                    continue
                if fam.hf_norm_offset and name.endswith("norm.weight"):  # in float32, as transformers adds it
                    tensor = tensor.float() + fam.hf_norm_offset
                prefix = next((p for p in _LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    name = _LANGUAGE_MODEL_PREFIXES[prefix] + name.removeprefix(prefix)
                for old, new in fam.hf_tensor_renames:
                    name = name.replace(old, new)
                split = _per_expert_transposed if fam.hf_experts_transposed else _per_expert
                for name, tensor in split(name, tensor):
                    yield name, tensor if dtype is None else tensor.to(dtype)


def _partner(f, name: str, file: Path) -> torch.Tensor:
    scales = name.removesuffix("_blocks") + "_scales"
    if scales not in f.keys():
        raise ValueError(f"{file}: {name} has no {scales} beside it (an MXFP4 tensor is blocks and scales)")
    return f.get_tensor(scales)


def _mxfp4_experts(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> Iterator[tuple[str, QuantizedTensor]]:
    """gpt-oss's MXFP4 experts (`..._blocks` uint8 [experts, out, in / 32, 16], `..._scales` uint8 [experts,
    out, in / 32]: byte j of a block holds its weights 2j and 2j + 1) as ggml's 17-byte MXFP4 blocks
    (the scale byte, then byte j holding weights j and j + 16), one matrix per expert; gate_up's rows
    interleaved, even ones the gate's. The same bits: both read the nibbles through E2M1's table."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"MXFP4 tensor {name} has shape {tuple(blocks.shape)} with scales {tuple(scales.shape)}; "
                         f"expected [experts, out, in / 32, 16] and [experts, out, in / 32]")
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # the 32 nibbles in weight order
    ggml = torch.cat((scales[..., None], values[..., :16] | (values[..., 16:] << 4)), dim=-1).flatten(-2)
    head, _, proj = name.removesuffix("_blocks").rpartition(".")
    for expert, rows in enumerate(ggml.unbind(0)):
        for part, part_rows in _gpt_oss_parts(f"{head}.{expert}", proj.removesuffix("_proj"), "weight", rows):
            yield part, QuantizedTensor(part_rows, MXFP4)


_STACKED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # [experts, out, in], gate rows before up rows


def _per_expert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stack of every expert's weight (transformers 5's layout, Granite-MoE's checkpoints), as one
    `experts.E.<proj>.weight` per expert; any other tensor as it is."""
    stacked = next((s for s in _STACKED_EXPERTS if name.removesuffix(".weight").endswith(s)), None)
    if stacked is None:
        yield name, tensor
        return
    if tensor.dim() != 3:
        raise ValueError(f"expert tensor {name} has shape {tuple(tensor.shape)}; expected [experts, out, in]")
    head, proj = name.removesuffix(".weight").rsplit(".", 1)
    for expert, weight in enumerate(tensor.unbind(0)):
        yield f"{head}.{expert}.{proj}.weight", weight


def _per_expert_transposed(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked experts, [experts, in, out] with gate and up columns interleaved (even: gate,
    odd: up) and a bias stack beside each, as one gate_proj, up_proj and down_proj per expert."""
    head, _, proj = name.rpartition(".")
    if not head.endswith("experts") or proj not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        yield name, tensor
        return
    base, _, kind = proj.partition("_proj")
    suffix = "bias" if kind == "_bias" else "weight"
    if tensor.dim() != (2 if suffix == "bias" else 3):
        raise ValueError(f"expert tensor {name} has shape {tuple(tensor.shape)}; expected "
                         f"{'[experts, out]' if suffix == 'bias' else '[experts, in, out]'}")
    for expert, t in enumerate(tensor.unbind(0)):
        yield from _gpt_oss_parts(f"{head}.{expert}", base, suffix, t.t() if suffix == "weight" else t)


def _gpt_oss_parts(expert: str, base: str, suffix: str, rows: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One gpt-oss expert's rows of `base` ("gate_up": gate and up interleaved, even rows the gate's; or
    "down") under the decoder's names, each part contiguous."""
    if base == "down":
        yield f"{expert}.down_proj.{suffix}", rows.contiguous()
    else:
        yield f"{expert}.gate_proj.{suffix}", rows[0::2].contiguous()
        yield f"{expert}.up_proj.{suffix}", rows[1::2].contiguous()
