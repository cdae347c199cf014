"""Reading a LoRA adapter into low-rank factors per (layer, projection), whatever its format:

  PEFT's directory   adapter_config.json (r, lora_alpha, use_rslora, target_modules, rank/alpha patterns)
                     + adapter_model.safetensors (`...layers.N.self_attn.q_proj.lora_A.weight` [r, in],
                     `...lora_B.weight` [out, r])
  llama.cpp's GGUF   what convert_lora_to_gguf.py writes: general.type "adapter", adapter.lora.alpha,
                     `blk.N.attn_q.weight.lora_a` [r, in] and `.lora_b` [out, r] (Llama's q/k rows
                     permuted for llama.cpp's RoPE, as in its base files: undone here)

The adapter's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B. Anything this
engine cannot apply exactly (DoRA, trained biases, extra saved modules, projections other than
q/k/v/o/gate/up/down) is refused with a message naming it.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from minivllm.model.gguf_file import GGUFFile
from minivllm.model.gguf_reader import GGUF_NAMES, gguf_tensor, unpermute_rows

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (an adapter name may sit before .weight)
_PEFT_KEY = re.compile(r"(?:^|.*\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")


class AdapterError(ValueError):
    """An adapter that cannot be used; the message names the file and the problem."""


@dataclass
class LoRAFactors:
    a: torch.Tensor  # [rank, in_features] float32
    b: torch.Tensor  # [out_features, rank] float32, the adapter's scaling folded in


@dataclass
class AdapterWeights:
    factors: dict[tuple[int, str], LoRAFactors]  # (layer, projection in PROJECTIONS) -> its factors
    fingerprint: bytes  # a hash of the files' bytes: what the prefix cache keys this adapter's KV by

    @property
    def rank(self) -> int:
        return max(f.a.shape[0] for f in self.factors.values())


def read_adapter(path: str | Path, num_heads: int, num_kv_heads: int) -> AdapterWeights:
    """The adapter at `path`: a PEFT directory or a llama.cpp LoRA GGUF file (for which the base's
    head counts undo llama.cpp's row order: the file does not say them)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _read_peft(path)
    if path.is_file():
        return _read_gguf(path, {"q_proj": num_heads, "k_proj": num_kv_heads})
    raise AdapterError(f"{path}: no such adapter (a PEFT directory with {PEFT_CONFIG} or a LoRA .gguf file)")


# -- PEFT ----------------------------------------------------------------------------------------------
def _read_peft(path: Path) -> AdapterWeights:
    config_file, weights_file = path / PEFT_CONFIG, path / PEFT_WEIGHTS
    if not config_file.is_file():
        raise AdapterError(f"{path}: not a PEFT adapter directory (no {PEFT_CONFIG})")
    if not weights_file.is_file():
        raise AdapterError(f"{path}: no {PEFT_WEIGHTS} (only safetensors weights are read)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_file}: cannot read it ({e})") from None
    _check_peft_config(config, config_file)
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_file))
    except Exception as e:  # safetensors raises its own error types for a corrupt header or truncated data
        raise AdapterError(f"{weights_file}: cannot read it, the file is corrupt or not safetensors ({e})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _PEFT_KEY.fullmatch(key)
        if m is None or m.group(2) not in PROJECTIONS:
            raise AdapterError(f"{weights_file}: tensor {key!r} adapts a module minivllm's models do not adapt "
                               f"(supported: {', '.join(PROJECTIONS)} in the decoder layers)")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    factors = {}
    for (layer, projection), ab in sorted(pairs.items()):
        where = f"layer {layer} {projection}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights_file}: {where} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"].float(), ab["B"].float()
        rank = _pattern_value(config.get("rank_pattern"), layer, projection, config.get("r", a.shape[0]))
        alpha = _pattern_value(config.get("alpha_pattern"), layer, projection, config.get("lora_alpha", rank))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"{weights_file}: {where}: shape mismatch: lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)} do not have the config's rank {rank}")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        factors[(layer, projection)] = LoRAFactors(a.contiguous(), (b * scaling).contiguous())
    if not factors:
        raise AdapterError(f"{weights_file}: holds no LoRA weights")
    return AdapterWeights(factors, _fingerprint([config_file, weights_file]))


