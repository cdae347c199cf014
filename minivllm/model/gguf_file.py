"""A GGUF file, memory-mapped: its metadata, its tensor table, and each tensor's bytes in place.

The gguf package's GGUFReader turns every element of every metadata array (a vocabulary of 50k
tokens, as many merges) into numpy objects, which takes seconds; this reader walks the header once,
keeps scalars and skips arrays, reading one only when asked. The format (ggml's docs/gguf.md):
magic, version, tensor count, metadata count, the metadata as (key, type, value), then per tensor
(name, dims, type, offset), then the tensors' data at the next multiple of `general.alignment`.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minivllm.model.gguf_quants import type_size

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types: id -> struct format of a scalar (8 = string and 9 = array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array not read yet: where it is in the file."""
    type: int
    count: int
    offset: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type: int  # ggml's type id (GGMLQuantizationType)
    shape: tuple[int, ...]  # rows first, as torch and Hugging Face order them (GGUF stores them reversed)
    offset: int  # of its data, from the start of the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        with open(path, "rb") as f:
            # Private (copy-on-write) mapping: the tensors over it are writable views; nothing is written back.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._pos = 0
        if self._read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        self.version, num_tensors, num_kv = self._unpack("<IQQ")
        if self.version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {self.version} is not supported (2 and 3 are)")
        self.metadata: dict[str, Any] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # each metadata entry's bytes, key to value
        for _ in range(num_kv):
            start, key = self._pos, self._string()
            self.metadata[key] = self._value(self._unpack("<I")[0])
            self._spans[key] = (start, self._pos)
        table_start = self._pos
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, kind, tuple(reversed(dims)), offset))
        self._table = (table_start, self._pos)
        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        self.tensors = [GGUFTensorInfo(name, kind, shape, self.data_offset + offset, _nbytes(kind, shape))
                        for name, kind, shape, offset in infos]

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value; arrays are read now (strings as str, numbers as a list)."""
        value = self.metadata.get(key, default)
        if isinstance(value, GGUFArray):
            value = self._array(value)
        return value

    def array_length(self, key: str) -> int:
        value = self.metadata.get(key)
        return value.count if isinstance(value, GGUFArray) else 0

    def raw(self, t: GGUFTensorInfo) -> torch.Tensor:
        """The tensor's bytes in place, flat uint8: no copy, and no page read until used."""
        return torch.frombuffer(self._map, dtype=torch.uint8, count=t.nbytes, offset=t.offset)

    def metadata_bytes(self, prefix: str) -> bytes:
        """The file's bytes of every metadata entry whose key starts with `prefix` (key and value), in order."""
        return b"".join(bytes(self._map[start:end]) for key, (start, end) in self._spans.items() if key.startswith(prefix))

    def write_without_tokenizer_arrays(self, out: Path) -> None:
        """This file copied to `out` byte for byte, less the metadata arrays under tokenizer.ggml. (the
        vocabulary, scores, merges), with `ARCH.vocab_size` added where the file leaves it to the
        vocabulary's length. For readers that parse every array element by element (transformers: most of
        a minute for a 150k vocabulary) when only the model is wanted. The tensor table's offsets count from
        the data section, which starts at the next multiple of the alignment after the shorter header."""
        entries = [self._map[start:end] for key, (start, end) in self._spans.items()
                   if not (key.startswith("tokenizer.ggml.") and isinstance(self.metadata[key], GGUFArray))]
        vocab_key = f"{self.metadata['general.architecture']}.vocab_size"
        if vocab_key not in self.metadata:
            entries.append(struct.pack("<Q", len(vocab_key)) + vocab_key.encode()
                           + struct.pack("<II", 4, self.array_length("tokenizer.ggml.tokens")))  # 4: uint32
        header = (self._map[:8] + struct.pack("<QQ", len(self.tensors), len(entries)) + b"".join(entries)
                  + self._map[self._table[0]:self._table[1]])
        with open(out, "wb") as f:
            f.write(header + bytes(-len(header) % self.alignment))
            f.write(self._map[self.data_offset:])

    # -- parsing ---------------------------------------------------------------------------------------
    def _read(self, n: int) -> bytes:
        data = self._map[self._pos:self._pos + n]
        self._pos += n
        return data

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return self._read(n).decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            array = GGUFArray(item, count, self._pos)
            self._skip_array(array)
            return array
        (value,) = self._unpack(_SCALARS[kind])
        return value

    def _skip_array(self, a: GGUFArray) -> None:
        if a.type in _SCALARS:
            self._pos += struct.calcsize(_SCALARS[a.type]) * a.count
        elif a.type == _STRING:  # each one's length is in front of it
            pos, data = self._pos, self._map
            for _ in range(a.count):
                pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            self._pos = pos
        else:  # nested arrays
            for _ in range(a.count):
                self._value(a.type)

    def _array(self, a: GGUFArray) -> list:
        if a.type in _SCALARS:
            return np.frombuffer(self._map, dtype=np.dtype(_SCALARS[a.type]), count=a.count, offset=a.offset).tolist()
        saved, self._pos = self._pos, a.offset
        try:
            return [self._value(a.type) for _ in range(a.count)]
        finally:
            self._pos = saved


def _nbytes(kind: int, shape: tuple[int, ...]) -> int:
    block, size = type_size(kind)
    return int(np.prod(shape)) // block * size
