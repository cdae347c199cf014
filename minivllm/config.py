"""Engine configuration: one dataclass whose fields are also the CLI flags (vLLM's names)."""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")  # vLLM's names (fp8 = fp8_e4m3); int8 is ours
_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
               "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def cache_dir() -> Path:
    """Where minivllm keeps what it builds once (converted tokenizers, compiled kernels)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minivllm"


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "2GiB", "512MB", "1e9"."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse size {value!r} (use e.g. '2GiB' or '512MB')")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _flag(help: str, default: Any, choices: tuple | None = None) -> Any:
    """A config field that is also a CLI flag: its help text and choices live with it."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    model: str | None = _flag("GGUF file or Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct)", None)
    tokenizer: str | None = _flag("a Hugging Face directory whose tokenizer to use (default: the model's own; a GGUF "
                                  "file's is converted once, seconds for a large vocabulary)", None)
    dtype: str = _flag("weights and KV cache dtype", "auto", ("auto", "float32", "bfloat16", "float16"))
    device: str = _flag("where the model runs", "auto", ("auto", "cpu", "cuda"))
    quantization: str = _flag("weights: gguf keeps a GGUF file's quantized blocks, int8/int4 quantize at load, "
                              "none dequantizes; auto: gguf for a GGUF file on the CPU, else none", "auto",
                              ("auto", "none", "gguf", "int8", "int4"))
    max_model_len: int | None = _flag("longest prompt + output (default: the model's context length)", None)
    block_size: int = _flag("tokens per KV-cache block", 16)
    num_kv_blocks: int | None = _flag("size the KV pool by blocks (overrides --kv-cache-memory)", None)
    kv_cache_memory: str = _flag("size the KV pool by bytes, e.g. 2GiB", "1GiB")
    kv_cache_dtype: str = _flag("KV cache storage: auto (the model's dtype), or int8/fp8 (= fp8_e4m3)/fp8_e5m2 "
                                "with a float32 scale per token and kv head", "auto", KV_CACHE_DTYPES)
    max_num_seqs: int = _flag("most sequences running at once", 256)
    max_num_batched_tokens: int = _flag("token budget of one engine step", 2048)
    enable_chunked_prefill: bool = _flag("split long prompts over several steps", True)
    long_prefill_token_threshold: int = _flag("cap on one prompt's chunk per step (0: the budget)", 0)
    max_num_partial_prefills: int = _flag("prompts that may be cut mid-way in one step", 1)
    long_prefill_interval: int = _flag("steps between the chunks of a prompt over the long-prefill threshold "
                                       "while others decode (1: every step)", 1)
    schedule_order: str = _flag("who gets the token budget first", "decode-first", ("decode-first", "prefill-first"))
    scheduling_policy: str = _flag("order of the waiting queue and choice of preemption victims",
                                   "fcfs", ("fcfs", "sjf", "priority", "fair"))
    scheduler: str = _flag("continuous batching, or static batching as a baseline", "continuous",
                           ("continuous", "static"))
    static_batch_size: int = _flag("batch size of --scheduler static", 32)
    enable_prefix_caching: bool = _flag("reuse KV blocks of identical prompt prefixes", True)
    watermark: float = _flag("share of KV blocks kept free when admitting a prompt", 0.01)
    seed: int = _flag("seed of unseeded random sampling", 0)
    tensor_parallel_size: int = _flag("ranks that split every layer (torch.distributed: gloo on CPU, NCCL on "
                                      "CUDA); workers are spawned here, or started by torchrun", 1)
    distributed_executor_backend: str = _flag("who starts the tensor-parallel workers: processes of this host, or "
                                              "Ray actors placed on a Ray cluster's nodes", "mp", ("mp", "ray"))
    ray_address: str | None = _flag("the Ray cluster to join with --distributed-executor-backend ray (default: "
                                    "RAY_ADDRESS, else a Ray instance started here)", None)
    speculative_config: str | dict | None = _flag(
        'draftless speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4} or {"method": "suffix", ...}', None)
    kv_offloading_size: float | None = _flag("GiB of RAM that keep the prefix blocks the KV pool evicts, to be copied "
                                             "back instead of recomputed (vLLM's flag; off by default)", None)
    kv_offloading_dir: str | None = _flag("a directory that keeps evicted prefix blocks across restarts (several "
                                          "engines may share it)", None)
    kv_offloading_disk_size: float = _flag("GiB that --kv-offloading-dir may hold", 16.0)
    enable_lora: bool = _flag("serve LoRA adapters beside the base model (requests pick one by name)", False)
    max_loras: int = _flag("most distinct LoRA adapters in one step", 1)
    max_cpu_loras: int | None = _flag("LoRA adapters kept loaded, least recently used out (default: --max-loras)",
                                      None)
    max_lora_rank: int = _flag("largest LoRA rank accepted", 16)
    enforce_eager: bool = _flag("CUDA: run every step eagerly, without the decode step's CUDA graphs (vLLM's flag)",
                                False)
    trace_file: str | None = _flag("write a per-step CSV trace here (and a Chrome trace .json beside it)", None)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "static_batch_size",
                     "max_num_partial_prefills", "long_prefill_interval", "tensor_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        parse_size(self.kv_cache_memory)
        if self.tokenizer is not None and not (Path(self.tokenizer).expanduser() / "tokenizer_config.json").is_file():
            raise ValueError(f"tokenizer: {self.tokenizer!r} is not a directory of Hugging Face tokenizer files "
                             "(tokenizer_config.json, tokenizer.json)")
        if self.kv_offloading:
            if (self.kv_offloading_size or 0) < 0 or self.kv_offloading_disk_size <= 0:
                raise ValueError("kv_offloading_size and kv_offloading_disk_size must be positive GiB")
            if not self.enable_prefix_caching or self.scheduler == "static" or self.tensor_parallel_size > 1:
                raise ValueError("KV offloading keeps prefix-cache blocks: it needs enable_prefix_caching, "
                                 "--scheduler continuous and tensor_parallel_size 1")
        if self.enable_lora:
            if self.max_loras < 1 or (self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras):
                raise ValueError(f"max_loras must be >= 1 and max_cpu_loras >= max_loras; got {self.max_loras} "
                                 f"and {self.max_cpu_loras}")
            if self.scheduler == "static" or self.tensor_parallel_size > 1:
                raise ValueError("enable_lora needs --scheduler continuous and tensor_parallel_size 1")
        if self.speculative is not None and self.scheduler == "static":
            raise ValueError("speculative_config needs --scheduler continuous (a static batch verifies no drafts)")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}")

    @property
    def kv_offloading(self) -> bool:
        """Whether evicted prefix blocks are kept in a second tier (kv_tier/)."""
        return bool(self.kv_offloading_size) or self.kv_offloading_dir is not None

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed and checked (a ValueError names what is wrong); parsed on each
        call rather than kept, so that `vars(config)` stays the constructor's arguments."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    @property
    def torch_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        return torch.device(self.device)

    def weight_quantization(self, holds_blocks: bool) -> str:
        """The quantization the weights load with: `quantization` with auto resolved (a checkpoint in
        quantized blocks, a GGUF file or an MXFP4 directory (loader.holds_blocks), keeps them on the
        CPU, like llama.cpp; CUDA has no quantized kernels here: dequantize)."""
        if self.quantization == "auto":
            return "gguf" if holds_blocks and self.torch_device.type == "cpu" else "none"
        if self.quantization == "gguf" and not holds_blocks:
            raise ValueError("quantization='gguf' needs a GGUF file or an MXFP4 checkpoint; this is a float "
                             "Hugging Face checkpoint (use int8 or int4 to quantize it at load)")
        return self.quantization

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if bf16_is_fast(self.torch_device) else torch.float32
        return getattr(torch, self.dtype)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        for f in fields(EngineConfig):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata["help"]
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=f"{help_text} (default: {'on' if f.default else 'off'})")
                continue
            if "(default:" not in help_text and f.default is not None:  # else the help says what None means
                help_text += f" (default: {f.default})"
            kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=f.default, choices=f.metadata["choices"], help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineConfig":
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values.update(overrides)
        return cls(**values)


def bf16_is_fast(device: "torch.device") -> bool:
    """bfloat16 is the default only where the hardware computes it natively."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


SPECULATIVE_METHODS = ("ngram", "suffix")  # spec_decode/proposers.py: one proposer each


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys for the draftless methods."""

    method: str
    num_speculative_tokens: int = 4  # the most draft tokens verified per sequence and step
    prompt_lookup_min: int = 1  # ngram
    prompt_lookup_max: int = 4  # ngram
    suffix_decoding_max_tree_depth: int = 24  # suffix: longest context matched
    # suffix: requests whose outputs the shared table keeps (vLLM's default is 10000; each cached token
    # costs max_tree_depth table entries in Python here, so the default is smaller)
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: draft at most this x the matched length
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop the draft below this probability

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From `--speculative-config` JSON text or a dict; a ValueError names what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        if value.get("method") not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {value.get('method')!r}")
        config = cls(**value)
        config._validate()
        return config

    def _validate(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")

        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            positive_int(name)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1]")