def _check_peft_config(config: dict, config_file: Path) -> None:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{config_file}: peft_type {kind!r} is not LoRA")
    if config.get("use_dora"):
        raise AdapterError(f"{config_file}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{config_file}: bias {config['bias']!r}: adapters that train biases are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{config_file}: modules_to_save {config['modules_to_save']} replaces whole modules "
                           "of the base, which adapters served together cannot do")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in PROJECTIONS]
        if unknown:
            raise AdapterError(f"{config_file}: target_modules {unknown} are modules the model lacks or minivllm "
                               f"does not adapt (supported: {', '.join(PROJECTIONS)})")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"{config_file}: r must be an integer >= 1, got {r!r}")


def _pattern_value(patterns: dict | None, layer: int, projection: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that matches the end of the
    module's name, else the default."""
    name = f"model.layers.{layer}.{'mlp' if projection in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}" \
           f".{projection}"
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", name):
            return value
    return default


# -- llama.cpp's LoRA GGUF -----------------------------------------------------------------------------
def _read_gguf(path: Path, heads: dict[str, int]) -> AdapterWeights:
    try:
        f = GGUFFile(path)
    except (ValueError, OSError, UnicodeDecodeError, IndexError, KeyError) as e:  # struct.error is a ValueError
        raise AdapterError(f"{path}: cannot read it as GGUF, the file is corrupt ({e})") from None
    if f.get("general.type") != "adapter" or f.get("adapter.type") != "lora":
        raise AdapterError(f"{path}: not a LoRA adapter GGUF (general.type {f.get('general.type')!r}, "
                           f"adapter.type {f.get('adapter.type')!r})")
    arch = f.get("general.architecture")
    alpha = float(f.get("adapter.lora.alpha", 0.0))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in f.tensors:
        parts = t.name.split(".")  # blk.N.attn_q.weight.lora_a
        module = GGUF_NAMES.get(parts[2], "") if len(parts) == 5 and parts[0] == "blk" else ""
        projection = module.rpartition(".")[2]
        if projection not in PROJECTIONS or parts[3:] not in (["weight", "lora_a"], ["weight", "lora_b"]):
            raise AdapterError(f"{path}: tensor {t.name!r} adapts a module minivllm's models do not adapt "
                               f"(supported: {', '.join(PROJECTIONS)} in the decoder layers)")
        try:
            tensor = gguf_tensor(f, t, torch.float32)
        except (ValueError, RuntimeError, KeyError) as e:
            raise AdapterError(f"{path}: tensor {t.name}: cannot decode it ({e})") from None
        pairs.setdefault((int(parts[1]), projection), {})[parts[4]] = tensor
    factors = {}
    for (layer, projection), ab in sorted(pairs.items()):
        if set(ab) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{path}: layer {layer} {projection} has only {', '.join(ab)}")
        a, b = ab["lora_a"], ab["lora_b"]
        rank = a.shape[0]
        if b.shape[-1] != rank:
            raise AdapterError(f"{path}: layer {layer} {projection}: shape mismatch: lora_a {tuple(a.shape)}, "
                               f"lora_b {tuple(b.shape)}")
        if arch == "llama" and projection in heads:  # llama.cpp's RoPE row order, as in loader._gguf_weights
            b = unpermute_rows(b, heads[projection])
        scaling = alpha / rank if alpha else 1.0  # llama.cpp's rule (llama-adapter.cpp)
        factors[(layer, projection)] = LoRAFactors(a.contiguous(), (b * scaling).contiguous())
    if not factors:
        raise AdapterError(f"{path}: holds no LoRA tensors")
    return AdapterWeights(factors, _fingerprint([path]))


def _fingerprint(files: list[Path]) -> bytes:
    digest = hashlib.sha256(b"lora")
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.digest()
