"""The built model's weights, saved once in the layout the kernels read and memory-mapped at later starts.

Splitting a GGUF file's blocks into integers and packing them into the quantized GEMM's panels
(quant.py) takes seconds at every start, yet its result depends only on the checkpoint's bytes, the
dtype, the quantization and the packed layout (quant.layout_key: one layout for every CPU target the
kernels are built for, so MINIVLLM_CPU_ARCH's builds share it). So the first start writes it under the
cache directory, keyed by all four, and later starts map the file and use its tensors in place: no
split, no pack, and pages shared with the OS page cache (the mapping is private: nothing is written
back). Mapped on 2 MB pages where it can be: decode streams every weight once per token, and on 4 KB
pages the TLB misses and the hardware prefetcher's stops at each page cost the 0.5B ~10 % of its decode
step. The mapping asks for huge pages (MADV_HUGEPAGE), so a fault that reads the file brings in a 2 MB
folio and maps it whole; save() leaves the written file out of the page cache, whose folios from the
write would be small.

One file per entry: 8 bytes of header length, a JSON header (the ModelConfig; per tensor its names,
dtype, shape and offset; per quantized weight its names, k, and per segment its format, rows, shape and
offset), then the tensors' bytes, each at a multiple of 64.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import os
import struct
import tempfile
import warnings
from pathlib import Path

import torch

from minivllm.config import cache_dir
from minivllm.model.loader import checkpoint_digest
from minivllm.model.model_config import ModelConfig
from minivllm.model.quant import QuantizedWeight, Segment, layout_key

CACHE_VERSION = 3  # bump when what is saved changes (3: the model families' config switches)
KEEP_ENTRIES = 6  # the newest entries kept (a model in two dtypes and a few quantizations)
_ALIGN = 64

State = dict[str, "torch.Tensor | QuantizedWeight"]


def cache_file(path: Path, device: torch.device, dtype: torch.dtype, quantization: str, shard: str = "") -> Path | None:
    """Where this model's built weights (or one tensor-parallel rank's shard of them, named by `shard`)
    are cached, or None where there is nothing worth caching: only quantized weights cost time to build,
    packed on the CPU (float weights are mapped from the checkpoint already; CUDA dequantizes)."""
    if quantization == "none" or device.type != "cpu":
        return None
    key = "-".join([checkpoint_digest(path)[:24], str(dtype).removeprefix("torch."), quantization,
                    layout_key(), *([shard] if shard else []), f"v{CACHE_VERSION}"])
    return cache_dir() / "weights" / f"{key}.bin"


def load(file: Path) -> tuple[ModelConfig, State] | None:
    """The whole model's config and the tensors saved in `file`, mapped in place; None if it is missing, cut short or
    of another version."""
    try:
        with open(file, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KB pages, as before
            data.madvise(mmap.MADV_HUGEPAGE)  # see the module's docstring
        (length,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8:8 + length])
        if header.get("version") != CACHE_VERSION:
            return None
        start = _aligned(8 + length)
        state: State = {}

        def mapped(entry: dict) -> torch.Tensor:
            return torch.frombuffer(data, dtype=getattr(torch, entry["dtype"]), count=math.prod(entry["shape"]),
                                    offset=start + entry["offset"]).view(entry["shape"])

        for entry in header["tensors"]:
            if "segments" in entry:
                value = QuantizedWeight(entry["k"], [Segment(s["qtype"], s["n"], mapped(s)) for s in entry["segments"]])
            else:
                value = mapped(entry)
            for name in entry["names"]:
                state[name] = value
        config = ModelConfig(**header["config"])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    with contextlib.suppress(OSError):
        os.utime(file)  # recently used: kept by _prune
    return config, state


def save(file: Path, config: ModelConfig, state: State) -> None:
    """Write the entry aside and rename it into place (a reader never sees half a file); a failure to
    write costs the next start its speed, nothing else."""
    entries: dict[int, dict] = {}  # one entry per weight object, under every name that holds it
    stored: list[tuple[dict, torch.Tensor]] = []  # (where its place is noted, the tensor)
    for name, value in state.items():
        if id(value) in entries:
            entries[id(value)]["names"].append(name)
            continue
        if isinstance(value, QuantizedWeight):
            entry = {"names": [name], "k": value.k, "segments": []}
            for segment in value.segments:
                entry["segments"].append({"qtype": segment.qtype, "n": segment.n})
                stored.append((entry["segments"][-1], segment.packed))
        else:
            entry = {"names": [name]}
            stored.append((entry, value.detach()))
        entries[id(value)] = entry
    offset = 0  # from the start of the data, which follows the header at the next multiple of _ALIGN
    for place, tensor in stored:
        place.update(dtype=str(tensor.dtype).removeprefix("torch."), shape=list(tensor.shape), offset=offset)
        offset += _aligned(tensor.numel() * tensor.element_size())
    header = json.dumps({"version": CACHE_VERSION, "config": dataclasses.asdict(config),
                         "tensors": list(entries.values())}).encode()
    start = _aligned(8 + len(header))
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=file.parent, prefix=".writing-", delete=False) as f:
            try:
                f.write(struct.pack("<Q", len(header)) + header)
                for place, tensor in stored:
                    f.seek(start + place["offset"])  # the gap reads as zeros
                    f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
                f.flush()
                # Out of the page cache once on disk: the next start reads it back on 2 MB pages.
                os.fsync(f.fileno())
                with contextlib.suppress(OSError):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                os.replace(f.name, file)
            except BaseException:
                os.unlink(f.name)
                raise
    except OSError as e:
        warnings.warn(f"minivllm: could not cache the packed weights in {file.parent} ({e}); the next start "
                      "packs them again")
        return
    _prune(file.parent)


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _prune(directory: Path) -> None:
    """Keep the KEEP_ENTRIES most recently used entries: each is about the size of the checkpoint."""
    with contextlib.suppress(OSError):  # another process pruning at the same time
        files = sorted(directory.glob("*.bin"), key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in files[KEEP_ENTRIES:]:
            stale.unlink(missing_ok=True)
